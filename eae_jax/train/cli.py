"""``eae-jax train``: argument parsing for `eae_jax.train.train`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from eae_jax.train.config import PRESETS, TrainConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per TrainConfig field (``--boundary-dtype`` for ``boundary_dtype`` ...)."""
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
        "passes": "adjoint pass chain, e.g. 'int8,clip=1.0' (see eae_jax.train.config.parse_passes)",
        "policy": "reconstruct policy: boundaries | dots | dots_all | everything",
        "data": "token file (.npy or uint16 .bin); default: a learnable synthetic task",
        "grad_accum_dtype": "dtype gradients are accumulated in across microbatches (fp32 | bf16)",
        "devices": "number of devices for data parallelism (default: all)",
        "grad_clip": "global-norm gradient clipping (0: none)",
        "keep": "how many newest checkpoints to keep (0: all)",
        "resume": "resume from the newest checkpoint in <out>/checkpoints (--no-resume refuses an <out> that has "
                  "checkpoints rather than mixing two runs there)",
        "out": "run directory: <out>/checkpoints and <out>/log.jsonl",
    }
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = defaults[field.name].default
        if field.type in ("bool",) or isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text.get(field.name))
            continue
        kind = {int: int, float: float}.get(type(default), str)
        if field.name in ("batch", "seq_len", "devices"):
            kind = int
        if field.name == "grad_clip":
            kind = float
        parser.add_argument(flag, type=kind, default=default, help=help_text.get(field.name))


def run(args: argparse.Namespace) -> int:
    """Build the TrainConfig from parsed args, train, print the summary as JSON.

    Returns 0; 2 for a bad argument, input file, output directory,
    checkpoint or refused fp8 seams (the message on stderr, no traceback); 1 when the run
    diverged (non-finite loss; the last good checkpoint is kept).
    """
    from eae_jax.fp8 import GateRefused, GuardRefused
    from eae_jax.train.loop import train

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    try:
        summary = train(TrainConfig(**values))
    except FloatingPointError as err:
        print(f"eae-jax train: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        print(f"eae-jax train: error: {err}", file=sys.stderr)
        return 2
    except (GateRefused, GuardRefused) as err:  # the model's fp8 seams were refused: a verdict, not a crash
        print(f"eae-jax train: fp8 refused: {err} (train without --dtype fp8_e4m3)", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="eae-jax train", description="Train a LLaMA-style LM with eae_jax.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
