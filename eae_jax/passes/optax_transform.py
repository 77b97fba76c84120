"""`to_optax`: an adjoint pass as an optax gradient transformation.

The other direction of `from_optax`: a pass runs on parameter gradients
inside an ``optax.chain``, e.g. ``optax.chain(to_optax(clip_by_norm(1.0)),
optax.adam(1e-3))``. What a pass gets in a stack, it gets here as follows:

* **one boundary per gradient leaf**: every float leaf of the updates, in
  `jax.tree_util.tree_leaves` order, is one adjoint with its own pass state
  (so `clip_by_norm` bounds each leaf's norm, not the global norm);
  ``PassContext.boundary`` and ``block`` are the leaf's index,
  ``num_boundaries`` the leaf count (so `at_layers` picks leaves). Leaves
  that are not floating pass through untouched.
* **the step**: ``PassContext.step`` is the number of updates so far,
  counted in the transform's state (what pass schedules follow).
* **the key**: the PRNG key given to `to_optax` is split once per leaf at
  ``init``; a pass that draws randomness (`gaussian_noise`) carries and
  splits its key in its state from there, so a run is reproducible from
  that one key.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from eae_jax.passes.base import AdjointTransformation, PassContext, apply_pass, as_pass


class ToOptaxState(NamedTuple):
    """State of `to_optax`.

    Attributes:
      step: int32 scalar, updates done so far.
      passes: one pass state per leaf of the params (None for a leaf that
        is not floating), as a tuple in `jax.tree_util.tree_leaves` order.

    >>> from eae_jax.passes import identity
    >>> to_optax(identity()).init({"w": jnp.ones(2)}).step
    Array(0, dtype=int32)
    """

    step: jax.Array
    passes: tuple


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.floating)


def to_optax(pass_: Any, key: Optional[jax.Array] = None) -> optax.GradientTransformationExtraArgs:
    """An adjoint pass as an optax transform over gradient pytrees (see the module docstring).

    Args:
      pass_: an `AdjointTransformation` (or an optax transform, which
        comes back wrapped once more).
      key: PRNG key (typed, raw ``uint32[2]`` or an int seed) for the
        passes' initial state; default ``key(0)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``: ``init(params)``,
      ``update(updates, state, params=None, **extra_args)`` (extra
      arguments are ignored).

    Raises:
      TypeError: ``pass_`` is not a pass; at ``update``, updates whose
        leaves differ in number from the params given to ``init``.

    >>> import optax
    >>> from eae_jax.passes import clip_by_norm
    >>> tx = optax.chain(to_optax(clip_by_norm(1.0)), optax.sgd(1.0))
    >>> params = {"a": jnp.full(4, 3.0), "b": jnp.full(1, 0.5)}
    >>> updates, state = tx.update(params, tx.init(params))
    >>> [round(float(jnp.linalg.norm(u)), 4) for u in jax.tree_util.tree_leaves(updates)]  # each leaf on its own
    [1.0, 0.5]
    """
    from eae_jax.reconstruct.state import as_prng_key

    inner: AdjointTransformation = as_pass(pass_)
    base_key = as_prng_key(key)

    def init(params):
        leaves = jax.tree_util.tree_leaves(params)
        keys = jax.random.split(base_key, max(len(leaves), 1))
        states = tuple(inner.init(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), k) if _is_float(leaf) else None
                       for leaf, k in zip(leaves, keys))
        return ToOptaxState(jnp.zeros((), jnp.int32), states)

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if len(leaves) != len(state.passes):
            raise TypeError(f"to_optax({inner.name}): the updates have {len(leaves)} leaves, the params given to "
                            f"init had {len(state.passes)}")
        out, new = [], []
        for i, (g, s) in enumerate(zip(leaves, state.passes)):
            if not _is_float(g):
                out.append(g)
                new.append(s)
                continue
            index = jnp.int32(i)
            g, s = apply_pass(inner, g, s, PassContext(index, index, state.step, len(leaves)))
            out.append(g)
            new.append(s)
        return jax.tree_util.tree_unflatten(treedef, out), ToOptaxState(state.step + 1, tuple(new))

    return optax.GradientTransformationExtraArgs(init, update)
