"""Bias-free linear layers with torch-layout weights."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for a weight stored as ``(out, in)`` (torch's nn.Linear layout).

    Storing ``(out, in)`` keeps import/export free of transposes and gives
    the fp8 GEMM the contracting-last layout it wants.

    Args:
      x: ``(..., in)``.
      w: ``(out, in)``.

    Returns:
      ``(..., out)`` in the promoted dtype of ``x`` and ``w``.

    Raises:
      ValueError: ``x.shape[-1] != w.shape[1]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.blocks import linear
      >>> w = jnp.arange(6.0).reshape(2, 3)          # out=2, in=3
      >>> linear(jnp.ones((1, 3)), w).tolist()
      [[3.0, 12.0]]
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: input of shape {x.shape} does not match weight of shape {w.shape} (out, in)")
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def init_linear(key: jax.Array, out_features: int, in_features: int, dtype=jnp.float32) -> jax.Array:
    """torch's default nn.Linear init: U(-1/sqrt(in), 1/sqrt(in)), shape ``(out, in)``.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import init_linear
      >>> w = init_linear(jax.random.key(0), 4, 16)
      >>> w.shape, bool(abs(w).max() <= 0.25)
      ((4, 16), True)
    """
    bound = 1.0 / math.sqrt(in_features)
    return jax.random.uniform(key, (out_features, in_features), dtype, -bound, bound)
