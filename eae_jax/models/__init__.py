"""Whole models built from `eae_jax.blocks`, and generation from them with a KV cache (`decode`, `sampling`)."""

from eae_jax.models.llama import (
    LMConfig,
    check_lm_params,
    cross_entropy,
    embed,
    head,
    init_lm,
    lm_apply,
    lm_stack,
    merge_grads,
    split_params,
)
from eae_jax.models.decode import KVCache, generate, init_cache, stream
from eae_jax.models.sampling import Sampling

__all__ = [
    "KVCache", "LMConfig", "Sampling", "check_lm_params", "cross_entropy", "embed", "generate", "head", "init_cache",
    "init_lm", "lm_apply", "lm_stack", "merge_grads", "split_params", "stream",
]
