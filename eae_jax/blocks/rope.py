"""Rotary position embeddings, in both conventions in use.

``interleaved``: pairs ``(x[2i], x[2i+1])`` are rotated (the seed's
`apply_rotary`, llama2.c, Meta's original LLaMA code).
``half``: pairs ``(x[i], x[i + d/2])`` are rotated, the "rotate_half" form of
Hugging Face LLaMA.

Both use the same angles ``pos * theta**(-2i/d)``; a model trained in one
convention runs in the other only after permuting the q/k projection rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ROPE_STYLES = ("interleaved", "half")


class RopeTables(NamedTuple):
    """cos/sin tables, each ``(seq, head_dim // 2)`` float32.

    Example:
      >>> from eae_jax.blocks import RopeTables, rope_tables
      >>> tables = rope_tables(8, 4)
      >>> isinstance(tables, RopeTables), tables.cos.shape
      (True, (8, 2))
    """

    cos: jax.Array
    sin: jax.Array


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0, max_seq_len: int | None = None) -> RopeTables:
    """Compute the RoPE cos/sin tables for positions ``0..seq_len-1``.

    Angles are computed as the seed does: ``inv_freq = 1 / theta**(arange(0, d, 2)/d)``
    in float32, ``angle = pos * inv_freq``.

    Raises:
      ValueError: odd ``head_dim``, or ``seq_len > max_seq_len`` when given.

    Example:
      >>> from eae_jax.blocks import rope_tables
      >>> tables = rope_tables(4, 8)
      >>> tables.cos[0].tolist(), tables.sin[0].tolist()      # position 0: no rotation
      ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
      >>> rope_tables(16, 8, max_seq_len=8)
      Traceback (most recent call last):
      ...
      ValueError: sequence length 16 exceeds the RoPE table length max_seq_len=8
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds the RoPE table length max_seq_len={max_seq_len}")
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos = jnp.arange(seq_len, dtype=jnp.float32)
    angles = pos[:, None] * inv_freq[None, :]
    return RopeTables(jnp.cos(angles), jnp.sin(angles))


def apply_rope(x: jax.Array, tables: RopeTables, style: str = "interleaved") -> jax.Array:
    """Rotate ``x`` of shape ``(batch, seq, heads, head_dim)``.

    The tables are cast to ``x.dtype`` first (as the seed does), so a bf16
    model rotates in bf16.

    Raises:
      ValueError: unknown style, odd head_dim, or tables shorter than the sequence.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import apply_rope, rope_tables
      >>> x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))    # (batch, seq, heads, head_dim)
      >>> y = apply_rope(x, rope_tables(5, 8))
      >>> bool(jnp.allclose(y[:, 0], x[:, 0]))                       # position 0 is not rotated
      True
      >>> bool(jnp.allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), atol=1e-5))
      True
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"unknown rope style {style!r}; expected one of {ROPE_STYLES}")
    seq, head_dim = x.shape[-3], x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if tables.cos.shape[0] < seq or tables.cos.shape[-1] != head_dim // 2:
        raise ValueError(
            f"RoPE tables of shape {tables.cos.shape} do not cover seq={seq}, head_dim={head_dim}"
        )
    cos = tables.cos[:seq, None, :].astype(x.dtype)
    sin = tables.sin[:seq, None, :].astype(x.dtype)
    if style == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        return out.reshape(x.shape)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def interleaved_to_half_permutation(head_dim: int):
    """Row permutation taking a per-head q/k projection from the interleaved
    convention to the half-split one: ``w_half = w_inter[perm]`` per head.

    Output index ``j < d/2`` takes input ``2j``; ``j >= d/2`` takes ``2(j-d/2)+1``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import apply_rope, interleaved_to_half_permutation, rope_tables
      >>> perm = interleaved_to_half_permutation(8)
      >>> perm.tolist()
      [0, 2, 4, 6, 1, 3, 5, 7]
      >>> x, tables = jax.random.normal(jax.random.key(0), (1, 5, 1, 8)), rope_tables(5, 8)
      >>> bool(jnp.allclose(apply_rope(x, tables)[..., perm], apply_rope(x[..., perm], tables, "half"), atol=1e-6))
      True
    """
    import numpy as np

    half = head_dim // 2
    return np.concatenate([np.arange(half) * 2, np.arange(half) * 2 + 1])
