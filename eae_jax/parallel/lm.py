"""Shardings of the LLaMA-style LM (`eae_jax.models.llama`) and its training state.

Weights are ``(out, in)`` (torch's layout). Megatron-style tensor
parallelism splits q/k/v and the FFN's gate/up by output rows (column
parallel: each device holds whole heads / a slice of the hidden width) and
the output and down projections by input columns (row parallel: one
all-reduce after each); FSDP splits the model-width dimension of every
weight. Which mesh axis each logical name goes to is `LOGICAL_AXIS_RULES`.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from eae_jax.parallel.mesh import mesh_size
from eae_jax.parallel.rules import LOGICAL_AXIS_RULES, tree_shardings

#: Logical axes of one decoder block's params (`eae_jax.blocks.BlockConfig.param_shapes`).
BLOCK_LOGICAL_AXES = {
    "attn_norm": {"scale": ("norm",)},
    "attn": {"wq": ("heads", "embed"), "wk": ("kv_heads", "embed"), "wv": ("kv_heads", "embed"),
             "wo": ("embed", "heads")},
    "ffn_norm": {"scale": ("norm",)},
    "ffn": {"w_gate": ("mlp", "embed"), "w_up": ("mlp", "embed"), "w_down": ("embed", "mlp")},
}


def _stacked(tree):
    return jax.tree_util.tree_map(lambda lg: ("layers",) + lg, tree, is_leaf=lambda x: isinstance(x, tuple))


def lm_logical_axes(cfg, mesh=None) -> dict:
    """Logical axes of every LM param (the dict `eae_jax.models.init_lm` makes).

    Megatron splits whole heads: ``num_heads`` must divide over ``model``;
    k/v projections with fewer kv heads than ``model`` devices are
    replicated over it (as Megatron does for GQA), not split inside a head.

    >>> from eae_jax.blocks import BlockConfig
    >>> from eae_jax.models import LMConfig
    >>> axes = lm_logical_axes(LMConfig(32, 2, BlockConfig(16, 4, 2, 24)))
    >>> axes["blocks"]["attn"]["wo"], axes["embed"]
    (('layers', 'embed', 'heads'), ('vocab', 'embed'))

    Raises:
      ValueError: ``num_heads`` does not split over the mesh's ``model`` axis.
    """
    block = {k: dict(v) for k, v in BLOCK_LOGICAL_AXES.items()}
    if mesh is not None:
        tp = mesh_size(mesh, "model")
        if cfg.block.num_heads % tp:
            raise ValueError(f"tensor parallelism over model={tp} splits whole heads: num_heads="
                             f"{cfg.block.num_heads} does not divide by {tp}")
        if cfg.block.num_kv_heads % tp:
            block["attn"].update(wk=(None, "embed"), wv=(None, "embed"))
    axes = {"embed": ("vocab", "embed"), "blocks": _stacked(block), "final_norm": {"scale": ("norm",)}}
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("vocab", "embed")
    return axes


def lm_param_shardings(cfg, params: Any, mesh, rules=LOGICAL_AXIS_RULES) -> dict:
    """`NamedSharding` of every LM param on ``mesh`` (``params``: arrays or shape structs).

    >>> import jax
    >>> from eae_jax.blocks import BlockConfig
    >>> from eae_jax.models import LMConfig, init_lm
    >>> from eae_jax.parallel import make_mesh
    >>> cfg = LMConfig(32, 2, BlockConfig(16, 4, 2, 24))
    >>> shardings = lm_param_shardings(cfg, init_lm(jax.random.key(0), cfg), make_mesh("data=1"))
    >>> tuple(shardings["blocks"]["ffn"]["w_down"].spec)       # one device: nothing split
    (None, None, None)
    """
    return tree_shardings(lm_logical_axes(cfg, mesh), params, mesh, rules)


def opt_state_shardings(tx: optax.GradientTransformation, opt_state: Any, param_shardings: Any, mesh) -> Any:
    """Shardings of an optax state: a leaf shaped like a param (AdamW's moments)
    gets that param's sharding, every other leaf (counts) is replicated.

    >>> import jax.numpy as jnp, optax
    >>> from eae_jax.parallel import make_mesh
    >>> mesh = make_mesh("data=1")
    >>> tx = optax.adamw(1e-3)
    >>> params = {"w": jnp.zeros((4, 2))}
    >>> p_sh = {"w": NamedSharding(mesh, PartitionSpec("fsdp"))}
    >>> tuple(opt_state_shardings(tx, tx.init(params), p_sh, mesh)[0].mu["w"].spec)
    ('fsdp',)
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(tx, lambda leaf, sharding: sharding, opt_state, param_shardings,
                                 transform_non_params=lambda leaf: replicated)
