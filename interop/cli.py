"""Command line for interop: ``python -m interop.cli parity ...`` (also ``eae-jax parity ...``).

``parity [SOURCE]`` runs `interop.parity.run_parity` and prints the table.
SOURCE is a checkpoint (Hugging Face directory, llama2.c ``.bin`` / ``.pt``,
or a ``.pt`` holding a ModuleList of eae_runtime PreNormTransformerBlock);
without it a random reference stack is built from ``--dim/--heads/...``.

Exit codes: 0 every row within tolerance; 1 some row over tolerance; 2 bad
arguments or a checkpoint that cannot be read (the message says why).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence


def _parity_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eae-jax parity",
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
    r.add_argument("--batch", type=int, default=2)
    r.add_argument("--seq", type=int, default=16)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--pipelines", default="none,int8_clip,fp16",
                   help="comma-separated subset of none,int8_clip,fp16 ('' skips the EAERuntime comparison)")
    r.add_argument("--tol", type=float, default=None, help="override every row's relative-error tolerance")
    r.add_argument("--perturb", type=float, default=0.0,
                   help="add this relative noise to block 0's wq on the JAX side only (a deliberate failure)")
    r.add_argument("--json", default=None, help="also write the report as JSON here")
    return p


def parity_main(argv: Optional[Sequence[str]] = None) -> int:
    """``parity`` subcommand; returns 0 (pass), 1 (over tolerance) or 2 (error)."""
    args = _parity_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    pipelines = [s.strip() for s in args.pipelines.split(",") if s.strip()]
    from interop.errors import InteropError
    from interop.parity import PIPELINES, blocks_case, checkpoint_case, run_parity

    bad = [s for s in pipelines if s not in PIPELINES]
    if bad:
        print(f"eae-jax parity: unknown pipeline(s) {bad}; choose from {list(PIPELINES)}", file=sys.stderr)
        return 2
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
    except (InteropError, FileNotFoundError, ValueError) as err:
        print(f"eae-jax parity: error: {err}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0 if report.ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m interop.cli <command> ...`` with the same commands as ``eae-jax`` that live here."""
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
