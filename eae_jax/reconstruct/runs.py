"""A scanned run split into consecutive runs of blocks, each with its own storage.

`Runs` lets one `Scan` segment keep, say, its first 10 blocks' boundaries in
the gradient buffers and its last 6 blocks' matmul outputs (``Policy('dots')``):
the middle ground a memory budget asks for (`eae_jax.reconstruct.budget`).

Every run is its own ``lax.scan``, so compile time stays flat in depth. The
runs index the segment's stacked params in place (a static slice per run
would copy them) and write their gradients into one set of buffers carried
through all runs: separate per-run gradient arrays would have to be
concatenated at the end, a second copy of the segment's gradients at the
step's last moment. When a run keeps its boundaries in gradient slots
(`GradSlots`), the slot buffers span the whole segment; the other runs write
their gradients of those leaves into the same rows, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import grad_slots
from eae_jax.reconstruct.host import HostUnrolled
from eae_jax.reconstruct.slots import GradSlots
from eae_jax.reconstruct.storage import SegmentLayout, Storage, first_order_only


def _row(tree, i):
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _uses_own_loop(store: Storage) -> bool:
    """Whether a storage overrides the scanned forward/backward (carries
    buffers across blocks), which `Runs` cannot interleave with others."""
    return type(store).forward is not Storage.forward or type(store).backward is not Storage.backward


@dataclasses.dataclass(frozen=True)
class Runs(Storage):
    """A scanned segment split into runs: ``((blocks, storage), ...)`` in depth order.

    The block counts must add up to the segment's depth. A run may be any
    storage that works block by block (`OnDevice`, `Policy`, `Host`, a
    `Storage` subclass with only ``save``/``restore``) or `GradSlots`;
    `HostUnrolled` and nested `Runs` are refused (use `Host`). A run of
    zero blocks is dropped.

    >>> from eae_jax.reconstruct import GradSlots, Policy, reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w), storage=Runs(((2, GradSlots()), (1, Policy("dots")))))
    >>> w, x = jnp.ones((3, 4, 4)) * 0.1, jnp.ones((1, 4))
    >>> [s.kind for s in stack.storages(w, x)[0].bound]
    ['grad_slots', 'policy']
    >>> jax.grad(lambda w: stack(w, x).sum())(w).shape
    (3, 4, 4)
    """

    runs: Tuple[Tuple[int, Storage], ...] = ()
    bound: Optional[Tuple[Storage, ...]] = None
    slots: Optional[grad_slots.SlotPlan] = None
    kind = "runs"

    def __post_init__(self):
        runs = tuple((n, s) for n, s in self.runs)
        for n, store in runs:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"Runs: block counts must be ints >= 0, got {n!r}")
            if not isinstance(store, Storage):
                raise TypeError(f"Runs: {store!r} is not an eae_jax.reconstruct storage")
            if isinstance(store, (Runs, HostUnrolled)):
                raise ValueError(f"Runs: a run cannot be {type(store).__name__} (use Host for host memory)")
        object.__setattr__(self, "runs", tuple((int(n), s) for n, s in runs if n))

    def _sub(self, layout: SegmentLayout, offset: int, n: int) -> SegmentLayout:
        return layout._replace(depth=n, first=layout.first + offset)

    def bind(self, layout: SegmentLayout):
        total = sum(n for n, _ in self.runs)
        if not layout.segment.scanned:
            raise ValueError(f"Runs: segment {layout.segment.name!r} is a single block, not a Scan")
        if total != layout.depth:
            raise ValueError(f"Runs: the runs hold {total} blocks but segment {layout.segment.name!r} has "
                             f"{layout.depth}")
        bound, offset, plan = [], 0, None
        for n, store in self.runs:
            b = store.bind(self._sub(layout, offset, n))
            if isinstance(b, GradSlots):
                if plan is not None and b.plan != plan:
                    raise ValueError("Runs: gradient-slot runs of one segment must store their boundaries in "
                                     "the same dtype")
                plan = b.plan
            elif _uses_own_loop(b):
                raise ValueError(f"Runs: {type(b).__name__} runs its own loop over the blocks and cannot be "
                                 "one run of several")
            bound.append(b)
            offset += n
        return dataclasses.replace(self, bound=tuple(bound), slots=plan)

    def _bound(self):
        if self.bound is None:
            raise RuntimeError("Runs storage used before bind(layout) (the stack binds it)")
        return self.bound

    def save(self, layout, params, x, side):
        raise TypeError("Runs serves scanned segments only")

    def restore(self, layout, params, residual, g, side):
        raise TypeError("Runs serves scanned segments only")

    def forward(self, layout, params, x, side):
        """Each run's scan in depth order; a stateful segment's new states
        come out of every run and are concatenated (`SegmentLayout.join`)."""
        bound, plan = self._bound(), self.slots
        bufs = grad_slots.empty_slots(plan, layout.depth) if plan is not None else None
        kept, states, h, offset = [], [], x, 0
        for (n, _), store in zip(self.runs, bound):
            sub = self._sub(layout, offset, n)
            idx = offset + jnp.arange(n, dtype=jnp.int32)
            if isinstance(store, GradSlots):
                def body(carry, i, store=store):
                    hh, bb = carry
                    y, state = layout.split(layout.call(_row(params, i), hh, side))
                    return (y, grad_slots.pack(plan, store.put(hh), bb, i)), state

                (h, bufs), state = jax.lax.scan(body, (h, bufs), idx)
                kept.append(None)
            else:
                def body(hh, i, store=store, sub=sub):
                    out, res = store.save(sub, _row(params, i), hh, side)
                    y, state = layout.split(out)
                    return y, (res, state)

                h, (res, state) = jax.lax.scan(body, h, idx)
                kept.append(res)
            states.append(state)
            offset += n
        states = jax.tree_util.tree_map(lambda *ls: jnp.concatenate(ls), *states)
        return layout.join(h, states), (bufs, tuple(kept))

    def backward(self, layout, params, residuals, g, states, at, side):
        """Runs last to first, each a reverse scan; the gradient buffers of
        the whole segment ride in every scan's carry and take each block's
        gradients in its own row, in place."""
        bound, plan = self._bound(), self.slots
        slot_bufs, kept = residuals
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        chosen = set(plan.leaves) if plan is not None else set()
        from_slots = dict(zip(plan.leaves, slot_bufs)) if plan is not None else {}
        # float0 gradients (int, bool, key params) hold no data: none are carried.
        bufs = tuple(from_slots[k] if k in from_slots else
                     (None if not jnp.issubdtype(leaf.dtype, jnp.inexact) else jnp.zeros(leaf.shape, leaf.dtype))
                     for k, leaf in enumerate(p_leaves))
        offsets = np.cumsum([0] + [n for n, _ in self.runs])
        outs = [None] * len(bound)
        for r in reversed(range(len(bound))):
            (n, _), store, offset = self.runs[r], bound[r], int(offsets[r])
            sub = self._sub(layout, offset, n)
            idx = offset + jnp.arange(n, dtype=jnp.int32)

            def body(carry, xs, store=store, sub=sub):
                gg, bb = carry
                i, res_i = xs
                p_i, st_i = _row(params, i), _row(states, i)
                if isinstance(store, GradSlots):
                    slots_i = grad_slots.unpack(plan, tuple(bb[k] for k in plan.leaves), i)
                    gp, gh = layout.vjp(p_i, store.get(slots_i, layout.x), gg, side)
                else:
                    gp, gh = store.restore(sub, p_i, res_i, gg, side)
                bb = _write_row(bb, jax.tree_util.tree_leaves(gp), i, chosen, plan)
                gh, st_i, nin, nout = at.in_scan(gh, gg, st_i, layout.first + i)
                return (gh, bb), (st_i, nin, nout)

            (g, bufs), outs[r] = jax.lax.scan(body, (g, bufs), (idx, kept[r]), reverse=True)
        st, nin, nout = (jax.tree_util.tree_map(lambda *ls: jnp.concatenate(ls), *parts) for parts in zip(*outs))
        grads = []
        for k, leaf in enumerate(p_leaves):
            if k in from_slots:
                j = plan.leaves.index(k)
                grads.append(jax.lax.bitcast_convert_type(bufs[k], plan.dtypes[j]).reshape(leaf.shape))
            elif bufs[k] is None:
                grads.append(np.zeros(leaf.shape, jax.dtypes.float0))
            else:
                grads.append(bufs[k])
        return g, (jax.tree_util.tree_unflatten(treedef, grads), st, nin, nout)


def _write_row(bufs, grad_leaves, i, chosen, plan):
    """Block ``i``'s gradient leaves into row ``i`` of the buffers (in place);
    the slot leaves as raw bytes of the slot width (`first_order_only`)."""
    out = []
    for k, (buf, leaf) in enumerate(zip(bufs, grad_leaves)):
        if buf is None:
            out.append(None)
        elif k in chosen:
            j = plan.leaves.index(k)
            bits = jax.lax.bitcast_convert_type(first_order_only(leaf, "grad_slots").astype(plan.dtypes[j]),
                                                buf.dtype).reshape(1, -1)
            out.append(jax.lax.dynamic_update_slice(buf, bits, (i, jnp.zeros_like(i))))
        else:
            out.append(jax.lax.dynamic_update_index_in_dim(buf, leaf.astype(buf.dtype), i, 0))
    return tuple(out)
