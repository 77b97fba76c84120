"""Boundaries kept in pinned host memory: a scan, or an unrolled run whose copies overlap compute.

JAX's offload checkpoint policies do not cover a scan's carried residuals
(jax-ml/jax#23869), hence these explicit storages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import offload as offload_lib
from eae_jax.reconstruct.adjoint import tie
from eae_jax.reconstruct.storage import BoundaryStorage, SegmentLayout, first_order_only


@dataclasses.dataclass(frozen=True)
class Host(BoundaryStorage):
    """Boundaries in pinned host memory (in ``dtype`` if given).

    A scanned run stays a scan: its boundaries are one stacked host array,
    and each iteration of the backward copies its own boundary back (at most
    two boundaries on the device). No prefetch one block ahead: it measured
    slower (experiments/results/h200/bench_table.md, "one-ahead prefetch");
    `HostUnrolled` is the schedule whose copies overlap compute.

    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x * w), storage=Host())
    >>> jax.grad(lambda w: stack(w, jnp.ones(2)).sum())(jnp.ones((3, 2))).shape
    (3, 2)
    """

    kind = "host"

    def put(self, x):
        return offload_lib.to_host(first_order_only(super().put(x), "host"))

    def get(self, stored, spec):
        return super().get(offload_lib.to_device(stored), spec)


@dataclasses.dataclass(frozen=True)
class HostUnrolled(Host):
    """`Host`, with scanned runs unrolled block by block.

    Each boundary is its own host array and each copy an independent
    transfer: the copy of boundary i to the host runs beside block i+1's
    forward, and in the backward the copy of boundary i-1 back overlaps
    block i's recompute and VJP. Compile time grows with depth. `bind`
    serves unscanned blocks and runs of depth 0 with `Host`.

    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x * w), storage=HostUnrolled())
    >>> [type(s).__name__ for s in stack.storages(jnp.ones((3, 2)), jnp.ones(2))]
    ['HostUnrolled']
    """

    def bind(self, layout: SegmentLayout):
        if layout.segment.scanned and layout.depth > 0:
            return self
        return Host(self.dtype)

    def forward(self, layout, params, x, side):
        """Forward block by block, each boundary its own host array.

        The optimization barrier makes block i+1's input wait for boundary
        i's copy to the host, so at most one boundary is in flight and
        device memory never holds more than two of them.
        """
        stored, states, h = [], [], x
        for i in range(layout.depth):
            p_i = jax.tree_util.tree_map(lambda a, i=i: a[i], params)
            s_i = self.put(h)
            y, state = layout.split(layout.call(p_i, h, side))
            h, s_i = jax.lax.optimization_barrier((y, s_i))
            stored.append(s_i)
            states.append(state)
        return layout.join(h, jax.tree_util.tree_map(lambda *ls: jnp.stack(ls), *states)), tuple(stored)

    def backward(self, layout, params, residuals, g, states, at, side):
        """Block i recomputes and takes its VJP while boundary i-1 comes back
        from the host.

        The copy of boundary i-1 starts only once block i's adjoint exists
        (a barrier on its operand) and must be done when block i's input
        adjoint is (a barrier on the result), so exactly one copy is in
        flight.
        """
        n = layout.depth
        cur = offload_lib.to_device(residuals[n - 1])
        # Gradients go straight into their stacked buffers (in place), so a
        # block's gradients die as soon as they are written.
        grads = None
        sts, nins, nouts = [None] * n, [None] * n, [None] * n
        for i in reversed(range(n)):
            nxt = None
            if i > 0:
                src, g = jax.lax.optimization_barrier((residuals[i - 1], g))
                nxt = offload_lib.to_device(src)
            # Block i's weights are sliced from params that pass a barrier
            # with its adjoint: the same slice in the forward would otherwise
            # be merged with this one (CSE), and the forward's copy of each
            # block's weights (those a GEMM reads through a concatenation)
            # would stay on the device until the backward reaches that block.
            params, g = jax.lax.optimization_barrier((params, g))
            p_i = jax.tree_util.tree_map(lambda a, i=i: a[i], params)
            st_i = jax.tree_util.tree_map(lambda a, i=i: a[i], states)
            gp, gh = layout.vjp(p_i, cur.astype(layout.x.dtype), g, side)
            if grads is None:
                grads = jax.tree_util.tree_map(_zeros_stacked(n), gp)
            grads = jax.tree_util.tree_map(lambda buf, leaf, i=i: _set_row(buf, i, leaf), grads, gp)
            if nxt is not None:
                # All of block i's backward (its weight gradients included,
                # which nothing downstream waits for) completes before block
                # i-1 may start: one block's internals live at a time.
                gh, grads, nxt = jax.lax.optimization_barrier((gh, grads, nxt))
            g, sts[i], nins[i], nouts[i] = tie(at.in_scan(gh, g, st_i, jnp.int32(layout.first + i)))
            cur = nxt
        states = jax.tree_util.tree_map(lambda *ls: jnp.stack(ls), *sts)
        return g, (grads, states, jnp.stack(nins), jnp.stack(nouts))


def _zeros_stacked(n: int):
    """A zero buffer of ``n`` rows shaped like a gradient leaf (a float0
    gradient of an int or key param stays float0: it holds no data)."""

    def zeros(leaf):
        if leaf.dtype == jax.dtypes.float0:
            return np.zeros((n,) + leaf.shape, jax.dtypes.float0)
        return jnp.zeros((n,) + leaf.shape, leaf.dtype)

    return zeros


def _set_row(buf, i: int, leaf):
    if leaf.dtype == jax.dtypes.float0:
        return buf
    return buf.at[i].set(leaf)
