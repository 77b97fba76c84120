"""Named intermediates kept by a `jax.checkpoint` policy.

The forward takes each block's VJP under ``jax.checkpoint(policy=...)`` and
keeps the residuals of that VJP; the backward applies it. A VJP's residuals
include the block's own parameters (a matmul's backward needs its weight);
stored per block of a scanned run they would be a second copy of the whole
stacked params. `Policy.bind` finds them structurally: it traces the
forward once to a jaxpr (from the layout's shapes), and every residual that
is one of the jaxpr's parameter or side inputs, passed through unchanged, is
left out of what the forward keeps and supplied again by the backward from
its own params and side.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, NamedTuple, Optional, Tuple

import jax
from jax.extend.core import Var, jaxpr_as_fun

from eae_jax.reconstruct.storage import OnDevice, Segment, SegmentLayout, Storage

_NAMED_POLICIES = {
    "boundaries": None,
    "dots": "dots_with_no_batch_dims_saveable",
    "dots_all": "dots_saveable",
    "everything": "everything_saveable",
}


def resolve_policy(policy: Any):
    """Map a policy name or `jax.checkpoint_policies` callable to a policy.

    ``None`` / ``'boundaries'``: store only block boundaries (recompute all
    block internals). ``'dots'``: also keep the outputs of matmuls without
    batch dimensions (the projections and FFN GEMMs, not attention scores),
    so the backward skips recomputing them. ``'dots_all'``: keep every
    matmul output. ``'everything'``: keep all internals (no recomputation).
    A callable is used as a `jax.checkpoint` policy.

    Raises:
      ValueError: unknown name.

    >>> resolve_policy("dots") is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    True
    >>> resolve_policy("boundaries") is None
    True
    """
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str):
        if policy not in _NAMED_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(_NAMED_POLICIES)} or a callable")
        name = _NAMED_POLICIES[policy]
        return None if name is None else getattr(jax.checkpoint_policies, name)
    raise ValueError(f"policy must be None, a name or a jax.checkpoint_policies callable, got {policy!r}")


class SplitVJP(NamedTuple):
    """One block's checkpointed VJP split into what the forward keeps and
    what the backward re-supplies (see the module docstring).

    Attributes:
      forward: the closed jaxpr ``(param leaves, x, side leaves) -> (y,
        residual leaves)``.
      residuals: the treedef of the VJP function over its residual leaves.
      sources: per residual leaf, ``('param', j)`` / ``('side', j)`` for an
        input passed through (not kept), or ``('kept', k)``.
      float_in: whether the VJP is taken with respect to ``x`` too.
      state: for a stateful segment the treedef of the block's new state
        (the forward's last outputs), else None.

    >>> import jax.numpy as jnp
    >>> lay = SegmentLayout(Segment(lambda w, x: jnp.tanh(x @ w), "b", False), 1,
    ...                     jax.ShapeDtypeStruct((2, 2), jnp.float32), jax.ShapeDtypeStruct((1, 2), jnp.float32),
    ...                     None, 0)
    >>> split = split_vjp(lay, jax.checkpoint_policies.dots_saveable)
    >>> y, kept = split.save(jnp.eye(2), jnp.ones((1, 2)), None)
    >>> g_w, g_x = split.restore(jnp.eye(2), kept, jnp.ones((1, 2)), None)
    >>> len(kept), g_w.shape, g_x.shape
    (2, (2, 2), (1, 2))
    """

    forward: Any
    residuals: Any
    sources: Tuple[Tuple[str, int], ...]
    float_in: bool
    state: Any = None

    def save(self, params, x, side) -> Tuple[Any, List[jax.Array]]:
        """``(y, kept residuals)`` of one block (``((y, new_state), kept)``
        for a stateful one)."""
        outs = jaxpr_as_fun(self.forward)(*jax.tree_util.tree_leaves(params), x, *jax.tree_util.tree_leaves(side))
        n = len(self.sources)
        y, res = outs[0], outs[1:1 + n]
        kept = [r for r, (src, _) in zip(res, self.sources) if src == "kept"]
        if self.state is None:
            return y, kept
        return (y, jax.tree_util.tree_unflatten(self.state, outs[1 + n:])), kept

    def restore(self, params, kept, g, side):
        """``(param grads, input adjoint or None)`` of one block at adjoint ``g``."""
        given = {"param": jax.tree_util.tree_leaves(params), "side": jax.tree_util.tree_leaves(side), "kept": kept}
        pullback = jax.tree_util.tree_unflatten(self.residuals, [given[src][j] for src, j in self.sources])
        if self.float_in:
            return pullback(g)
        (gp,) = pullback(g)
        return gp, None


def split_vjp(layout: SegmentLayout, policy) -> SplitVJP:
    """Trace one block's VJP under ``jax.checkpoint(policy=policy)`` from the
    layout's shapes and split its residuals (see `SplitVJP`).

    >>> import jax.numpy as jnp
    >>> lay = SegmentLayout(Segment(lambda w, x: jnp.tanh(x @ w), "b", False), 1,
    ...                     jax.ShapeDtypeStruct((2, 2), jnp.float32), jax.ShapeDtypeStruct((1, 2), jnp.float32),
    ...                     None, 0)
    >>> split_vjp(lay, jax.checkpoint_policies.nothing_saveable).sources  # the weight, then the input
    (('param', 0), ('kept', 0))
    """
    p_specs, p_tree = jax.tree_util.tree_flatten(layout.params)
    s_specs, s_tree = jax.tree_util.tree_flatten(layout.side)
    float_in = layout.float_in

    def traced(p_leaves, x, s_leaves):
        params = jax.tree_util.tree_unflatten(p_tree, p_leaves)
        side = jax.tree_util.tree_unflatten(s_tree, s_leaves)
        # A stateful block's new state is the VJP's aux output: kept from the forward, not differentiated.
        block = jax.checkpoint(lambda pp, hh: layout.split(layout.call(pp, hh, side)), policy=policy)
        if float_in:
            return jax.vjp(block, params, x, has_aux=True)
        return jax.vjp(lambda pp: block(pp, x), params, has_aux=True)

    closed, (_, pullback_shape, state_shape) = jax.make_jaxpr(traced, return_shape=True)(p_specs, layout.x, s_specs)
    invars = closed.jaxpr.invars
    n_p = len(p_specs)
    n_state = len(jax.tree_util.tree_leaves(state_shape))
    position = {v: j for j, v in enumerate(invars)}
    sources, kept = [], 0
    for out in closed.jaxpr.outvars[1:len(closed.jaxpr.outvars) - n_state]:
        j = position.get(out) if isinstance(out, Var) else None
        if j is not None and j < n_p:
            sources.append(("param", j))
        elif j is not None and j > n_p:
            sources.append(("side", j - n_p - 1))
        else:
            sources.append(("kept", kept))
            kept += 1
    state = jax.tree_util.tree_structure(state_shape) if layout.segment.stateful else None
    return SplitVJP(closed, jax.tree_util.tree_structure(pullback_shape), tuple(sources), float_in, state)


@dataclasses.dataclass(frozen=True)
class Policy(Storage):
    """Block internals kept by a `jax.checkpoint` policy, so the backward
    need not recompute them (see `resolve_policy` for the names).

    The boundaries are kept on the device, in their own dtype. ``None`` /
    ``'boundaries'`` keeps nothing more: `bind` serves it with `OnDevice`.

    >>> import jax.numpy as jnp
    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w), storage=Policy("dots"))
    >>> jax.grad(lambda w: stack(w, jnp.ones((1, 2))).sum())(jnp.ones((3, 2, 2))).shape
    (3, 2, 2)
    """

    policy: Any = None
    split: Optional[SplitVJP] = None
    kind = "policy"

    def __post_init__(self):
        object.__setattr__(self, "policy", resolve_policy(self.policy))

    def bind(self, layout: SegmentLayout):
        if self.policy is None:
            return OnDevice()
        return dataclasses.replace(self, split=split_vjp(layout, self.policy))

    def _split(self) -> SplitVJP:
        if self.split is None:
            raise RuntimeError("Policy storage used before bind(layout) traced its block (the stack binds it)")
        return self.split

    def save(self, layout, params, x, side):
        return self._split().save(params, x, side)

    def restore(self, layout, params, residual, g, side):
        return self._split().restore(params, residual, g, side)
