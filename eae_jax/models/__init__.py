"""Whole models built from `eae_jax.blocks`."""

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

__all__ = [
    "LMConfig", "check_lm_params", "cross_entropy", "embed", "head", "init_lm", "lm_apply", "lm_stack",
    "merge_grads", "split_params",
]
