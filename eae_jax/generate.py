"""``eae-jax generate``: sample from a trained model, streaming tokens as they come.

    eae-jax generate runs/tiny --prompt "def " --steps 200 --temperature 0.8 --top-p 0.95
    eae-jax generate ../shared/models/stories260K.bin --temperature 0 --steps 256
    eae-jax generate path/to/hf_llama_dir --ids 1,450,4996 --top-k 40 --seed 3

The model is a training run, a llama2.c ``.bin`` / ``.pt`` or a Hugging Face
directory (`eae_jax.model_files.load_model`; ``.pt`` and Hugging Face files
need the torch extra). Decoding runs with a KV cache and one compiled decode
step (`eae_jax.models.decode`).

The prompt is text (``--prompt``, which needs a tokenizer: the one saved
with the run or beside the checkpoint, or ``--tokenizer``; the BOS id is put
in front unless ``--no-bos``) or ids (``--ids 1,2,3``, used as they are).
Without either, generation starts from the BOS id. Output goes to stdout as
it is decoded: text when a tokenizer is known, else the ids (prompt first),
space-separated; ``--output`` forces one. A summary line goes to stderr.

Exit codes: 0 done; 2 bad arguments, files, tokenizer or prompt (all checked
before generating; the message on stderr, no traceback); 1 a failure while
generating (non-finite logits, say), after the tokens produced so far.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional, Sequence, TextIO

#: Exit codes of the command.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``eae-jax generate``.

    Example:
      >>> from eae_jax.generate import build_parser
      >>> args = build_parser().parse_args(["model.bin", "--temperature", "0", "--steps", "8"])
      >>> args.temperature, args.steps, args.top_p
      (0.0, 8, 0.9)
    """
    parser = argparse.ArgumentParser(prog="eae-jax generate", description=__doc__.split("\n\n")[0],
                                     epilog="Exit codes: 0 done, 1 failure while generating, 2 bad arguments or files.")
    parser.add_argument("model", help="training run (directory or a ckpt_<step>), llama2.c .bin/.pt, or HF directory")
    parser.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    parser.add_argument("--ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--tokenizer", help="'bytes', a tokenizer.json, a llama2.c tokenizer.bin, a directory holding "
                                            "one, or 'none' (ids only); default: the one saved with the model")
    parser.add_argument("--steps", type=int, default=256, help="tokens to generate (default 256)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely ids (0: off)")
    parser.add_argument("--top-p", type=float, default=0.9,
                        help="sample among the most likely ids holding this much probability (1: off; default 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    parser.add_argument("--no-bos", action="store_true", help="do not put the BOS id in front of a text prompt")
    parser.add_argument("--output", choices=("auto", "text", "ids"), default="auto",
                        help="text (needs a tokenizer) or ids; auto: text when a tokenizer is known")
    return parser


def parse_ids(text: str, vocab_size: int) -> List[int]:
    """Ids from ``"1,2,3"`` (spaces allowed), each in ``[0, vocab_size)``.

    Raises:
      ValueError: not integers, none, or out of range.

    Example:
      >>> from eae_jax.generate import parse_ids
      >>> parse_ids("1, 5,7", 8)
      [1, 5, 7]
      >>> parse_ids("1,9", 8)
      Traceback (most recent call last):
      ...
      ValueError: --ids must lie in [0, 8): got [9]
    """
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ValueError(f"--ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--ids holds no ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--ids must lie in [0, {vocab_size}): got {bad[:8]}")
    return ids


class TextStream:
    """Writes the text of a growing id sequence as it becomes final.

    Each update decodes the whole sequence and writes what is new; a tail
    ending in U+FFFD (a character whose bytes have not all arrived) waits.

    Example:
      >>> import io
      >>> from eae_jax.generate import TextStream
      >>> from eae_jax.text import ByteTokenizer
      >>> out = io.StringIO()
      >>> stream = TextStream(ByteTokenizer(), [256], out)
      >>> for byte in "é!".encode():
      ...     stream.add(byte)
      >>> out.getvalue()
      'é!'
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], out: TextIO):
        self.tokenizer, self.ids, self.out = tokenizer, list(prompt_ids), out
        self.written = ""
        self._write(final=False)

    def _write(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return
        new = text[len(self.written):]  # decoders here extend the text of a prefix, so this is what is new
        if new:
            self.out.write(new)
            self.out.flush()
        self.written = text

    def add(self, token: int) -> None:
        """Append one id and write the text that is final."""
        self.ids.append(int(token))
        self._write(final=False)

    def close(self) -> None:
        """Write whatever is left (incomplete characters as U+FFFD)."""
        self._write(final=True)


def _resolve_prompt(args, model) -> List[int]:
    cfg, tok, bos = model.config, model.tokenizer, model.meta.get("bos_id")
    if args.prompt is not None and args.ids is not None:
        raise ValueError("give the prompt as --prompt text or as --ids, not both")
    if args.ids is not None:
        return parse_ids(args.ids, cfg.vocab_size)
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"{args.model}: no tokenizer is known for this model, so a text prompt cannot be encoded: "
                             "pass --tokenizer, or the prompt as --ids")
        ids = ([] if args.no_bos or bos is None else [bos]) + tok.encode(args.prompt)
        if not ids:
            raise ValueError("the prompt is empty and the tokenizer has no BOS id to start from")
        return ids
    if bos is None:
        raise ValueError(f"{args.model}: no BOS id is known to start from: give --prompt or --ids")
    return [bos]


def _prepare(args):
    """Everything checked before generating: ``(model, prompt ids, sampling, output mode)``."""
    from eae_jax.model_files import load_model
    from eae_jax.models.sampling import Sampling

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: off), got {args.top_k}")
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k or None,
                        top_p=None if args.top_p == 1.0 else args.top_p)
    model = load_model(args.model, tokenizer=args.tokenizer)
    prompt = _resolve_prompt(args, model)
    total = len(prompt) + args.steps
    if total > model.config.block.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} ids) + --steps {args.steps} = {total} is past the model's context "
                         f"of {model.config.block.max_seq_len} positions")
    mode = args.output
    if mode == "auto":
        mode = "text" if model.tokenizer is not None else "ids"
    if mode == "text" and model.tokenizer is None:
        raise ValueError("--output text needs a tokenizer: pass --tokenizer")
    return model, prompt, sampling, mode


def run(args: argparse.Namespace, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """Generate as ``args`` say, writing to ``out`` (default stdout, messages to ``err``,
    default stderr); returns the exit code.

    Example:
      >>> import io, os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, save_llama2c_bin
      >>> from eae_jax.generate import build_parser, run
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> path = os.path.join(tempfile.mkdtemp(), "model.bin")
      >>> save_llama2c_bin(path, init_lm(jax.random.key(0), cfg), cfg)
      >>> out = io.StringIO()
      >>> run(build_parser().parse_args([path, "--temperature", "0", "--steps", "5"]), out, io.StringIO())
      0
      >>> ids = out.getvalue().split()
      >>> ids[0], len(ids)                        # BOS, then five ids
      ('1', 6)
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        model, prompt, sampling, mode = _prepare(args)
    except (ValueError, OSError, ImportError) as error:  # interop and checkpoint errors are ValueErrors
        print(f"eae-jax generate: error: {error}", file=err)
        return EXIT_USAGE
    import jax

    from eae_jax.models.decode import stream

    key = jax.random.key(args.seed)
    printer = TextStream(model.tokenizer, prompt, out) if mode == "text" else None
    if printer is None:
        out.write(" ".join(str(t) for t in prompt))
        out.flush()
    start, first, count = time.perf_counter(), None, 0
    try:
        for token in stream(model.params, model.config, prompt, args.steps, sampling=sampling, key=key):
            first = time.perf_counter() - start if first is None else first
            count += 1
            if printer is not None:
                printer.add(token)
            else:
                out.write(f" {token}")
                out.flush()
    except Exception as error:  # a failure mid-stream: what came so far stays on stdout
        if printer is not None:
            printer.close()
        out.write("\n")
        print(f"eae-jax generate: failed after {count} tokens: {type(error).__name__}: {error}", file=err)
        return EXIT_FAILED
    if printer is not None:
        printer.close()
    out.write("\n")
    out.flush()
    seconds = time.perf_counter() - start
    after_first = (count - 1) / max(seconds - (first or 0.0), 1e-9) if count > 1 else 0.0
    print(f"[{count} tokens in {seconds:.2f} s: first after {first or 0.0:.2f} s (compilation included), then "
          f"{after_first:.1f} tokens/s; {model.meta.get('format')} model from {model.meta.get('source')}]", file=err)
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``eae-jax generate`` (`build_parser` lists the options); returns the exit code.

    Example:
      >>> from eae_jax.generate import main
      >>> main(["no/such/model.bin"])
      2
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on bad arguments, 0 for --help
        return int(exit_.code or 0)
    return run(args)
