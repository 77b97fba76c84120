"""FSDP inside the reconstructed scan: gather each block's params when it runs.

The stacked params stay sharded (over ``fsdp``, and ``model`` for tensor
parallelism). `gather_block` wraps a block function so that inside the
scan body, forward and backward recomputation alike, the block's slice of
the params is all-gathered over the FSDP axes just for that block, and its
gradient is constrained back to the sharded layout right where the block's
VJP makes it: XLA reduce-scatters each block's gradient inside the
backward loop, and never gathers the whole model at once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from eae_jax.parallel.rules import without_axes


def _is_spec(s) -> bool:
    return s is None or isinstance(s, PartitionSpec)


def map_specs(fn: Callable, specs: Any, tree: Any) -> Any:
    """``fn(spec, leaf)`` for every leaf of ``tree`` under a `PartitionSpec` of
    ``specs`` (a tree prefix of ``tree``); subtrees under None are returned as they are.

    >>> map_specs(lambda s, x: (tuple(s), x), {"a": PartitionSpec("fsdp"), "b": None}, {"a": 1, "b": {"c": 2}})
    {'a': (('fsdp',), 1), 'b': {'c': 2}}
    """
    flat_specs, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
    subtrees = treedef.flatten_up_to(tree)
    out = [sub if spec is None else jax.tree_util.tree_map(lambda leaf, spec=spec: fn(spec, leaf), sub)
           for spec, sub in zip(flat_specs, subtrees)]
    return jax.tree_util.tree_unflatten(treedef, out)


def constrain(tree: Any, specs: Any, mesh) -> Any:
    """`jax.lax.with_sharding_constraint` of every leaf under a spec of ``specs`` (a tree prefix).

    >>> import jax.numpy as jnp
    >>> from eae_jax.parallel import make_mesh
    >>> constrain({"w": jnp.ones(4)}, {"w": PartitionSpec("fsdp")}, make_mesh("data=1"))["w"].shape
    (4,)
    """
    return map_specs(lambda spec, leaf: jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec)),
                     specs, tree)


def gather_block(block_fn: Callable, param_specs: Any, mesh, gather: Sequence[str] = ("fsdp",),
                 x_spec: Optional[PartitionSpec] = None, stateful: bool = False) -> Callable:
    """``block_fn(params, x, *rest)`` with its params gathered over ``gather`` axes inside the call.

    Args:
      block_fn: a block ``fn(params_i, x) -> x`` (one block's params, no depth axis).
      param_specs: the sharded layout of one block's params: a tree (prefix)
        of `PartitionSpec`; None leaves a subtree alone (fp8 scales, say).
      mesh: the mesh the specs refer to.
      gather: the mesh axes gathered for the call (the FSDP axes); axes
        not listed (``model``) stay split: that is tensor parallelism.
      x_spec: optional layout of the block's input and output (the batch
        split), so activations between blocks keep it.
      stateful: ``block_fn`` returns ``(y, new_state)`` (a stack built with
        ``block_state=True``): ``x_spec`` lays out ``y`` only.

    Returns:
      A block function of the same signature: params gathered before the
      block runs, their cotangent constrained to ``param_specs`` (a
      per-block reduce-scatter) in its VJP.

    >>> import jax, jax.numpy as jnp
    >>> from eae_jax.parallel import make_mesh
    >>> block = gather_block(lambda p, x: x * p["w"], {"w": PartitionSpec("fsdp")}, make_mesh("data=1"))
    >>> jax.grad(lambda p: block(p, jnp.ones(4)).sum())({"w": jnp.ones(4)})["w"]
    Array([1., 1., 1., 1.], dtype=float32)
    """
    gathered = jax.tree_util.tree_map(lambda s: None if s is None else without_axes(s, gather), param_specs,
                                      is_leaf=_is_spec)

    @jax.custom_vjp
    def sharded_grads(params):
        return params

    def fwd(params):
        return params, None

    def bwd(_, g):
        return (constrain(g, param_specs, mesh),)

    sharded_grads.defvjp(fwd, bwd)

    def block(params, x, *rest):
        params = constrain(sharded_grads(params), gathered, mesh)
        if x_spec is not None:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, x_spec))
        out = block_fn(params, x, *rest)
        y, state = out if stateful else (out, None)
        if x_spec is not None:
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, x_spec))
        return (y, state) if stateful else y

    block.__name__ = getattr(block_fn, "__name__", "block")
    return block
