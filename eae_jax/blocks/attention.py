"""Causal self-attention with grouped-query heads and RoPE."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from eae_jax.blocks.linear import init_linear, linear
from eae_jax.blocks.rope import RopeTables, apply_rope


def init_attention(key: jax.Array, dim: int, num_heads: int, num_kv_heads: int, dtype=jnp.float32) -> dict:
    """Params ``{'wq': (H*hd, D), 'wk': (KV*hd, D), 'wv': (KV*hd, D), 'wo': (D, H*hd)}``.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import init_attention
      >>> params = init_attention(jax.random.key(0), dim=8, num_heads=2, num_kv_heads=1)
      >>> {name: w.shape for name, w in params.items()}
      {'wq': (8, 8), 'wk': (4, 8), 'wv': (4, 8), 'wo': (8, 8)}
    """
    head_dim = dim // num_heads
    kq, kk, kv, ko = jax.random.split(key, 4)
    return {
        "wq": init_linear(kq, num_heads * head_dim, dim, dtype),
        "wk": init_linear(kk, num_kv_heads * head_dim, dim, dtype),
        "wv": init_linear(kv, num_kv_heads * head_dim, dim, dtype),
        "wo": init_linear(ko, dim, num_heads * head_dim, dtype),
    }


def default_attention_impl(dtype, head_dim: int) -> str:
    """``'cudnn'`` (fused flash attention) on a GPU for fp16/bf16 with a head size
    cuDNN takes (a multiple of 8, at most 128), else ``'xla'``.

    `jax.nn.dot_product_attention` with ``implementation=None`` takes the XLA
    path, which materialises the (seq x seq) scores and is much slower at
    long sequences, hence the explicit choice.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.blocks.attention import default_attention_impl
      >>> default_attention_impl(jnp.float32, 64)       # fp32 never takes the fused kernel
      'xla'
    """
    if (
        jax.default_backend() == "gpu"
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 8 == 0
        and head_dim <= 128
    ):
        return "cudnn"
    return "xla"


def causal_attention(
    params: dict,
    x: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    rope: Optional[RopeTables],
    rope_style: str = "interleaved",
    implementation: Optional[str] = None,
    project_qkv: Optional[Callable[[dict, jax.Array], tuple]] = None,
    project_out: Optional[Callable[[dict, jax.Array], jax.Array]] = None,
) -> jax.Array:
    """Causal (grouped-query) self-attention.

    Query head ``h`` attends with kv head ``h // (num_heads // num_kv_heads)``
    (torch's ``repeat_interleave`` grouping). The softmax runs through
    `jax.nn.dot_product_attention` with the implementation
    `default_attention_impl` picks (the fused cuDNN kernel on a GPU in bf16).
    Named for checkpoint policies (`jax.ad_checkpoint.checkpoint_name`):
    ``attn_q``, ``attn_k``, ``attn_v`` (after RoPE) and ``attn_out`` (the
    attention output before the output projection).

    Args:
      params: see `init_attention`.
      x: ``(batch, seq, D)``.
      num_heads, num_kv_heads: head counts; ``num_kv_heads`` divides ``num_heads``.
      rope: cos/sin tables covering ``seq``, or None for no positional rotation.
      rope_style: ``interleaved`` or ``half``.
      implementation: forwarded to `jax.nn.dot_product_attention`; None
        picks one with `default_attention_impl`.
      project_qkv: replacement for the q/k/v projections,
        ``project_qkv(params, x) -> (q, k, v)`` with flat head axes (an fp8
        seam, for instance).
      project_out: replacement for the output projection,
        ``project_out(params, o) -> (batch, seq, D)``.

    Returns:
      ``(batch, seq, D)`` in ``x``'s dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import causal_attention, init_attention, rope_tables
      >>> params = init_attention(jax.random.key(0), dim=8, num_heads=2, num_kv_heads=1)
      >>> attend = lambda x: causal_attention(params, x, num_heads=2, num_kv_heads=1, rope=rope_tables(4, 4))
      >>> x = jax.random.normal(jax.random.key(1), (1, 4, 8))
      >>> y = attend(x)
      >>> y.shape
      (1, 4, 8)
      >>> y_changed = attend(x.at[:, 3].set(0.0))                   # change the last position only
      >>> bool(jnp.allclose(y[:, :3], y_changed[:, :3]))            # earlier positions do not see it
      True
    """
    if x.ndim != 3:
        raise ValueError(f"attention expects (batch, seq, dim) input, got shape {x.shape}")
    batch, seq, _ = x.shape
    head_dim = params["wq"].shape[0] // num_heads
    if project_qkv is None:
        q, k, v = (linear(x, params[name]) for name in ("wq", "wk", "wv"))
    else:
        q, k, v = project_qkv(params, x)
    q = q.reshape(batch, seq, num_heads, head_dim)
    k = k.reshape(batch, seq, num_kv_heads, head_dim)
    v = v.reshape(batch, seq, num_kv_heads, head_dim)
    if rope is not None:
        q = apply_rope(q, rope, rope_style)
        k = apply_rope(k, rope, rope_style)
    # Names a `jax.checkpoint` policy can keep (`save_only_these_names`):
    # the attention inputs after RoPE and its output before the projection.
    q, k, v = (checkpoint_name(t, name) for t, name in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
    impl = implementation if implementation is not None else default_attention_impl(q.dtype, head_dim)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    out = checkpoint_name(out.reshape(batch, seq, num_heads * head_dim), "attn_out")
    return linear(out, params["wo"]) if project_out is None else project_out(params, out)
