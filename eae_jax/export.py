"""``eae-jax export``: a model to Hugging Face (safetensors + config.json) or llama2.c (``.bin`` / ``.pt``).

    eae-jax export runs/tiny exported/tiny_hf                  # HF directory, loadable by transformers
    eae-jax export runs/tiny tiny.bin                          # llama2.c .bin (what run.c reads)
    eae-jax export runs/tiny tiny.pt                           # llama2.c training checkpoint (.pt)
    eae-jax export path/to/hf_dir model.bin --format llama2c   # any source eae-jax generate reads

The source is anything `eae_jax.model_files.load_model` reads; usually a
training run (its newest checkpoint). The format follows the output's
suffix (``.bin``: llama2.c, ``.pt``: llama2.c ``.pt``, anything else: a
Hugging Face directory) unless ``--format`` says. The RoPE convention is
converted as the target needs (`eae_jax.models.convert.to_rope_style`: HF
rotates halves, llama2.c interleaved pairs). A Hugging Face export also gets
the model's tokenizer file, and its BOS / EOS ids in config.json.

Hugging Face and ``.pt`` exports need the torch extra; ``.bin`` does not.
An existing output is replaced only with ``--force``. Exit codes: 0 written;
2 bad arguments, source, output or a model the format cannot express (all
checked before writing); 1 a failure while writing (files are replaced by
rename, so the earlier ones stay whole).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Sequence

import numpy as np

#: Export formats: a Hugging Face directory, a llama2.c .bin, a llama2.c .pt.
FORMATS = ("hf", "llama2c", "llama2c-pt")
#: Exit codes of the command.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: The norm epsilon llama2.c's run.c (and its .bin readers) use; a .bin has no field for it.
LLAMA2C_BIN_EPS = 1e-5


class ExportError(ValueError):
    """An export that cannot be made as asked (nothing written).

    Example:
      >>> from eae_jax.export import ExportError
      >>> issubclass(ExportError, ValueError)
      True
    """


def infer_format(out: str) -> str:
    """The format an output path asks for by its suffix.

    Example:
      >>> from eae_jax.export import infer_format
      >>> infer_format("m.bin"), infer_format("ckpt.pt"), infer_format("exported/hf")
      ('llama2c', 'llama2c-pt', 'hf')
    """
    lower = out.lower()
    if lower.endswith(".bin"):
        return "llama2c"
    if lower.endswith(".pt"):
        return "llama2c-pt"
    return "hf"


def _check_output(out: str, fmt: str, force: bool) -> None:
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ExportError(f"{out}: its folder {parent} does not exist")
    if fmt == "hf":
        if os.path.isfile(out):
            raise ExportError(f"{out} is a file; a Hugging Face export is a directory")
        if os.path.isdir(out) and os.listdir(out) and not force:
            raise ExportError(f"{out} already holds {sorted(os.listdir(out))[:6]}: pass --force to write over it")
        if not os.access(out if os.path.isdir(out) else parent, os.W_OK):
            raise ExportError(f"{out}: not writable")
    else:
        if os.path.isdir(out):
            raise ExportError(f"{out} is a directory; a llama2.c export is a file")
        if os.path.exists(out) and not force:
            raise ExportError(f"{out} already exists: pass --force to replace it")
        if not os.access(parent, os.W_OK):
            raise ExportError(f"{out}: {parent} is not writable")


def _cast(params: dict, dtype) -> dict:
    import jax

    return jax.tree_util.tree_map(lambda p: np.asarray(p).astype(dtype) if dtype is not None else np.asarray(p),
                                  params)


def _hf_base_config(model, cfg) -> dict:
    """config.json fields beyond the architecture: what transformers needs, and the tokenizer's ids."""
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "rope_theta": cfg.block.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.block.rope_theta}}
    tok = model.tokenizer
    bos = model.meta.get("bos_id")
    if bos is not None:
        base["bos_token_id"] = int(bos)
    if tok is not None and tok.eos_id is not None:
        base["eos_token_id"] = int(tok.eos_id)
    return base


