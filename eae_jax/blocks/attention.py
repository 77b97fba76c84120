"""Causal self-attention with grouped-query heads and RoPE."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from eae_jax.blocks.linear import init_linear, linear
from eae_jax.blocks.rope import RopeTables, apply_rope


def init_attention(key: jax.Array, dim: int, num_heads: int, num_kv_heads: int, dtype=jnp.float32) -> dict:
    """Params ``{'wq': (H*hd, D), 'wk': (KV*hd, D), 'wv': (KV*hd, D), 'wo': (D, H*hd)}``."""
    head_dim = dim // num_heads
    kq, kk, kv, ko = jax.random.split(key, 4)
    return {
        "wq": init_linear(kq, num_heads * head_dim, dim, dtype),
        "wk": init_linear(kk, num_kv_heads * head_dim, dim, dtype),
        "wv": init_linear(kv, num_kv_heads * head_dim, dim, dtype),
        "wo": init_linear(ko, dim, num_heads * head_dim, dtype),
    }


def causal_attention(
    params: dict,
    x: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    rope: Optional[RopeTables],
    rope_style: str = "interleaved",
    implementation: Optional[str] = None,
) -> jax.Array:
    """Causal (grouped-query) self-attention.

    Query head ``h`` attends with kv head ``h // (num_heads // num_kv_heads)``
    (torch's ``repeat_interleave`` grouping). The softmax runs through
    `jax.nn.dot_product_attention`, which picks a fused kernel on GPU.

    Args:
      params: see `init_attention`.
      x: ``(batch, seq, D)``.
      num_heads, num_kv_heads: head counts; ``num_kv_heads`` divides ``num_heads``.
      rope: cos/sin tables covering ``seq``, or None for no positional rotation.
      rope_style: ``interleaved`` or ``half``.
      implementation: forwarded to `jax.nn.dot_product_attention`.

    Returns:
      ``(batch, seq, D)`` in ``x``'s dtype.
    """
    if x.ndim != 3:
        raise ValueError(f"attention expects (batch, seq, dim) input, got shape {x.shape}")
    batch, seq, _ = x.shape
    head_dim = params["wq"].shape[0] // num_heads
    q = linear(x, params["wq"]).reshape(batch, seq, num_heads, head_dim)
    k = linear(x, params["wk"]).reshape(batch, seq, num_kv_heads, head_dim)
    v = linear(x, params["wv"]).reshape(batch, seq, num_kv_heads, head_dim)
    if rope is not None:
        q = apply_rope(q, rope, rope_style)
        k = apply_rope(k, rope, rope_style)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return linear(out.reshape(batch, seq, num_heads * head_dim), params["wo"])
