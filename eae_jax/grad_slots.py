"""Storing a scanned run's boundaries inside its own gradient buffers.

In the backward of a scanned run of ``L`` blocks, iteration ``i`` reads the
stored boundary ``x_i`` once (to recompute block ``i``) and then writes block
``i``'s parameter gradients. Stored separately, the boundaries (``L`` of them)
and the gradients (``L`` blocks' worth) are both live for the whole backward.
But boundary ``i`` is dead exactly when gradient ``i`` is born, so they can
share bytes: the forward writes boundary ``i`` into the slot that will hold
block ``i``'s gradients of a few large parameter leaves, and the backward,
carrying those buffers through its reverse scan, reads boundary ``i`` out of
slot ``i`` before overwriting the slot, in place, with the gradients. The
buffers then *are* those leaves' gradients. Peak memory drops by ``L``
boundaries (for a LLaMA-1B-like stack at batch 4 x 2048, 16 x 32 MiB).

The bytes move with ``lax.bitcast_convert_type``, so boundary and gradient
dtypes may differ (a bf16 boundary in f32 gradient slots). They move in words
of the narrowest width involved (``SlotPlan.unit``): when boundary and
gradients share a width, the usual case, every reinterpretation keeps the
element size, which XLA treats as a free bitcast, so reading a boundary back
out of two slot rows is one fused copy (a width-changing bitcast splits the
slicing and the concatenation into separate kernels, each a full copy). The slot buffers hold unsigned integers of the gradient's width
while they carry foreign bytes: a float buffer would let a backend quiet a
NaN payload or flush a subnormal that is really half of another number (the
CPU backend does, on bf16 data movement). `to_grads` reinterprets them as
the gradient dtype at the end, a free bitcast. A `SlotPlan` exists only when the float leaves of one block hold at
least as many bytes as one boundary; otherwise the caller stores boundaries
the ordinary way.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np


class SlotPlan(NamedTuple):
    """Where one boundary's bytes go inside one block's gradient slots.

    Attributes:
      leaves: indices (in ``tree_leaves`` order of one block's params) of the
        leaves whose gradient buffers hold boundary bytes.
      elems: per chosen leaf, its element count in one block.
      dtypes: per chosen leaf, its dtype (the gradient dtype).
      chunks: per chosen leaf, ``(byte offset in the boundary, byte count)``
        (byte counts are multiples of the leaf's itemsize; the last one may
        run past the boundary's end into zero padding).
      shape, dtype: the stored boundary's shape and dtype.
      nbytes: the boundary's size in bytes.
      unit: the word size in bytes the bytes move in (the smallest itemsize
        among the boundary and the chosen leaves).

    >>> p = plan([((16,), jnp.float32)], (4, 4), jnp.float32)
    >>> p.leaves, p.chunks, p.nbytes
    ((0,), ((0, 64),), 64)
    """

    leaves: Tuple[int, ...]
    elems: Tuple[int, ...]
    dtypes: Tuple[jnp.dtype, ...]
    chunks: Tuple[Tuple[int, int], ...]
    shape: Tuple[int, ...]
    dtype: jnp.dtype
    nbytes: int
    unit: int


def plan(param_leaf_specs, boundary_shape, boundary_dtype) -> Optional[SlotPlan]:
    """Choose gradient slots for one boundary, largest float leaves first.

    Args:
      param_leaf_specs: ``(shape, dtype)`` per param leaf of ONE block (no
        depth axis), in ``tree_leaves`` order.
      boundary_shape, boundary_dtype: the stored boundary.

    Returns:
      A `SlotPlan`, or None when the block's float leaves are smaller than a
      boundary (or the boundary is not a float array).

    >>> plan([((8,), jnp.float32), ((20,), jnp.float32)], (4, 4), jnp.float32).leaves
    (1,)
    >>> plan([((15,), jnp.float32)], (4, 4), jnp.float32) is None  # one element short of a boundary
    True
    """
    bdtype = jnp.dtype(boundary_dtype)
    if not jnp.issubdtype(bdtype, jnp.floating):
        return None
    nbytes = int(np.prod(boundary_shape, dtype=np.int64)) * bdtype.itemsize
    if nbytes == 0:
        return None
    cands = []
    for idx, (shape, dtype) in enumerate(param_leaf_specs):
        # Ints, bools and typed PRNG keys (which `jnp.dtype` cannot even
        # interpret) get no float gradient to share bytes with.
        if not jnp.issubdtype(dtype, jnp.floating):
            continue
        dtype = jnp.dtype(dtype)
        if dtype.itemsize <= 8:
            elems = int(np.prod(shape, dtype=np.int64))
            if elems:
                cands.append((elems * dtype.itemsize, idx, elems, dtype))
    cands.sort(key=lambda c: (-c[0], c[1]))
    leaves, elems_l, dtypes, chunks = [], [], [], []
    offset = 0
    for size, idx, elems, dtype in cands:
        if offset >= nbytes:
            break
        # Whole elements of the leaf's dtype; the last chunk may overhang the
        # boundary (the overhang is zero padding).
        take = min(size, -(-(nbytes - offset) // dtype.itemsize) * dtype.itemsize)
        leaves.append(idx)
        elems_l.append(elems)
        dtypes.append(dtype)
        chunks.append((offset, take))
        offset += take
    if offset < nbytes:
        return None
    # Itemsizes are powers of two, so the smallest divides every chunk
    # offset and length, and the boundary's size.
    unit = min([bdtype.itemsize] + [d.itemsize for d in dtypes])
    return SlotPlan(tuple(leaves), tuple(elems_l), tuple(dtypes), tuple(chunks), tuple(boundary_shape), bdtype,
                    nbytes, unit)


def _to_words(x: jax.Array, unit: int) -> jax.Array:
    """``x`` flattened into unsigned words of ``unit`` bytes."""
    # A wider dtype gains a trailing word axis, one of the word's width does
    # not; the final reshape flattens either.
    return jax.lax.bitcast_convert_type(x.reshape(-1), _uint(unit)).reshape(-1)


def _from_words(w: jax.Array, dtype, unit: int) -> jax.Array:
    """Flat words of ``unit`` bytes reinterpreted as ``dtype`` (1-D)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == unit:
        return jax.lax.bitcast_convert_type(w, dtype)
    return jax.lax.bitcast_convert_type(w.reshape(-1, dtype.itemsize // unit), dtype)


def _uint(dtype_or_size) -> jnp.dtype:
    """The unsigned integer type of a dtype's width (or of a size in bytes)."""
    size = dtype_or_size if isinstance(dtype_or_size, int) else jnp.dtype(dtype_or_size).itemsize
    return jnp.dtype({1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size])


def _row(i):
    """Start indices of row ``i``: both of ``i``'s integer type (with
    ``jax_enable_x64`` a literal 0 would be int64 beside an int32 ``i``, which
    the dynamic slice ops refuse)."""
    i = jnp.asarray(i)
    return (i, jnp.zeros_like(i))


def empty_slots(p: SlotPlan, depth: int) -> Tuple[jax.Array, ...]:
    """Zeroed slot buffers, one ``(depth, elems)`` unsigned array (the width of
    the leaf's dtype) per chosen leaf.

    >>> p = plan([((16,), jnp.float32)], (4, 4), jnp.float32)
    >>> [(b.shape, b.dtype.name) for b in empty_slots(p, 3)]
    [((3, 16), 'uint32')]
    """
    return tuple(jnp.zeros((depth, e), _uint(d)) for e, d in zip(p.elems, p.dtypes))


def to_grads(p: SlotPlan, slots: Tuple[jax.Array, ...]) -> Tuple[jax.Array, ...]:
    """The slot buffers reinterpreted as the chosen leaves' gradients ``(depth, elems)``.

    >>> p = plan([((16,), jnp.float32)], (4, 4), jnp.float32)
    >>> to_grads(p, empty_slots(p, 3))[0].dtype
    dtype('float32')
    """
    return tuple(jax.lax.bitcast_convert_type(buf, d) for buf, d in zip(slots, p.dtypes))


def pack(p: SlotPlan, boundary: jax.Array, slots: Tuple[jax.Array, ...], i) -> Tuple[jax.Array, ...]:
    """Write ``boundary`` into row ``i`` of the slot buffers (in place under scan).

    >>> p = plan([((16,), jnp.float32)], (4, 4), jnp.float32)
    >>> slots = pack(p, jnp.arange(16.0).reshape(4, 4), empty_slots(p, 3), 1)
    >>> unpack(p, slots, 1)[1]
    Array([4., 5., 6., 7.], dtype=float32)
    """
    u = p.unit
    raw = _to_words(boundary, u)
    end = max(off + n for off, n in p.chunks) // u
    if end > raw.shape[0]:
        raw = jnp.concatenate([raw, jnp.zeros((end - raw.shape[0],), raw.dtype)])
    out = []
    for buf, dtype, (off, n) in zip(slots, p.dtypes, p.chunks):
        piece = _from_words(jax.lax.slice_in_dim(raw, off // u, (off + n) // u), _uint(dtype), u)
        out.append(jax.lax.dynamic_update_slice(buf, piece[None], _row(i)))
    return tuple(out)


def unpack(p: SlotPlan, slots: Tuple[jax.Array, ...], i) -> jax.Array:
    """Read the boundary stored in row ``i`` of the slot buffers.

    >>> p = plan([((16,), jnp.float32)], (4, 4), jnp.float32)
    >>> unpack(p, pack(p, jnp.ones((4, 4)), empty_slots(p, 2), 0), 0).shape
    (4, 4)
    """
    u = p.unit
    parts: List[jax.Array] = []
    for buf, dtype, (off, n) in zip(slots, p.dtypes, p.chunks):
        count = n // jnp.dtype(dtype).itemsize
        row = jax.lax.dynamic_slice(buf, _row(i), (1, count))[0]
        parts.append(_to_words(row, u))
    raw = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return _from_words(raw[: p.nbytes // u], p.dtype, u).reshape(p.shape)


def store_grads(p: SlotPlan, slots: Tuple[jax.Array, ...], grad_leaves, i) -> Tuple[jax.Array, ...]:
    """Overwrite row ``i`` of each slot buffer with that block's gradient leaf.

    ``grad_leaves`` are all of one block's gradient leaves (``tree_leaves``
    order); only the chosen ones are written.

    >>> p = plan([((16,), jnp.float32)], (4, 4), jnp.float32)
    >>> slots = store_grads(p, empty_slots(p, 2), [jnp.full((16,), 0.5)], 1)
    >>> to_grads(p, slots)[0][:, 0]
    Array([0. , 0.5], dtype=float32)
    """
    out = []
    for buf, dtype, k in zip(slots, p.dtypes, p.leaves):
        bits = jax.lax.bitcast_convert_type(grad_leaves[k].astype(dtype).reshape(1, -1), buf.dtype)
        out.append(jax.lax.dynamic_update_slice(buf, bits, _row(i)))
    return tuple(out)
