"""Pure-function LLaMA-style blocks: params are plain dicts, blocks are ``fn(params, x)``."""

from eae_jax.blocks.attention import causal_attention, init_attention
from eae_jax.blocks.linear import init_linear, linear
from eae_jax.blocks.norm import init_rms_norm, rms_norm
from eae_jax.blocks.rope import ROPE_STYLES, RopeTables, apply_rope, interleaved_to_half_permutation, rope_tables
from eae_jax.blocks.swiglu import default_ffn_hidden_dim, init_swiglu, swiglu
from eae_jax.blocks.transformer import (
    BlockConfig,
    check_block_params,
    decoder_block,
    init_block,
    init_stack,
    plain_stack,
)

__all__ = [
    "BlockConfig", "RopeTables", "ROPE_STYLES", "apply_rope", "causal_attention", "check_block_params",
    "decoder_block", "default_ffn_hidden_dim", "init_attention", "init_block", "init_linear", "init_rms_norm",
    "init_stack", "init_swiglu", "interleaved_to_half_permutation", "linear", "plain_stack", "rms_norm",
    "rope_tables", "swiglu",
]
