"""Boundaries stored inside the gradient buffers of a scanned run (`eae_jax.grad_slots`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from eae_jax import grad_slots
from eae_jax.reconstruct.storage import BoundaryStorage, OnDevice, SegmentLayout, first_order_only


@dataclasses.dataclass(frozen=True)
class GradSlots(BoundaryStorage):
    """A scanned run's boundaries kept in the buffers that later receive its
    gradients.

    Boundary i goes into the slot that block i's gradients of its largest
    float parameters will fill; the backward reads it out and overwrites it
    with those gradients in place, saving one boundary per block of peak
    memory. `bind` falls back to `OnDevice` (same ``dtype``) for a segment it
    cannot serve: an unscanned block, a run of depth 0, a non-float input,
    or blocks whose float params are smaller than a boundary.

    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w), storage=GradSlots())
    >>> [s.kind for s in stack.storages(jnp.ones((3, 4, 4)), jnp.ones((1, 4)))]
    ['grad_slots']
    """

    plan: Optional[grad_slots.SlotPlan] = None
    kind = "grad_slots"

    def bind(self, layout: SegmentLayout):
        if not (layout.segment.scanned and layout.depth > 0 and layout.float_in):
            return OnDevice(self.dtype)
        stored = self.dtype if self.dtype is not None else layout.x.dtype
        specs = [(leaf.shape, leaf.dtype) for leaf in jax.tree_util.tree_leaves(layout.params)]
        plan = grad_slots.plan(specs, layout.x.shape, stored)
        return OnDevice(self.dtype) if plan is None else dataclasses.replace(self, plan=plan)

    def put(self, x):
        return super().put(first_order_only(x, "grad_slots"))

    def _plan(self) -> grad_slots.SlotPlan:
        if self.plan is None:
            raise RuntimeError("GradSlots storage used before bind(layout) chose its slots (the stack binds it)")
        return self.plan

    def forward(self, layout, params, x, side):
        plan = self._plan()

        def body(carry, xs):
            h, bufs = carry
            p_i, i = xs
            y, state = layout.split(layout.call(p_i, h, side))
            return (y, grad_slots.pack(plan, self.put(h), bufs, i)), state

        (h, bufs), states = jax.lax.scan(body, (x, grad_slots.empty_slots(plan, layout.depth)),
                                         (params, jnp.arange(layout.depth, dtype=jnp.int32)))
        return layout.join(h, states), bufs

    def backward(self, layout, params, residuals, g, states, at, side):
        """Reverse scan whose carry holds the slot buffers: iteration i reads
        boundary i out of row i, then overwrites that row with block i's
        gradients of the chosen leaves (in place); the other leaves'
        gradients are stacked as usual."""
        plan = self._plan()
        chosen = set(plan.leaves)
        idx = layout.first + jnp.arange(layout.depth, dtype=jnp.int32)

        def body(carry, xs):
            gg, bufs = carry
            p_i, st_i, b, i = xs
            h_i = self.get(grad_slots.unpack(plan, bufs, i), layout.x)
            gp, gh = layout.vjp(p_i, h_i, gg, side)
            leaves = jax.tree_util.tree_leaves(gp)
            # Gradients written as raw bytes into the slots: no derivative
            # path either (see `first_order_only`).
            slotted = [first_order_only(l, "grad_slots") if k in chosen else l for k, l in enumerate(leaves)]
            bufs = grad_slots.store_grads(plan, bufs, slotted, i)
            rest = [None if k in chosen else l for k, l in enumerate(leaves)]
            gh, st_i, nin, nout = at.in_scan(gh, gg, st_i, b)
            return (gh, bufs), (rest, st_i, nin, nout)

        (g_new, bufs), (rest, st, nin, nout) = jax.lax.scan(
            body, (g, residuals), (params, states, idx, jnp.arange(layout.depth, dtype=jnp.int32)), reverse=True)
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        from_slots = {k: s.reshape(p_leaves[k].shape) for k, s in zip(plan.leaves, grad_slots.to_grads(plan, bufs))}
        grads = [from_slots[k] if k in from_slots else r for k, r in enumerate(rest)]
        return g_new, (jax.tree_util.tree_unflatten(treedef, grads), st, nin, nout)
