"""Adjoint passes: pure transforms of the adjoint flowing between blocks.

Protocol and combinators live in `eae_jax.passes.base`; the built-in passes
each in their own module. Every factory returns an `AdjointTransformation`
whose state is a NamedTuple of arrays (one per boundary, threaded through the
jitted step by `eae_jax.reconstruct`). `to_optax` runs a pass inside an
optax chain; numeric hyper-parameters may follow optax schedules of the step
(`eae_jax.passes.schedule`).
"""

from eae_jax.passes.base import (AdjointTransformation, EmptyState, PassContext, as_pass, at_layers, chain,
                                 every_n_steps, from_optax, identity, stateless)
from eae_jax.passes.capture import CaptureState, capture
from eae_jax.passes.clip import ClipState, clip_by_norm
from eae_jax.passes.fp8 import Fp8State, fp8_format_max, fp8_quant
from eae_jax.passes.guard import GuardState, NonFiniteAdjointError, nonfinite_guard
from eae_jax.passes.optax_transform import ToOptaxState, to_optax
from eae_jax.passes.quantize import Int8State, cast_roundtrip, int8_fake_quant
from eae_jax.passes.regularize import NoiseState, decay, gaussian_noise
from eae_jax.passes.schedule import ScalarOrSchedule
from eae_jax.passes.stats import StatsState, statistics
from eae_jax.passes.synthetic import SyntheticState, init_predictor, predictor_apply, synthetic_gradient
from eae_jax.passes.topk import TopKState, topk_compress

__all__ = [
    # protocol and combinators
    "AdjointTransformation", "EmptyState", "PassContext", "as_pass", "at_layers", "chain", "every_n_steps",
    "from_optax", "identity", "stateless", "to_optax",
    # built-in passes
    "capture", "cast_roundtrip", "clip_by_norm", "decay", "fp8_quant", "gaussian_noise", "int8_fake_quant",
    "nonfinite_guard", "statistics", "synthetic_gradient", "topk_compress",
    # their states and helpers
    "CaptureState", "ClipState", "Fp8State", "GuardState", "Int8State", "NoiseState", "NonFiniteAdjointError",
    "ScalarOrSchedule", "StatsState", "SyntheticState", "TopKState", "ToOptaxState", "fp8_format_max",
    "init_predictor", "predictor_apply",
]