def plan_export(model, out: str, fmt: str, dtype: Optional[str] = None, force: bool = False) -> Callable[[], List[str]]:
    """Check that ``model`` can be exported to ``out`` as ``fmt``; returns the function that writes it.

    Everything that can be refused is refused here, before a byte is
    written; calling the returned function writes the files and returns
    their paths.

    Args:
      model: a `eae_jax.model_files.LoadedModel`.
      out: the output directory (``hf``) or file.
      fmt: one of `FORMATS`.
      dtype: ``hf`` only: the stored dtype (``float32``, ``bfloat16``,
        ``float16``; default the params' own).
      force: replace an existing output.

    Raises:
      ExportError: a bad output, format or dtype; interop's
        ``UnsupportedConfigError`` for a model the format cannot express;
        `eae_jax.model_files.TorchRequired` without torch where it is needed.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from eae_jax.model_files import LoadedModel
      >>> from eae_jax.export import plan_export
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=16))
      >>> model = LoadedModel(init_lm(jax.random.key(0), cfg), cfg, None, {"bos_id": None})
      >>> write = plan_export(model, os.path.join(tempfile.mkdtemp(), "m.bin"), "llama2c")
      >>> [os.path.basename(p) for p in write()]
      ['m.bin']
    """
    from eae_jax.models.convert import to_rope_style

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    _check_output(out, fmt, force)
    if dtype is not None and fmt != "hf":
        raise ExportError("--dtype applies to Hugging Face exports; llama2.c files are float32")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise ExportError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if fmt != "llama2c":
        from eae_jax.model_files import require_torch

        require_torch("Hugging Face" if fmt == "hf" else "llama2.c .pt", out)
    target_style = "half" if fmt == "hf" else "interleaved"
    params, cfg = to_rope_style(model.params, model.config, target_style)
    if fmt == "hf":
        import ml_dtypes

        from interop.hf_llama import hf_config_from_lm, save_hf

        base = _hf_base_config(model, cfg)
        hf_config_from_lm(cfg, base)  # raises for what HF LLaMA cannot express
        np_dtype = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, dtype)

        def write() -> List[str]:
            written = [os.path.join(out, "model.safetensors"), os.path.join(out, "config.json")]
            save_hf(out, _cast(params, np_dtype), cfg, base_config=base)
            if model.tokenizer is not None:
                written.append(model.tokenizer.save(out))
            return written

        return write
    from interop.llama2c import model_args_from_config

    model_args_from_config(cfg)  # raises for what llama2.c cannot express
    if fmt == "llama2c":
        from interop.llama2c import save_llama2c_bin

        def write() -> List[str]:
            save_llama2c_bin(out, _cast(params, np.float32), cfg)
            return [out]

        return write
    from interop.llama2c import save_llama2c_pt
    from interop.safe_load import atomic_target

    def write() -> List[str]:
        with atomic_target(out) as tmp:
            save_llama2c_pt(tmp, _cast(params, None), cfg)
        return [out]

    return write


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``eae-jax export``.

    Example:
      >>> from eae_jax.export import build_parser
      >>> args = build_parser().parse_args(["runs/tiny", "tiny.bin"])
      >>> args.source, args.out, args.format, args.force
      ('runs/tiny', 'tiny.bin', None, False)
    """
    parser = argparse.ArgumentParser(prog="eae-jax export", description=__doc__.split("\n\n")[0],
                                     epilog="Exit codes: 0 written, 1 failure while writing, 2 bad arguments or files.")
    parser.add_argument("source", help="training run (directory or a ckpt_<step>), llama2.c .bin/.pt, or HF directory")
    parser.add_argument("out", help="output: a directory (hf), a .bin or a .pt file")
    parser.add_argument("--format", choices=FORMATS, help="default: from the output's suffix")
    parser.add_argument("--dtype", help="hf only: float32, bfloat16 or float16 (default: the params' dtype)")
    parser.add_argument("--tokenizer", help="the model's tokenizer, if not saved beside it (see eae-jax generate)")
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    return parser


def run(args: argparse.Namespace, log: Optional[Callable[[str], None]] = None) -> int:
    """Export as ``args`` say; returns the exit code (messages to ``log``, default stderr).

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, save_llama2c_bin
      >>> from eae_jax.export import build_parser, run
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> folder = tempfile.mkdtemp()
      >>> save_llama2c_bin(os.path.join(folder, "a.bin"), init_lm(jax.random.key(0), cfg), cfg)
      >>> run(build_parser().parse_args([os.path.join(folder, "a.bin"), os.path.join(folder, "b.bin")]), log=print)
      wrote ...b.bin (llama2c)
      0
      >>> open(os.path.join(folder, "a.bin"), "rb").read() == open(os.path.join(folder, "b.bin"), "rb").read()
      True
    """
    from eae_jax.model_files import load_model

    log = log or (lambda message: print(message, file=sys.stderr))
    fmt = args.format or infer_format(args.out)
    try:
        model = load_model(args.source, tokenizer=args.tokenizer)
        write = plan_export(model, args.out, fmt, dtype=args.dtype, force=args.force)
    except (ValueError, OSError, ImportError) as error:  # interop and checkpoint errors are ValueErrors
        log(f"eae-jax export: error: {error}")
        return EXIT_USAGE
    eps = model.config.block.norm_eps
    if fmt == "llama2c" and eps != LLAMA2C_BIN_EPS:
        log(f"note: a llama2.c .bin has no norm_eps field and is read with {LLAMA2C_BIN_EPS:g}; this model uses "
            f"{eps:g}, so its logits there differ slightly (the .pt export records it)")
    try:
        written = write()
    except Exception as error:  # a failure while writing: completed files were renamed into place, others not
        log(f"eae-jax export: failed while writing {args.out}: {type(error).__name__}: {error}")
        return EXIT_FAILED
    log(f"wrote {', '.join(written)} ({fmt})")
    if fmt != "hf" and model.tokenizer is not None:
        log(f"the model's tokenizer ({model.tokenizer.kind}) is not part of a llama2.c file: pass it to "
            "eae-jax generate with --tokenizer")
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``eae-jax export`` (`build_parser` lists the options); returns the exit code.

    Example:
      >>> from eae_jax.export import main
      >>> main(["no/such/run", "out.bin"])
      2
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on bad arguments, 0 for --help
        return int(exit_.code or 0)
    return run(args)
