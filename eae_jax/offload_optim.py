"""Optimizer state and fp32 master weights in pinned host memory, streamed through the device.

`offload_optimizer(tx)` wraps an elementwise optax transformation (AdamW,
SGD with momentum, ...: every state array shaped like the params it
updates, the rest scalars such as step counts). Its state, and the master
weights when ``master_dtype`` is given, live in pinned host memory, split
into chunks of rows (a stacked layer's leaf gives one chunk per few
layers). Inside the jitted step each chunk comes to the device, is updated
by ``tx`` itself, and goes back; the copy of the next chunk starts while
this one computes and at most two chunks are on the device at once. The
update is the same function on each chunk as ``tx`` on the whole tree, so
the results are the same bits (XLA:CPU, where the placement is a no-op,
checks it in the tests).

Global-norm clipping is not elementwise: give it as ``grad_clip`` and it
runs on the device over all gradients first (``optax.clip_by_global_norm``,
as ``optax.chain(clip_by_global_norm(c), tx)`` does).

A backend without a ``pinned_host`` memory kind keeps the state on the
device, with a warning that says so (`host_memory_kind`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eae_jax import offload as offload_lib

#: State bytes built on the device at once by `OffloadedOptimizer.init` (more
#: only when one param leaf's state is larger).
INIT_GROUP_BYTES = 1 << 30


def host_memory_kind(device=None) -> Optional[str]:
    """``'pinned_host'`` when ``device`` (default: the first) has that memory kind, else None.

    >>> host_memory_kind() in ("pinned_host", None)
    True
    """
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):  # runtimes without memory spaces
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def host_kind_refused(device_count: int) -> bool:
    """True where a host memory kind is refused for the optimizer state: a CPU
    mesh of several devices (XLA:CPU ran the streamed update's collectives out of
    order across its devices and hung; host memory is the same memory there).

    >>> host_kind_refused(1)
    False
    >>> host_kind_refused(2) == (jax.default_backend() == "cpu")
    True
    """
    return jax.default_backend() == "cpu" and device_count > 1


@jax.tree_util.register_pytree_node_class
class Chunks:
    """One param leaf's state (or master weights) as host arrays, chunk by chunk of rows.

    ``leaf`` is the index of the param leaf (``tree_leaves`` order) it belongs to.

    >>> c = Chunks(0, (jnp.zeros((2, 3)), jnp.zeros((1, 3))))
    >>> c.shape, len(jax.tree_util.tree_leaves(c))
    ((3, 3), 2)
    """

    def __init__(self, leaf: int, parts: Tuple[Any, ...]):
        self.leaf, self.parts = leaf, tuple(parts)

    @property
    def shape(self):
        first = self.parts[0].shape
        return (sum(p.shape[0] for p in self.parts),) + tuple(first[1:]) if first else ()

    def tree_flatten(self):
        return self.parts, self.leaf

    @classmethod
    def tree_unflatten(cls, leaf, parts):
        return cls(leaf, parts)

    def __repr__(self):
        return f"Chunks(leaf={self.leaf}, parts={len(self.parts)})"


class OffloadedState(NamedTuple):
    """The state of `offload_optimizer`: ``inner`` is ``tx``'s state with its
    params-shaped arrays as `Chunks`; ``master`` the master weights as `Chunks`
    (None without ``master_dtype``).

    >>> OffloadedState(None, None).master is None
    True
    """

    inner: Any
    master: Any


def _rows(shape) -> int:
    return int(shape[0]) if len(shape) else 1


def _bounds(shape, row_bytes: int, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Row ranges of one leaf's chunks: as many rows as fit ``chunk_bytes``, at least one."""
    rows = _rows(shape)
    if not len(shape):
        return [(0, 1)]
    per = max(1, chunk_bytes // max(row_bytes, 1))
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


def _take(x, a: int, b: int):
    return x if not x.ndim else jax.lax.slice_in_dim(x, a, b, axis=0)


@dataclasses.dataclass(frozen=True)
class OffloadedOptimizer:
    """``tx`` with its state (and master weights) in pinned host memory; see `offload_optimizer`.

    >>> opt = offload_optimizer(optax.adamw(1e-2))
    >>> params = {"w": jnp.ones((4, 3))}
    >>> state = opt.init(params)
    >>> params, state = jax.jit(opt.apply)({"w": jnp.full((4, 3), 0.5)}, state, params)
    >>> params["w"][0, 0] < 1.0
    Array(True, dtype=bool)
    """

    tx: optax.GradientTransformation
    master_dtype: Any = None
    grad_clip: Optional[float] = None
    chunk_bytes: int = 256 << 20
    memory_kind: Any = "auto"

    @property
    def kind(self) -> Optional[str]:
        """The memory kind the state lives in (None: the device's default)."""
        return host_memory_kind() if self.memory_kind == "auto" else self.memory_kind

    def _put(self, x):
        return offload_lib.to_host(x) if self.kind else x

    def _get(self, x):
        return offload_lib.to_device(x) if self.kind else x

    def _row_bytes(self, params) -> List[int]:
        """Per param leaf, the bytes of its state (and master weights) per row."""
        state = jax.eval_shape(self.tx.init, self._master_spec(params))
        leaves = jax.tree_util.tree_leaves(params)
        per_leaf = [0] * len(leaves)
        for sub in _params_like(state, params):
            for i, l in enumerate(jax.tree_util.tree_leaves(sub)):
                per_leaf[i] += int(np.prod(l.shape[1:], dtype=np.int64)) * jnp.dtype(l.dtype).itemsize
        if self.master_dtype is not None:
            for i, l in enumerate(leaves):
                per_leaf[i] += int(np.prod(l.shape[1:], dtype=np.int64)) * jnp.dtype(self.master_dtype).itemsize
        return per_leaf

    def _chunking(self, params, row_bytes: Optional[List[int]] = None) -> List[List[Tuple[int, int]]]:
        """Per param leaf, its chunks' row ranges (from shapes and state bytes per row)."""
        row_bytes = self._row_bytes(params) if row_bytes is None else row_bytes
        return [_bounds(l.shape, b, self.chunk_bytes) for l, b in zip(jax.tree_util.tree_leaves(params), row_bytes)]

    def _master_spec(self, params):
        if self.master_dtype is None:
            return params
        return jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, self.master_dtype), params)

    def init(self, params) -> OffloadedState:
        """The state: ``tx.init`` of the (master) params, chunked into host memory.

        Built a group of param leaves at a time (`INIT_GROUP_BYTES` of state
        each, or one leaf), so the device never holds more than one group's
        state: a 7B model's fp32 masters and moments would not fit on it.
        """
        if self.kind is None and self.memory_kind == "auto":
            warnings.warn(f"eae_jax.offload_optim: the {jax.default_backend()} backend has no pinned_host memory "
                          "kind; the optimizer state stays in device memory", stacklevel=2)
        row_bytes = self._row_bytes(params)
        bounds = self._chunking(params, row_bytes)

        def whole(params):
            master = None
            if self.master_dtype is not None:
                master = jax.tree_util.tree_map(lambda p: p.astype(self.master_dtype), params)
            return master, self.tx.init(master if master is not None else params)

        def build(group):
            def chunked(params):  # XLA prunes the state of every leaf outside the group
                master, inner = whole(params)
                chunk = lambda i, x: tuple(self._put(_take(x, a, b)) for a, b in bounds[i])  # noqa: E731
                subs = [jax.tree_util.tree_leaves(sub) for sub in _params_like(inner, params)]
                m = None if master is None else jax.tree_util.tree_leaves(master)
                return {i: ([chunk(i, s[i]) for s in subs], None if m is None else chunk(i, m[i])) for i in group}
            return jax.jit(chunked)(params)

        parts = {}
        for group in self._init_groups(params, row_bytes):
            parts.update(build(group))
        # The state's other leaves (step counts ...), then everything put back in tx's structure.
        rest = jax.jit(lambda p: _map_params_like(whole(p)[1], p, lambda sub: None))(params)
        master_spec, inner_spec = jax.eval_shape(whole, params)
        n = len(parts)
        order = iter(range(len(_params_like(inner_spec, params))))

        def subtree(sub):
            k = next(order)
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(sub),
                                                [Chunks(i, parts[i][0][k]) for i in range(n)])

        flat, inner_def = jax.tree_util.tree_flatten(_map_params_like(inner_spec, params, subtree), is_leaf=_is_chunks)
        others = iter(jax.tree_util.tree_leaves(rest))
        inner = jax.tree_util.tree_unflatten(inner_def, [x if _is_chunks(x) else next(others) for x in flat])
        master = None
        if master_spec is not None:
            master = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(master_spec),
                                                  [Chunks(i, parts[i][1]) for i in range(n)])
        return OffloadedState(inner, master)

    def _init_groups(self, params, row_bytes: Optional[List[int]] = None) -> List[List[int]]:
        """Param leaf indices in groups of at most `INIT_GROUP_BYTES` of state (or one leaf)."""
        row_bytes = self._row_bytes(params) if row_bytes is None else row_bytes
        groups, size = [], 0
        for i, (leaf, b) in enumerate(zip(jax.tree_util.tree_leaves(params), row_bytes)):
            b *= _rows(leaf.shape)
            if not groups or size + b > INIT_GROUP_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += b
        return groups

    def place(self, state: OffloadedState, sharding=None) -> OffloadedState:
        """``state`` (e.g. restored from a checkpoint, or put on a mesh) with its
        chunks in host memory: ``sharding`` (default: the first device) in
        this optimizer's memory kind; the scalars stay in device memory.

        A host memory kind on a CPU sharding of several devices is refused
        (XLA:CPU can deadlock there; ``memory_kind=None`` runs the same update).
        """
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        if self.kind and host_kind_refused(len(sharding.device_set)):
            raise ValueError(f"eae_jax.offload_optim: host memory kind {self.kind!r} on a CPU mesh of "
                             f"{len(sharding.device_set)} devices: XLA:CPU can deadlock on the streamed "
                             "update; on CPU host memory is the same memory, so build the optimizer with "
                             "memory_kind=None")
        host = sharding.with_memory_kind(self.kind) if self.kind else sharding

        def put(x):
            return Chunks(x.leaf, tuple(jax.device_put(p, host) for p in x.parts)) if _is_chunks(x) else \
                jax.device_put(x, sharding)

        return jax.tree_util.tree_map(put, state, is_leaf=_is_chunks)

    def apply(self, grads, state: OffloadedState, params):
        """``(new params, new state)``: each chunk's state comes to the device,
        ``tx`` updates it there (the master weights, then the params are
        their cast), and it goes back to host memory."""
        if self.grad_clip:
            grads, _ = optax.clip_by_global_norm(self.grad_clip).update(grads, optax.EmptyState())
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        g_leaves = jax.tree_util.tree_leaves(grads)
        master = None if state.master is None else jax.tree_util.tree_leaves(state.master, is_leaf=_is_chunks)
        # XLA turns a division by a scalar that has one user into a
        # multiplication by its reciprocal (another rounding). Over a whole
        # tree of several leaves, tx's bias corrections have several users;
        # so that each chunk is computed as the whole tree would be, it is
        # updated beside a one-element companion (a slice of itself, whose
        # result, the same number, is written over the chunk's first element
        # so that it stays in the program) when the params have several leaves.
        pair = len(p_leaves) > 1
        marks = lambda x: x is _TAG or x is _PAIR  # noqa: E731
        single = jax.tree_util.tree_leaves(_select(state.inner, params, 0, lambda c: _TAG), is_leaf=marks)
        paired, pair_def = jax.tree_util.tree_flatten(
            _select(state.inner, params, 0, lambda c: (_TAG, _PAIR) if pair else _TAG), is_leaf=marks)
        at = [n for n, leaf in enumerate(paired) if leaf is _TAG]
        counts_at = [n for n, leaf in enumerate(paired) if not marks(leaf)]
        jobs = [(i, k, a, b) for i, leaf in enumerate(p_leaves)
                for k, (a, b) in enumerate(_bounds_of(state, master, i, leaf.shape))]
        new_params, new_parts, counts = list(p_leaves), {}, None

        def load(job):
            i, k, _, _ = job
            sub = _select(state.inner, params, i, lambda c: c.parts[k])
            return jax.tree_util.tree_map(self._get, (sub, None if master is None else master[i].parts[k]))

        def first(x):
            return x.reshape(-1)[:1]

        cur = load(jobs[0])
        for n, (i, k, a, b) in enumerate(jobs):
            nxt = None
            # The next chunk's copy starts once this one is on the device. The
            # barrier also gives each chunk its own copy of the shared scalars
            # (step counts): XLA then computes the bias corrections inside each
            # chunk's kernel, as it does for each leaf of the whole tree, rather
            # than once as reciprocals (other roundings).
            cur = jax.lax.optimization_barrier(cur)
            if n + 1 < len(jobs):
                nxt = load(jobs[n + 1])
            sub, m = cur
            p = m if m is not None else _take(p_leaves[i], a, b)
            g = _take(g_leaves[i], a, b).astype(p.dtype)
            if pair:
                leaves = []
                for x, mark in zip(jax.tree_util.tree_leaves(sub), single):
                    leaves += [x, first(x)] if mark is _TAG else [x]
                sub = jax.tree_util.tree_unflatten(pair_def, leaves)
                (upd, upd1), new_sub = self.tx.update((g, first(g)), sub, (p, first(p)))
                p1 = optax.apply_updates(first(p), upd1)
                p = optax.apply_updates(p, upd).reshape(-1).at[0].set(p1[0]).reshape(p.shape)
            else:
                upd, new_sub = self.tx.update(g, sub, p)
                p = optax.apply_updates(p, upd)
            flat = jax.tree_util.tree_leaves(new_sub)
            counts = [flat[q] for q in counts_at] if counts is None else counts
            stored = jax.tree_util.tree_map(self._put, ([flat[q] for q in at], p if m is not None else None))
            cast = p.astype(p_leaves[i].dtype)
            new_params[i] = cast if not p_leaves[i].ndim else jax.lax.dynamic_update_slice_in_dim(
                new_params[i], cast, a, axis=0)
            if nxt is not None:
                # And it has left for the host before the next one computes.
                stored, nxt = jax.lax.optimization_barrier((stored, nxt))
            new_parts[(i, k)] = stored
            cur = nxt
        old, inner_def = jax.tree_util.tree_flatten(state.inner, is_leaf=_is_chunks)
        fresh, seen, rest = [], 0, iter(counts)
        for leaf in old:
            if _is_chunks(leaf):  # the j-th params-shaped subtree's leaf, subtrees in flatten order
                j = seen // len(p_leaves)
                fresh.append(Chunks(leaf.leaf, tuple(new_parts[(leaf.leaf, k)][0][j] for k in range(len(leaf.parts)))))
                seen += 1
            else:
                fresh.append(next(rest))
        new_master = None
        if master is not None:
            new_master = jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(state.master, is_leaf=_is_chunks),
                [Chunks(i, tuple(new_parts[(i, k)][1] for k in range(len(c.parts)))) for i, c in enumerate(master)])
        return (jax.tree_util.tree_unflatten(p_def, new_params),
                OffloadedState(jax.tree_util.tree_unflatten(inner_def, fresh), new_master))


