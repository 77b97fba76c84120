"""RMSNorm as a pure function."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_rms_norm(dim: int, dtype=jnp.float32) -> dict:
    """Params of an RMSNorm of width `dim`: ``{'scale': ones(dim)}``.

    Example:
      >>> from eae_jax.blocks import init_rms_norm
      >>> init_rms_norm(3)["scale"].tolist()
      [1.0, 1.0, 1.0]
    """
    return {"scale": jnp.ones((dim,), dtype)}


def rms_norm(params: dict, x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Root-mean-square normalisation over the last axis.

    Computes ``(x * rsqrt(mean(x**2) + eps)).astype(x.dtype) * scale`` with the
    statistics in float32 whatever ``x.dtype`` is, then casts back before the
    gain is applied (the seed's and Hugging Face LLaMA's order of operations).

    Args:
      params: ``{'scale': (D,)}``.
      x: ``(..., D)`` floating array.
      eps: added to the mean square.

    Returns:
      Array of ``x``'s shape; dtype is ``x.dtype`` promoted with ``scale``'s.

    Raises:
      TypeError: ``x`` is not floating point (an integer input would be
        normalised and then truncated back to integers).
      ValueError: last axis of ``x`` differs from the width of ``scale``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.blocks import rms_norm
      >>> x = jnp.array([[3.0, -3.0, 3.0, -3.0]])     # root mean square 3
      >>> rms_norm({"scale": jnp.full((4,), 2.0)}, x, eps=0.0).tolist()
      [[2.0, -2.0, 2.0, -2.0]]
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"rms_norm: input must be floating point, got dtype {x.dtype}")
    scale = params["scale"]
    if x.shape[-1] != scale.shape[-1]:
        raise ValueError(f"rms_norm: input width {x.shape[-1]} != scale width {scale.shape[-1]} (x shape {x.shape})")
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return (xf * inv).astype(x.dtype) * scale.astype(x.dtype)
