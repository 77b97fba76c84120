"""``eae-jax train``: argument parsing for `eae_jax.train.train`.

One flag per `TrainConfig` field, ``--config FILE`` (settings a flag on the
command line overrides) and ``--synthetic``; without ``--data`` or
``--synthetic`` a run trains on text (``--text``, by default the standard
library).

Exit codes: 0 the run finished (the summary is printed as JSON); 1 the run
diverged (a non-finite loss, state or adjoint; the last good checkpoint is
kept); 2 it could not run as asked: a bad argument (every one is checked
before a model is built), config file, text, token file, ``--init`` model,
output directory, a run directory locked by another live run, checkpoints
that do not continue this run or none readable, fp8 seams refused, a
missing optional package, or a write that failed mid-run (disk full: the
message names the step and the file); one line on stderr, no traceback.
3: an internal error (a bug; the traceback is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from eae_jax.cli import OneLineParser, run_command
from eae_jax.train.config import PRESETS, TrainConfig

EXIT_CODES = """exit codes:
  0  the run finished; the summary is printed as JSON
  1  the run diverged (non-finite loss, state or adjoint); the last good checkpoint is kept
  2  bad argument, text, token file, --init model or output directory; run directory locked
     by another run; checkpoints that do not continue this run (or none readable); fp8 seams
     refused; a missing optional package (--tensorboard, --tokenizer bpe:N, --init of a torch
     format); a write failed mid-run (the message names the step and the file)
  3  internal error (a bug: the traceback is printed)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per TrainConfig field (``--boundary-dtype`` for ``boundary_dtype`` ...).

    Example:
      >>> import argparse
      >>> from eae_jax.train.cli import add_arguments
      >>> parser = argparse.ArgumentParser()
      >>> add_arguments(parser)
      >>> args = parser.parse_args(["--boundary-dtype", "bf16", "--steps", "5"])
      >>> args.boundary_dtype, args.steps
      ('bf16', 5)
    """
    defaults = TrainConfig.__dataclass_fields__
    help_text = {
        "preset": f"model/batch preset: {', '.join(PRESETS)}",
        "dtype": "fp32 | bf16 | fp16 | fp8_e4m3 (compute and boundary dtype; params stay fp32; fp8 binds fp8 seams)",
        "fp8_scaling": "activation scaling of the fp8 seams: delayed | static | row",
        "fp8_fallback": "where a failed fp8 check falls back to high precision: step (default; no cond: a step "
                        "with a failed check is dropped and rerun in high precision) | block (the whole block "
                        "call: one lax.cond per block)",
        "fp8_grad_scaling": "e5m2 scales of the fp8 seams' gradients: delayed (default; from the previous step's, "
                            "the first step runs current to observe them) | current (from each gradient's own amax)",
        "fp8_weight_scaling": "e4m3 scales of the fp8 seams' weights: delayed (default; one per weight from the "
                              "previous step's amax: no reduction before the quantization) | channel (one per "
                              "output channel, the most accurate)",
        "passes": "adjoint pass chain, e.g. 'int8,clip=1.0' or 'topk(0.9, error_feedback=false),stats': "
                  "every pass below, by name, with its hyper-parameters",
        "policy": "reconstruct policy: boundaries | dots | dots_all | everything",
        "data": "token file: a .npy array or raw uint16 ids (told apart by content)",
        "text": "train on text: files and folders (UTF-8 text files under them); with no path, the Python "
                "standard library's sources and docs. The default when neither --data nor --synthetic is given",
        "tokenizer": "text runs: bytes (257 ids) | bpe:N (a byte-level BPE of N ids trained on the text) | a "
                     "tokenizer.json or llama2.c tokenizer.bin; default: bytes, or the --init model's own. Saved "
                     "in --out beside the checkpoints",
        "val_fraction": "text runs: the share of documents held out for validation",
        "val_data": "--data runs: a token file to validate on",
        "val_every": "validation loss every N steps, at step 0 and at the end (0: never)",
        "val_batches": "validation batches (of --batch / --microbatches sequences, evenly spread over the "
                       "held-out tokens)",
        "init": "start from this model: a run directory, a llama2.c .bin/.pt or a Hugging Face directory; its "
                "shape replaces the preset's",
        "vocab_size": "vocabulary (default: the tokenizer's for text, else the preset's; never below the "
                      "tokenizer's)",
        "dim": "model width (default: the preset's)", "depth": "number of blocks", "heads": "attention heads",
        "kv_heads": "key/value heads (divides --heads)",
        "ffn": "SwiGLU hidden width (default: the preset's; with --dim: 8/3 of it, rounded up to a multiple of "
               "256, of 16 below 256)",
        "norm_eps": "RMSNorm epsilon (default 1e-6)", "rope_theta": "RoPE base (default 10000)",
        "rope_style": "RoPE pairing: interleaved (llama2.c) | half (Hugging Face)",
        "tie_embeddings": "the head reuses the embedding table",
        "quiet": "no progress bar and no per-step lines (the summary still prints)",
        "tensorboard": "TensorBoard event files in <out>/tensorboard (default: when tensorboardX is installed)",
        "plot": "a PNG of the loss curves in <out>/loss.png at the end (needs matplotlib)",
        "peak_tflops": "peak TFLOP/s of one device for MFU (default: from the device kind; none on CPUs)",
        "profile": "STEP or FIRST:LAST: a jax.profiler trace of those steps in <out>/profile and a table of "
                   "where their time went",
        "grad_accum_dtype": "dtype gradients are accumulated in across microbatches (fp32 | bf16)",
        "devices": "number of devices for data parallelism: the mesh data=N (default: all devices)",
        "mesh": "device mesh, e.g. 'data=2,fsdp=2,model=2' or 'stage=4,data=2': data (batch split), fsdp "
                "(params, gradients and AdamW state split, gathered block by block), model (tensor parallel: "
                "heads and FFN width), stage (GPipe pipeline over --microbatches); axes left out have size 1",
        "coordinator": "multi-host: address:port of process 0's coordinator (or JAX_COORDINATOR_ADDRESS; 'auto': "
                       "let JAX detect a Slurm/Open MPI/TPU cluster)",
        "num_processes": "multi-host: number of processes (or JAX_NUM_PROCESSES)",
        "process_id": "multi-host: this process's index in [0, num_processes) (or JAX_PROCESS_ID)",
        "grad_clip": "global-norm gradient clipping (0: none)",
        "keep": "how many newest checkpoints to keep (0: all)",
        "resume": "resume from the newest readable checkpoint in <out>/checkpoints (a newer unreadable one is "
                  "moved aside to <name>.unreadable, never deleted; --no-resume refuses an <out> that has "
                  "checkpoints rather than mixing two runs there)",
        "out": "run directory: <out>/checkpoints and <out>/log.jsonl; locked while a run writes there",
        "memory_budget": "the fastest step that fits this much device memory per device: bytes ('6GiB', "
                         "'512MiB') or a fraction in (0, 1] of what plain autodiff keeps ('0.5'); the plan (what "
                         "each run of blocks keeps where, predicted peak and time) is printed, the optimizer state "
                         "moves to pinned host memory when it does not fit; a budget below the floor exits 2 "
                         "naming the floor",
        "seed": "seed of params, adjoint-pass state and data order, in [0, 2**63)",
    }
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = defaults[field.name].default
        if field.name == "text":
            parser.add_argument(flag, nargs="*", metavar="PATH", default=None, help=help_text.get(field.name))
            continue
        if field.type in ("bool", "Optional[bool]") or isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text.get(field.name))
            continue
        kind = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float}.get(field.type, str)
        parser.add_argument(flag, type=kind, default=default, help=help_text.get(field.name))


def build_parser() -> argparse.ArgumentParser:
    """The ``eae-jax train`` parser; its help ends with the passes and the exit codes.

    Example:
      >>> from eae_jax.train.cli import build_parser
      >>> parser = build_parser()
      >>> parser.prog, parser.parse_args(["--synthetic"]).synthetic
      ('eae-jax train', True)
    """
    from eae_jax.passes.spec import describe

    parser = OneLineParser(prog="eae-jax train",
                           description="Train a LLaMA-style LM with eae_jax: on text (by default the Python "
                                       "standard library's, which needs no download), a token file (--data) or "
                                       "a synthetic task (--synthetic).",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="passes (--passes NAME, NAME=VALUE or NAME(VALUE, KEY=VALUE, ...); "
                                  "types and defaults):\n" + describe() + "\n\n" + EXIT_CODES)
    add_arguments(parser)
    parser.add_argument("--synthetic", action="store_true",
                        help="train on a learnable synthetic task instead of text (no validation)")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a .json or .toml file of settings (flag names as keys, e.g. dim = 128); flags on the "
                             "command line override it")
    return parser


def parse_args(argv) -> argparse.Namespace:
    """Parse ``eae-jax train`` arguments: a ``--config`` file's settings first, flags over them.

    Raises:
      UsageError: a bad flag; ValueError / FileNotFoundError: a bad config file.

    Example:
      >>> import json, os, tempfile
      >>> from eae_jax.train.cli import parse_args
      >>> config = os.path.join(tempfile.mkdtemp(), "run.json")
      >>> _ = open(config, "w").write(json.dumps({"steps": 7, "lr": 0.01}))
      >>> args = parse_args(["--config", config, "--steps", "3"])     # the flag wins over the file
      >>> args.steps, args.lr
      (3, 0.01)
    """
    from eae_jax.train.config import read_config_file

    args = build_parser().parse_args(argv)
    if args.config is not None:
        values = read_config_file(args.config)
        explicit = build_parser()  # the flags given on the command line: every default suppressed
        for action in explicit._actions:
            action.default = argparse.SUPPRESS
        given = vars(explicit.parse_args(argv))
        for name, value in values.items():
            if name not in given:
                setattr(args, name, value)
    return args


def run(args: argparse.Namespace) -> int:
    """Build the TrainConfig from parsed args, train, print the summary as JSON.

    Returns the exit code (see the module doc); the message of a failure is
    one line on stderr.

    Example:
      >>> from eae_jax.train.cli import parse_args, run
      >>> run(parse_args(["--synthetic", "--data", "tokens.bin"]))   # contradictory: exit code 2, one line on stderr
      2
    """
    from eae_jax.fp8 import GateRefused, GuardRefused
    from eae_jax.train.lock import RunLockedError
    from eae_jax.train.loop import train

    try:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
        if args.synthetic and (values["text"] is not None or values["data"]):
            raise ValueError("--synthetic trains on the synthetic task: drop --text / --data")
        if values["text"] is None and not values["data"] and not args.synthetic:
            values["text"] = []  # the default: real text, the standard library
        summary = train(TrainConfig(**values))
    except FloatingPointError as err:
        print(f"eae-jax train: {err}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError, RunLockedError) as err:  # CheckpointError is a ValueError
        print(f"eae-jax train: error: {err}", file=sys.stderr)
        return 2
    except (GateRefused, GuardRefused) as err:  # the model's fp8 seams were refused: a verdict, not a crash
        print(f"eae-jax train: fp8 refused: {err} (train without --dtype fp8_e4m3)", file=sys.stderr)
        return 2
    except ImportError as err:
        if "pip install" not in str(err):  # not a missing extra (whose messages say what to install): a bug
            raise
        print(f"eae-jax train: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def _main(argv) -> int:
    try:
        args = parse_args(argv)
    except (ValueError, OSError) as err:  # a bad --config file
        print(f"eae-jax train: error: {err}", file=sys.stderr)
        return 2
    return run(args)


def main(argv=None) -> int:
    """``eae-jax train [options]``; returns the exit code (see the module doc).

    Example:
      >>> from eae_jax.train.cli import main
      >>> main(["--steps", "many"])                                    # a bad flag: exit code 2
      2
    """
    return run_command("eae-jax train", _main, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
