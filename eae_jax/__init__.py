"""eae_jax: explicit adjoint execution for deep block-stacked JAX models."""

from eae_jax import blocks, dtypes, events, fp8, models, passes
from eae_jax.carry import AdjointCarry
from eae_jax.dtypes import DTypePolicy, parse_compute_dtype
from eae_jax.reconstruct import Reconstructed, Scan, reconstruct, resolve_policy

__version__ = "0.1.0"

__all__ = [
    "AdjointCarry", "DTypePolicy", "Reconstructed", "Scan", "blocks", "dtypes", "events", "fp8", "models",
    "parse_compute_dtype",
    "passes", "reconstruct", "resolve_policy",
]
