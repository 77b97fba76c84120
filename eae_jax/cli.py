"""The ``eae-jax`` command: a small dispatcher over subcommands.

Each subcommand lives in its own module and is imported only when it is
run, so ``eae_jax`` itself never imports torch (``parity`` needs the torch
extra and lives in the top-level ``interop`` package). To add a subcommand,
add an entry to `COMMANDS`: ``name -> (module, function, one-line help)``;
the function takes the remaining argv list and returns an exit code.

Exit codes, the same for every command: 0 success; 1 the command ran and
found a failure (``train``: the run diverged; ``parity``: a row over
tolerance); 2 the command could not run as asked: a bad argument, input
or output path, unknown command, missing optional dependency (one line on
stderr, no traceback); 3 an internal error, i.e. a bug (the traceback is
printed). A command's ``--help`` lists its own.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import Callable, Dict, Optional, Sequence, Tuple

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


class UsageError(Exception):
    """A bad command line: its one-line message is printed and the command exits 2.

    Example:
      >>> from eae_jax.cli import UsageError, run_command
      >>> def command(argv):
      ...     raise UsageError("demo: error: --steps must be positive")
      >>> run_command("demo", command, [])
      2
    """


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise `UsageError` (one line: ``<prog>: error: <what>``)
    instead of printing the usage and exiting, so `run_command` maps them to exit 2.

    Example:
      >>> from eae_jax.cli import OneLineParser, UsageError
      >>> parser = OneLineParser(prog="demo")
      >>> _ = parser.add_argument("--steps", type=int)
      >>> parser.parse_args(["--steps", "3"]).steps
      3
      >>> try:
      ...     parser.parse_args(["--steps", "x"])
      ... except UsageError as err:
      ...     print(err)
      demo: error: argument --steps: invalid int value: 'x' (see --help)
    """

    def error(self, message):  # noqa: D102 - argparse's hook
        raise UsageError(f"{self.prog}: error: {message} (see --help)")


def run_command(prog: str, fn: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
    """Run ``fn(argv)`` and return its exit code; `UsageError` -> 2 (its line on stderr),
    ``--help`` -> 0, any other exception -> 3 (an internal error: the traceback, then a line
    saying so). Commands turn the failures they expect into their codes themselves.

    >>> run_command("demo", lambda argv: int(argv[0]), ["1"])
    1
    """
    try:
        return int(fn(argv) or 0)
    except UsageError as err:
        print(str(err).splitlines()[0] if str(err) else f"{prog}: error", file=sys.stderr)
        return 2
    except SystemExit as err:  # --help, --version
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 2)
    except Exception:
        traceback.print_exc()
        print(f"{prog}: internal error (a bug, not a problem with the input: please report it with the "
              "traceback above)", file=sys.stderr)
        return 3


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: eae-jax <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in sorted(COMMANDS.items())]
    lines += ["", "Run 'eae-jax <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``eae-jax <command> ...``; returns the process exit code.

    0: success; 1: the command ran and found a failure (e.g. parity over
    tolerance); 2: usage error, bad input, unknown command or missing
    optional dependency; 3: internal error (see the module doc).

    Example:
      >>> from eae_jax.cli import main
      >>> main(["no-such-command"])
      2
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
    return run_command(f"eae-jax {name}", getattr(module, func_name), rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
