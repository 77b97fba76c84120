"""Moving a model between the two RoPE conventions without changing what it computes.

llama2.c and this project's training runs rotate interleaved pairs; Hugging
Face LLaMA rotates the two halves of each head. A model runs under the other
convention once the rows of its query and key projections are permuted
within every head (`eae_jax.blocks.rope.interleaved_to_half_permutation`):
rotation and permutation commute, and q·k is unchanged by permuting both.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from eae_jax.blocks.rope import ROPE_STYLES, interleaved_to_half_permutation
from eae_jax.models.llama import LMConfig, check_lm_params


def _permute_heads(w, heads: int, head_dim: int, perm: np.ndarray):
    """Permute the rows of a stacked ``(depth, heads * head_dim, D)`` projection within each head."""
    depth, rows, dim = w.shape
    return w.reshape(depth, heads, head_dim, dim)[:, :, perm, :].reshape(depth, rows, dim)


def to_rope_style(params: dict, cfg: LMConfig, style: str) -> tuple:
    """``(params, cfg)`` of the same model under RoPE ``style`` (``'interleaved'`` or ``'half'``).

    Only ``wq`` and ``wk`` change (their rows are permuted within each head,
    exactly: no arithmetic); a model already in ``style`` is returned as is.

    Raises:
      ValueError: an unknown style, or params that do not fit ``cfg``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm, lm_apply
      >>> from eae_jax.models.convert import to_rope_style
      >>> cfg = LMConfig(vocab_size=32, depth=2, block=BlockConfig(dim=16, num_heads=2, num_kv_heads=1, ffn_hidden_dim=24))
      >>> params, tokens = init_lm(jax.random.key(0), cfg), jnp.array([[1, 5, 9, 2]])
      >>> half_params, half_cfg = to_rope_style(params, cfg, "half")
      >>> half_cfg.block.rope_style
      'half'
      >>> bool(jnp.allclose(lm_apply(half_params, tokens, half_cfg), lm_apply(params, tokens, cfg), atol=1e-5))
      True
      >>> back, _ = to_rope_style(half_params, half_cfg, "interleaved")
      >>> bool((back["blocks"]["attn"]["wq"] == params["blocks"]["attn"]["wq"]).all())
      True
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"unknown rope style {style!r}; expected one of {ROPE_STYLES}")
    check_lm_params(params, cfg)
    b = cfg.block
    if b.rope_style == style:
        return params, cfg
    perm = interleaved_to_half_permutation(b.head_dim)
    if style == "interleaved":
        perm = np.argsort(perm)  # the inverse permutation
    attn = dict(params["blocks"]["attn"])
    attn["wq"] = _permute_heads(jnp.asarray(attn["wq"]), b.num_heads, b.head_dim, perm)
    attn["wk"] = _permute_heads(jnp.asarray(attn["wk"]), b.num_kv_heads, b.head_dim, perm)
    out = dict(params, blocks=dict(params["blocks"], attn=attn))
    new_cfg = LMConfig(cfg.vocab_size, cfg.depth, dataclasses.replace(b, rope_style=style), cfg.tie_embeddings)
    return out, new_cfg
