"""The ``eae-jax`` command: a small dispatcher over subcommands.

Each subcommand lives in its own module and is imported only when it is
run, so ``eae_jax`` itself never imports torch (``parity`` needs the torch
extra and lives in the top-level ``interop`` package). To add a subcommand,
add an entry to `COMMANDS`: ``name -> (module, function, one-line help)``;
the function takes the remaining argv list and returns an exit code.
"""

from __future__ import annotations

import importlib
import sys
from typing import Dict, Optional, Sequence, Tuple

#: name -> (module, function, help). The function gets the argv after the name.
COMMANDS: Dict[str, Tuple[str, str, str]] = {
    "train": ("eae_jax.train.cli", "main", "train a LLaMA-style LM with boundary-only reconstruction"),
    "export": ("eae_jax.export", "main",
               "write a training run (or any checkpoint) as a Hugging Face directory or a llama2.c .bin/.pt"),
    "generate": ("eae_jax.generate", "main",
                 "sample from a training run, a llama2.c or a Hugging Face checkpoint (KV cache, streamed)"),
    "parity": ("interop.cli", "parity_main",
               "compare the JAX port with the torch reference (needs the torch extra: pip install 'eae-jax[torch]')"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: eae-jax <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in sorted(COMMANDS.items())]
    lines += ["", "Run 'eae-jax <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``eae-jax <command> ...``; returns the process exit code.

    0: success; 1: the command ran and found a failure (e.g. parity over
    tolerance); 2: usage error, unknown command or missing optional dependency.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"eae-jax: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        print(f"eae-jax {name}: cannot import {module_name}: {err}", file=sys.stderr)
        return 2
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