_TAG, _PAIR = object(), object()


def _bounds_of(state, master, i: int, shape):
    """Row ranges of param leaf ``i``'s chunks, read off the state's own chunks
    (one chunk when ``tx`` keeps nothing shaped like the params)."""
    chunks = master[i] if master is not None else next(
        (c for c in jax.tree_util.tree_leaves(state.inner, is_leaf=_is_chunks) if _is_chunks(c) and c.leaf == i),
        None)
    if chunks is None:
        return [(0, _rows(shape))]
    out, a = [], 0
    for part in chunks.parts:
        b = a + (part.shape[0] if part.ndim else 1)
        out.append((a, b))
        a = b
    return out


def _is_chunks(x) -> bool:
    return isinstance(x, Chunks)


def _params_like(state, params) -> List[Any]:
    """The subtrees of an optax state shaped like ``params`` (mu, nu, momentum ...)."""
    found = []
    _map_params_like(state, params, lambda sub: found.append(sub) or sub)
    return found


def _map_params_like(state, params, fn):
    """``state`` with every subtree shaped like ``params`` replaced by ``fn(subtree)``."""
    p_def = jax.tree_util.tree_structure(params)
    shapes = [tuple(l.shape) for l in jax.tree_util.tree_leaves(params)]

    def like(node) -> bool:
        if node is None or jax.tree_util.tree_structure(node, is_leaf=_is_chunks) != p_def:
            return False
        leaves = jax.tree_util.tree_leaves(node, is_leaf=_is_chunks)
        return all(hasattr(l, "shape") and tuple(l.shape) == s for l, s in zip(leaves, shapes))

    return jax.tree_util.tree_map(lambda n: fn(n) if like(n) else n, state, is_leaf=like)


