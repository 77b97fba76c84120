"""The storage protocol, and the plain one: boundaries kept on the device.

A `Storage` decides what the forward of one segment keeps for its backward
and how the backward gets it back. The stack asks each segment's storage to
`Storage.bind` itself to the segment's `SegmentLayout` once per call,
before the custom VJP is defined; forward and backward then both use that
bound object (see the `eae_jax.reconstruct` package docstring).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.reconstruct.adjoint import AtBoundary


class Segment(NamedTuple):
    """One item of the stack as `reconstruct` got it.

    ``fn(params, x[, side]) -> y``; ``scanned``: applied over a leading
    depth axis of its params with `jax.lax.scan`; ``stateful``: ``fn``
    returns ``(y, new_state)`` (``reconstruct(..., block_state=True)``).

    >>> Segment(lambda p, x: x * p, "scale[0]", False).name
    'scale[0]'
    """

    fn: Callable
    name: str
    scanned: bool
    stateful: bool = False


class SegmentLayout(NamedTuple):
    """What a storage knows of its segment once a call's shapes are known.

    Attributes:
      segment: the `Segment`.
      depth: blocks in the segment (1 for an unscanned block).
      params: one block's params as `jax.ShapeDtypeStruct` (no depth axis).
      x: the segment's input boundary (``ShapeDtypeStruct``).
      side: the side input's structure (``ShapeDtypeStruct`` leaves), or None.
      first: index of the segment's first boundary in the stack.

    >>> lay = SegmentLayout(Segment(lambda p, x: x * p, "s", False), 1,
    ...                     jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32), None, 0)
    >>> lay.float_in, lay.call(jnp.float32(3), jnp.ones(2), None)
    (True, Array([3., 3.], dtype=float32))
    """

    segment: Segment
    depth: int
    params: Any
    x: jax.ShapeDtypeStruct
    side: Any
    first: int

    @property
    def float_in(self) -> bool:
        """Whether the segment's input is floating (carries an adjoint)."""
        return bool(jnp.issubdtype(self.x.dtype, jnp.floating))

    def call(self, params, x, side):
        """One block of the segment applied to ``x``, its output as the block
        returns it: ``y``, or ``(y, new_state)`` for a stateful segment."""
        fn = self.segment.fn
        return fn(params, x) if side is None else fn(params, x, side)

    def split(self, out) -> Tuple[Any, Any]:
        """A block's output as ``(y, new_state)``; the state is None for a
        stateless segment."""
        return (out[0], out[1]) if self.segment.stateful else (out, None)

    def join(self, y, state):
        """Inverse of `split`: what a stateful segment's forward returns."""
        return (y, state) if self.segment.stateful else y

    def output(self, params, x, side) -> jax.Array:
        """``y`` alone: what the backward differentiates (a block's new state
        is an output of the forward only, not differentiated)."""
        return self.split(self.call(params, x, side))[0]

    def vjp(self, params, x, g, side):
        """Recompute one block from its (device-resident) input ``x`` and pull
        ``g`` back: ``(param grads, input adjoint or None)``."""
        if self.float_in:
            _, pullback = jax.vjp(lambda pp, hh: self.output(pp, hh, side), params, x)
            return pullback(g)
        _, pullback = jax.vjp(lambda pp: self.output(pp, x, side), params)
        (gp,) = pullback(g)
        return gp, None


class Storage:
    """What one segment's forward keeps, and how its backward gets it back.

    Subclasses implement `save` and `restore` for one block; `forward` and
    `backward` run a scanned segment as ``lax.scan`` over them, and a
    storage that needs the whole run at once (buffers carried across blocks,
    an unrolled schedule) overrides those two instead. `bind` is called
    once per call with the segment's layout and returns the storage that
    serves it (itself, a copy holding what the layout decides, or another
    storage where this one does not apply).

    A storage keeping each block's input as it is, in full:

    >>> class Inputs(Storage):
    ...     def save(self, layout, params, x, side):
    ...         return layout.call(params, x, side), x
    ...     def restore(self, layout, params, residual, g, side):
    ...         return layout.vjp(params, residual, g, side)
    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x * w), storage=Inputs())
    >>> jax.grad(lambda w: stack(w, jnp.ones(2)).sum())(jnp.ones((3, 2))).shape
    (3, 2)
    """

    #: Short name of where the residuals live (reported by `Reconstructed.storages`).
    kind = "abstract"

    def bind(self, layout: SegmentLayout) -> "Storage":
        """The storage that serves the segment of ``layout`` (default: ``self``)."""
        del layout
        return self

    def save(self, layout: SegmentLayout, params, x, side) -> Tuple[Any, Any]:
        """Run one block forward: ``(output, residual for its backward)``; the
        output is `SegmentLayout.call`'s, ``(y, new_state)`` for a stateful
        segment."""
        raise NotImplementedError

    def restore(self, layout: SegmentLayout, params, residual, g, side):
        """One block's VJP at adjoint ``g`` from its residual: ``(param grads, input adjoint or None)``."""
        raise NotImplementedError

    def forward(self, layout: SegmentLayout, params, x, side):
        """A scanned segment's forward: ``(output, residuals stacked over
        blocks)``; a stateful segment's output is ``(y, new states stacked
        over blocks)`` (`SegmentLayout.join`)."""

        def body(h, p_i):
            out, res = self.save(layout, p_i, h, side)
            y, state = layout.split(out)
            return y, (res, state)

        y, (res, states) = jax.lax.scan(body, x, params)
        return layout.join(y, states), res

    def backward(self, layout: SegmentLayout, params, residuals, g, states, at: AtBoundary, side):
        """A scanned segment's backward, last block first.

        Returns ``(input adjoint, (param grads, pass states, norms in, norms
        out))``, the last three stacked over the segment's boundaries.
        """

        def body(gg, xs):
            p_i, r_i, st_i, b = xs
            gp, gh = self.restore(layout, p_i, r_i, gg, side)
            gh, st_i, nin, nout = at.in_scan(gh, gg, st_i, b)
            return gh, (gp, st_i, nin, nout)

        idx = layout.first + jnp.arange(layout.depth, dtype=jnp.int32)
        return jax.lax.scan(body, g, (params, residuals, states, idx), reverse=True)


