"""Command line for interop: ``python -m interop.cli parity ...`` (also ``eae-jax parity ...``).

``parity [SOURCE]`` runs `interop.parity.run_parity` and prints the table.
SOURCE is a checkpoint (Hugging Face directory, llama2.c ``.bin`` / ``.pt``,
or a ``.pt`` holding a ModuleList of eae_runtime PreNormTransformerBlock),
recognised by content; without it a random reference stack is built from
``--dim/--heads/...``.

Exit codes: 0 every row within tolerance; 1 some row over tolerance (or
NaN); 2 bad arguments (all checked before anything runs: sizes >= 1,
``--tol`` finite and > 0, ``--seq`` within the model's maximum, ``--json``
writable), a checkpoint that cannot be read, or a report that cannot be
written (one line on stderr, no traceback); 3 an internal error (a bug;
the traceback is printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Optional, Sequence

from eae_jax.cli import OneLineParser, UsageError, run_command
from eae_jax.fileio import new_file_mode

EXIT_CODES = """exit codes:
  0  every row within its tolerance
  1  some row over tolerance or NaN
  2  bad argument, unreadable checkpoint, --seq beyond the model's maximum, unwritable --json
  3  internal error (a bug: the traceback is printed)"""

#: Seeds go to torch, numpy and jax.random alike.
MAX_SEED = 2**31 - 1


def _parity_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="eae-jax parity", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXIT_CODES,
        description="Run the torch reference and the JAX port on the same inputs and print per-boundary max abs "
                    "error, relative error and cosine of forward activations, gradients and adjoints (vs "
                    "eae_runtime.EAERuntime). Exits 1 when a tolerance is exceeded.")
    p.add_argument("source", nargs="?", default=None,
                   help="checkpoint: HF LLaMA dir, llama2.c .bin/.pt, or .pt of a PreNormTransformerBlock ModuleList; "
                        "omit for a random reference stack")
    g = p.add_argument_group("random reference stack (no SOURCE)")
    g.add_argument("--dim", type=int, default=64)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--depth", type=int, default=3)
    g.add_argument("--ffn-hidden", type=int, default=128)
    g.add_argument("--max-seq-len", type=int, default=256)
    g.add_argument("--norm-eps", type=float, default=1e-6)
    r = p.add_argument_group("run")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "fp32", "bf16"])
    r.add_argument("--batch", type=int, default=2, help="batch size, >= 1")
    r.add_argument("--seq", type=int, default=16, help="sequence length, 1 .. the model's max_seq_len")
    r.add_argument("--seed", type=int, default=0, help=f"seed of inputs and weights, 0 .. {MAX_SEED}")
    r.add_argument("--pipelines", default="none,int8_clip,fp16",
                   help="comma-separated subset of none,int8_clip,fp16 ('' skips the EAERuntime comparison)")
    r.add_argument("--tol", type=float, default=None,
                   help="override every row's relative-error tolerance (a finite number > 0)")
    r.add_argument("--perturb", type=float, default=0.0,
                   help="add this relative noise to block 0's wq on the JAX side only (a deliberate failure)")
    r.add_argument("--json", default=None, help="also write the report as JSON here (checked writable up front)")
    return p


def check_writable(path: str) -> None:
    """UsageError unless ``path`` can be written as a file (its directory is created when missing).

    >>> check_writable(os.path.join(tempfile.mkdtemp(), "sub", "report.json"))
    """
    if not path or "\0" in path:
        raise UsageError(f"eae-jax parity: error: --json must name a file, got {path!r}")
    if os.path.isdir(path):
        raise UsageError(f"eae-jax parity: error: --json {path} is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=directory)
        os.close(fd)
        os.unlink(probe)
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as err:
        raise UsageError(f"eae-jax parity: error: cannot write --json {path}: {err.strerror or err}") from None


def _write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary in its directory (an earlier report stays whole)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.chmod(tmp, new_file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def check_args(args: argparse.Namespace) -> list:
    """Every argument checked before anything runs; returns the pipelines.

    Raises:
      UsageError: the first bad argument, named.

    Example:
      >>> from interop.cli import _parity_parser, check_args
      >>> check_args(_parity_parser().parse_args(["--pipelines", "none,fp16"]))
      ['none', 'fp16']
      >>> check_args(_parity_parser().parse_args(["--heads", "3"]))
      Traceback (most recent call last):
      ...
      eae_jax.cli.UsageError: eae-jax parity: error: --dim 64 is not a multiple of --heads 3
    """
    def bad(msg):
        raise UsageError(f"eae-jax parity: error: {msg}")

    for name in ("batch", "seq", "depth", "dim", "heads", "kv_heads", "ffn_hidden", "max_seq_len"):
        if getattr(args, name) < 1:
            bad(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.seed <= MAX_SEED:
        bad(f"--seed must be in [0, {MAX_SEED}], got {args.seed}")
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol > 0):
        bad(f"--tol must be a finite number > 0, got {args.tol}")
    if not math.isfinite(args.perturb):
        bad(f"--perturb must be a finite number, got {args.perturb}")
    if args.source is None:
        if args.dim % args.heads:
            bad(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
        if args.heads % args.kv_heads:
            bad(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
        if (args.dim // args.heads) % 2:
            bad(f"the head dimension --dim / --heads = {args.dim // args.heads} must be even (RoPE rotates pairs)")
        if not (math.isfinite(args.norm_eps) and args.norm_eps > 0):
            bad(f"--norm-eps must be a finite number > 0, got {args.norm_eps}")
        if args.seq > args.max_seq_len:
            bad(f"--seq {args.seq} is longer than --max-seq-len {args.max_seq_len}")
    elif not os.path.exists(args.source):
        bad(f"no such checkpoint file or directory: {args.source}")
    if args.json is not None:
        check_writable(args.json)
    from interop.parity import PIPELINES

    pipelines = [s.strip() for s in args.pipelines.split(",") if s.strip()]
    unknown = [s for s in pipelines if s not in PIPELINES]
    if unknown:
        bad(f"unknown pipeline(s) {unknown}; choose from {list(PIPELINES)}")
    return pipelines


def _parity(argv: Sequence[str]) -> int:
    args = _parity_parser().parse_args(list(argv))
    pipelines = check_args(args)
    from interop.errors import InteropError
    from interop.parity import blocks_case, checkpoint_case, run_parity

    try:
        if args.source is None:
            import torch
            from eae_runtime.contrib import PreNormTransformerBlock

            torch.manual_seed(args.seed)
            blocks = torch.nn.ModuleList([
                PreNormTransformerBlock(args.dim, args.heads, num_kv_heads=args.kv_heads, max_seq_len=args.max_seq_len,
                                        ffn_hidden_dim=args.ffn_hidden, norm_eps=args.norm_eps)
                for _ in range(args.depth)])
            case = blocks_case(blocks, dtype=args.dtype, batch=args.batch, seq=args.seq, seed=args.seed,
                               perturb=args.perturb)
        else:
            case = checkpoint_case(args.source, dtype=args.dtype, batch=args.batch, seq=args.seq, seed=args.seed,
                                   perturb=args.perturb)
        report = run_parity(case, pipelines=pipelines, tol=args.tol,
                            info={"source": args.source or "random", "seed": args.seed, "perturb": args.perturb})
    except (InteropError, OSError, ValueError) as err:
        print(f"eae-jax parity: error: {err}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        try:
            _write_json(args.json, report.to_dict())
        except OSError as err:
            print(f"eae-jax parity: error: cannot write --json {args.json}: {err.strerror or err}", file=sys.stderr)
            return 2
    return 0 if report.ok else 1


def parity_main(argv: Optional[Sequence[str]] = None) -> int:
    """``parity`` subcommand; returns 0 (pass), 1 (over tolerance), 2 (error) or 3 (internal error).

    Example:
      >>> from interop.cli import parity_main
      >>> parity_main(["--batch", "0"])                                # a bad argument: exit code 2
      2
    """
    return run_command("eae-jax parity", _parity, list(sys.argv[1:] if argv is None else argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m interop.cli <command> ...`` with the same commands as ``eae-jax`` that live here.

    Example:
      >>> from interop.cli import main
      >>> main(["parity", "--seq", "0"]), main(["export"])
      (2, 2)
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m interop.cli parity [SOURCE] [options]  (see 'parity --help')",
              file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] != "parity":
        print(f"interop.cli: unknown command {argv[0]!r}; available: parity", file=sys.stderr)
        return 2
    return parity_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