def _select(state, params, i: int, pick):
    """``state`` for a call of ``tx`` on param leaf ``i`` alone: each params-shaped
    subtree replaced by ``pick`` of its leaf ``i``'s `Chunks`."""
    return _map_params_like(state, params, lambda sub: pick(jax.tree_util.tree_leaves(sub, is_leaf=_is_chunks)[i]))


def offload_optimizer(tx: optax.GradientTransformation, *, master_dtype: Any = None,
                      grad_clip: Optional[float] = None, chunk_bytes: int = 256 << 20,
                      memory_kind: Any = "auto") -> OffloadedOptimizer:
    """``tx`` with its state (and ``master_dtype`` master weights) in pinned host memory.

    Args:
      tx: an elementwise optax transformation (its params-shaped state is
        split by rows; scalar state such as a step count is shared).
      master_dtype: keep master weights in this dtype (e.g. float32 for
        bf16 params) on the host: ``apply`` updates them and returns the
        params as their cast. None: ``tx`` updates the params themselves.
      grad_clip: global-norm clipping applied on the device first.
      chunk_bytes: state bytes per streamed chunk (at least one row).
      memory_kind: where the state lives: ``'auto'`` (`host_memory_kind`:
        ``pinned_host`` where the backend has it, else the device, with a
        warning), a memory kind, or None (the device: the same streamed
        update, nothing moved).

    Donate the state only to a step jitted with every sharding named, memory
    kinds included (``in_shardings``/``out_shardings`` from the placed
    arrays' ``.sharding``): jax then hands a host output only a donated host
    buffer, and the host state is updated in place. Without them jax matches
    buffers by shape alone, and a host output may get a device buffer.

    >>> opt = offload_optimizer(optax.adamw(1e-3), master_dtype=jnp.float32, grad_clip=1.0)
    >>> params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
    >>> new, state = jax.jit(opt.apply)({"w": jnp.ones((2, 3), jnp.bfloat16)}, opt.init(params), params)
    >>> new["w"].dtype, state.master["w"].shape
    (dtype(bfloat16), (2, 3))
    """
    if memory_kind not in ("auto", None, "pinned_host", "unpinned_host", "device"):
        raise ValueError(f"memory_kind must be 'auto', None or a memory kind name, got {memory_kind!r}")
    return OffloadedOptimizer(tx, None if master_dtype is None else jnp.dtype(master_dtype), grad_clip,
                              int(chunk_bytes), memory_kind)
