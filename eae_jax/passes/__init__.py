"""Adjoint passes: pure transforms of the adjoint flowing between blocks."""

from eae_jax.passes.base import (
    AdjointTransformation,
    EmptyState,
    PassContext,
    as_pass,
    at_layers,
    chain,
    every_n_steps,
    from_optax,
    identity,
    stateless,
)

__all__ = [
    "AdjointTransformation", "EmptyState", "PassContext", "as_pass", "at_layers", "chain", "every_n_steps",
    "from_optax", "identity", "stateless",
]