def zero_grads(params):
    """Zero gradients of ``params``: float zeros, and float0 (no data) for an int or key leaf.

    >>> [g.dtype for g in zero_grads([jnp.ones(2), jnp.arange(2)])]
    [dtype('float32'), dtype([('float0', 'V')])]
    """
    return jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, p.dtype) if jnp.issubdtype(p.dtype, jnp.inexact)
                                  else np.zeros(p.shape, jax.dtypes.float0), params)


def cast_boundary(x: jax.Array, dtype) -> jax.Array:
    """``x`` in ``dtype`` when both are given and ``x`` is floating, else ``x``.

    >>> cast_boundary(jnp.ones(2), jnp.bfloat16).dtype, cast_boundary(jnp.arange(2), jnp.bfloat16).dtype
    (dtype(bfloat16), dtype('int32'))
    """
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(dtype)
    return x


@dataclasses.dataclass(frozen=True)
class BoundaryStorage(Storage):
    """A storage that keeps each block's input boundary (in ``dtype`` if
    given) and recomputes the block from it. `put` and `get` keep it on the
    device; a subclass that keeps it elsewhere (`Host`) or marks it
    (`GradSlots`) overrides them around these.

    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x * w), storage=BoundaryStorage("bfloat16"))
    >>> stack.storages(jnp.ones((3, 2)), jnp.ones(2))[0].dtype
    dtype(bfloat16)
    >>> BoundaryStorage("bfloat16").put(jnp.ones(2, jnp.float32)).dtype
    dtype(bfloat16)
    """

    dtype: Any = None

    def __post_init__(self):
        if self.dtype is not None:
            object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    def put(self, x: jax.Array):
        """The stored form of boundary ``x``: ``x`` in ``dtype`` (see `cast_boundary`)."""
        return cast_boundary(x, self.dtype)

    def get(self, stored, spec: jax.ShapeDtypeStruct) -> jax.Array:
        """The boundary back on the device, in its own dtype."""
        return stored.astype(spec.dtype)

    def save(self, layout, params, x, side):
        return layout.call(params, x, side), self.put(x)

    def restore(self, layout, params, residual, g, side):
        return layout.vjp(params, self.get(residual, layout.x), g, side)


@dataclasses.dataclass(frozen=True)
class OnDevice(BoundaryStorage):
    """Boundaries kept in device memory (in ``dtype`` if given, e.g. bf16 for
    an fp32 model); the backward recomputes every block from its boundary.

    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x * w), storage=OnDevice())
    >>> jax.grad(lambda w: stack(w, jnp.ones(2)).sum())(jnp.ones((3, 2))).shape
    (3, 2)
    """

    kind = "device"


def first_order_only(x: jax.Array, storage: str) -> jax.Array:
    """``x``, refusing to be differentiated.

    A boundary stored as raw bytes in gradient slots or in host memory has
    no derivative path back to the stack's inputs, so differentiating the
    backward pass (``grad`` of ``grad``) would silently drop terms (or fail
    with a bare memory-space error). First-order use never differentiates
    the forward rule, so this costs nothing there. ``storage`` names the
    storage in the error (``'grad_slots'`` or ``'host'``).

    >>> float(first_order_only(jnp.float32(2), "host"))
    2.0
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return _no_tangent(storage, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _no_tangent(storage, x):
    return x


_FIXES = {
    "grad_slots": ("as raw bytes in gradient buffers", "boundaries_in_grads=False"),
    "host": ("in host memory", "offload=False"),
}


@_no_tangent.defjvp
def _no_tangent_jvp(storage, primals, tangents):
    where, fix = _FIXES[storage]
    raise ValueError(
        "eae_jax.reconstruct: differentiating the stack's backward pass (a higher-order derivative, e.g. grad "
        f"of grad) is not supported with {storage} storage: boundaries stored {where} carry no derivative. Build "
        f"the stack with {fix} (or storage=OnDevice() / Policy(...)) for higher-order derivatives."
    )

