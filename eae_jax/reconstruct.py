"""`reconstruct`: boundary-only forward, block-by-block reconstruction backward.

Forward keeps only the block boundaries x0..x(L-1) (optionally in a lower
dtype, optionally in pinned host memory). Backward walks the blocks in
reverse: it re-runs block i from its stored input x_i, takes the block's
local VJP with the adjoint at boundary i+1, hands the input adjoint to the
pass chain (`eae_jax.passes`), and continues. Homogeneous blocks are scanned
over a stacked params pytree, so compile time does not grow with depth.

The mechanism is a `jax.custom_vjp` around the whole stack, so the result is
an ordinary differentiable function: use it inside your own loss, under
``jit``, ``grad``, ``value_and_grad(has_aux=True)``.

Pass state and per-boundary statistics come out of the backward pass as the
cotangent of an extra `AdjointCarry` argument (see `eae_jax.carry`)::

    stack = reconstruct(block_fn, passes=chain(int8_fake_quant(), clip_by_norm(1.0)))
    carry = stack.init(params, x, jax.random.key(0))

    def loss_fn(params, carry, x, y):
        return jnp.mean((stack(params, x, carry) - y) ** 2)

    @jax.jit
    def step(params, carry, x, y):
        loss, (g_params, g_carry) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, carry, x, y)
        carry, stats = stack.update(carry, g_carry)
        return loss, g_params, carry, stats
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import carry as carry_lib
from eae_jax import grad_slots
from eae_jax import offload as offload_lib
from eae_jax.passes.base import AdjointTransformation, PassContext, apply_pass, as_pass, identity


def _depth_hint(seg, n: int) -> str:
    """For a scanned segment: the depth read off the params, which is where a
    missing depth axis shows (the first param axis taken for the depth)."""
    if not seg.scanned:
        return ""
    return (f" (a scanned block's params carry a leading depth axis; it was read as {n} blocks: "
            "if that is not the depth, the params lack it)")


def _as_prng_key(key: Any) -> jax.Array:
    """``key`` as something `jax.random.split` takes (see `Stack.init`)."""
    if key is None:
        return jax.random.key(0)
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        return jax.random.key(int(key))
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if getattr(key, "shape", None) != ():
            raise TypeError(f"init: key must be a single PRNG key, got a key array of shape {key.shape}")
        return key
    if dtype is not None and jnp.dtype(dtype) == jnp.uint32 and tuple(getattr(key, "shape", ())) == (2,):
        return key
    raise TypeError(f"init: key must be a jax.random.key, a uint32[2] jax.random.PRNGKey or an int seed; "
                    f"got {type(key).__name__}" + (f" of dtype {dtype} and shape {tuple(key.shape)}"
                                                   if dtype is not None else f" {key!r}"))


class Scan(NamedTuple):
    """A run of identical blocks applied with `jax.lax.scan`.

    ``fn(params_i, x) -> x`` must keep the shape and dtype of ``x``; its
    params in the stack's param list carry a leading depth axis.
    """

    fn: Callable
    name: Optional[str] = None


class _SlotStore(NamedTuple):
    """A scanned segment's boundaries stored inside its gradient slot buffers
    (see `eae_jax.grad_slots`)."""

    bufs: tuple


class _HostBoundaries(NamedTuple):
    """An offloaded scanned segment's boundaries as separate host arrays (the
    ``'unrolled'`` offload schedule), one per block."""

    arrays: tuple


class _Segment(NamedTuple):
    fn: Callable
    name: str
    scanned: bool


#: How an offloaded scanned run is scheduled (see `reconstruct`'s ``offload``).
OFFLOAD_SCHEDULES = ("scan", "unrolled")

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
    """
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str):
        if policy not in _NAMED_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(_NAMED_POLICIES)} or a callable")
        name = _NAMED_POLICIES[policy]
        return None if name is None else getattr(jax.checkpoint_policies, name)
    raise ValueError(f"policy must be None, a name or a jax.checkpoint_policies callable, got {policy!r}")


def _is_float(spec) -> bool:
    return jnp.issubdtype(spec.dtype, jnp.floating)


def _spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def _as_array(x):
    """``x`` itself when it is a JAX array (or tracer), else ``jnp.asarray(x)``
    (a Python scalar or nested list is one input array, not a pytree; a numpy
    float64 array becomes float32 without x64, as every jitted op would make
    it, instead of looking like a block that changes the dtype)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return jnp.asarray(x)
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _fmt(spec) -> str:
    return f"{jnp.dtype(spec.dtype).name}{list(spec.shape)}"


def _tree_shapes(tree) -> str:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    parts = [f"{jax.tree_util.keystr(k)}: {_fmt(v)}" for k, v in leaves[:12]]
    if len(leaves) > 12:
        parts.append(f"... ({len(leaves)} leaves)")
    return "{" + ", ".join(parts) + "}"


def _norm(g: jax.Array) -> jax.Array:
    g = g.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(g * g))


def _first_order_only(h, option: str):
    """``h``, refusing to be differentiated: a boundary stored as raw bytes in
    gradient slots or in host memory has no derivative path back to the
    stack's inputs, so differentiating the backward pass (a second-order
    derivative such as ``grad`` of ``grad``) would silently drop terms (or
    fail with a bare memory-space error). First-order use never
    differentiates the forward rule, so this costs nothing there."""
    if not jnp.issubdtype(h.dtype, jnp.floating):
        return h
    return _no_tangent(option, h)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _no_tangent(option, h):
    return h


@_no_tangent.defjvp
def _no_tangent_jvp(option, primals, tangents):
    fix = "boundaries_in_grads=False" if option == "boundaries_in_grads" else "offload=False"
    where = "as raw bytes in gradient buffers" if option == "boundaries_in_grads" else "in host memory"
    raise ValueError(
        "eae_jax.reconstruct: differentiating the stack's backward pass (a higher-order derivative, e.g. grad "
        f"of grad) is not supported with {option}: boundaries stored {where} carry no derivative. Build the "
        f"stack with {fix} for higher-order derivatives."
    )


class Reconstructed:
    """A stack of pure blocks with explicit adjoint execution.

    Call it as ``stack(params, x, carry=None, side=None)``; see
    `reconstruct` for the meaning of each argument.
    """

    def __init__(self, segments: List[_Segment], passes: AdjointTransformation, boundary_dtype, offload: bool,
                 policy, stats: bool, single: bool, boundaries_in_grads: bool = True):
        self.segments = segments
        self.passes = passes
        self.boundary_dtype = None if boundary_dtype is None else jnp.dtype(boundary_dtype)
        self.offload = bool(offload)
        self.offload_schedule = offload if isinstance(offload, str) else ("scan" if offload else None)
        self.policy = policy
        self.collect_stats = stats
        self._single = single  # the user gave one block fn: params is the stacked tree itself
        self.boundaries_in_grads = boundaries_in_grads

    # ------------------------------------------------------------------ shapes
    def _param_list(self, params):
        if self._single:
            return [params]
        if not isinstance(params, (list, tuple)):
            raise TypeError(
                f"this stack has {len(self.segments)} segments; params must be a list/tuple with one entry "
                f"per segment, got {type(params).__name__}"
            )
        if len(params) != len(self.segments):
            raise ValueError(
                f"this stack has {len(self.segments)} segments ({', '.join(s.name for s in self.segments)}) "
                f"but {len(params)} param entries were given"
            )
        return list(params)

    def _call_block(self, seg: _Segment, p, h, side):
        return seg.fn(p, h) if side is None else seg.fn(p, h, side)

    def _depth(self, seg: _Segment, p) -> int:
        leaves = jax.tree_util.tree_leaves(p)
        if not leaves:
            raise ValueError(f"scanned segment {seg.name!r} has no params; a Scan needs stacked params to scan over")
        depths = {int(l.shape[0]) if getattr(l, "ndim", 0) else -1 for l in leaves}
        if len(depths) != 1 or -1 in depths:
            raise ValueError(
                f"scanned segment {seg.name!r}: every param leaf needs the same leading depth axis, got "
                f"{_tree_shapes(p)}"
            )
        return depths.pop()

    def layout(self, params, x, side=None):
        """Trace shapes only: returns ``(depths, boundary_specs)``.

        ``depths[s]`` is the number of blocks in segment s; ``boundary_specs``
        lists the `jax.ShapeDtypeStruct` of x0..xL.

        Raises:
          ValueError: a block fails on its input or changes a scanned
            boundary's shape/dtype; the message names the block and shapes.
        """
        plist = self._param_list(params)
        h = _spec(_as_array(x))
        depths, specs = [], []
        index = 0
        for seg, p in zip(self.segments, plist):
            if seg.scanned:
                n = self._depth(seg, p)
                p_one = jax.tree_util.tree_map(lambda l: jax.ShapeDtypeStruct(l.shape[1:], l.dtype), p)
            else:
                n, p_one = 1, p
            try:
                out = jax.eval_shape(lambda pp, hh: self._call_block(seg, pp, hh, side), p_one, h)
            except Exception as err:  # re-raised with the block named
                raise ValueError(
                    f"block {seg.name!r} (block index {index}) failed on input {_fmt(h)} with params "
                    f"{_tree_shapes(p_one)}{_depth_hint(seg, n)}: {err}"
                ) from err
            if not isinstance(out, jax.ShapeDtypeStruct):
                raise TypeError(f"block {seg.name!r} must return one array, got {out}")
            if seg.scanned and (out.shape != h.shape or out.dtype != h.dtype):
                raise ValueError(
                    f"scanned block {seg.name!r} maps {_fmt(h)} to {_fmt(out)} with params {_tree_shapes(p_one)}; "
                    f"blocks inside a Scan must keep the shape and dtype of their input{_depth_hint(seg, n)}"
                )
            for _ in range(n):
                specs.append(h)
            depths.append(n)
            index += n
            h = out
        specs.append(h)
        return depths, specs

    # ------------------------------------------------------------------ state
    def _init_state(self, spec, key):
        return self.passes.init(spec, key) if _is_float(spec) else None

    def init(self, params, x, key: Optional[jax.Array] = None, side=None) -> carry_lib.AdjointCarry:
        """Build the carry: one pass state per boundary, step 0, stats slots.

        Args:
          params, x, side: example inputs (only shapes are used).
          key: PRNG key for the passes' initial state (default ``key(0)``):
            a typed key (`jax.random.key`), a raw ``uint32[2]`` key
            (`jax.random.PRNGKey`) or a Python int seed.

        Returns:
          An `AdjointCarry` to pass to the stack and to `update`.

        Raises:
          TypeError: ``key`` is none of those.
        """
        key = _as_prng_key(key)
        depths, specs = self.layout(params, x, side)
        keys = jax.random.split(key, len(specs))
        seg_states, b = [], 0
        for seg, n in zip(self.segments, depths):
            spec = specs[b]
            if seg.scanned:
                if _is_float(spec):
                    seg_states.append(jax.vmap(lambda k: self._init_state(spec, k))(keys[b:b + n]))
                else:
                    seg_states.append(None)
            else:
                seg_states.append(self._init_state(spec, keys[b]))
            b += n
        top = self._init_state(specs[-1], keys[-1])
        num = len(specs)
        tree = {
            "step": jnp.zeros((), jnp.int32),
            "state": {"segments": seg_states, "top": top},
            "stats": {
                "adjoint_norm": jnp.zeros((num,), jnp.float32),
                "adjoint_norm_after_passes": jnp.zeros((num,), jnp.float32),
            },
        }
        return carry_lib.encode(tree)

    def state(self, carry: carry_lib.AdjointCarry):
        """Decoded pass state: ``{'segments': [...], 'top': ...}``.

        A scanned segment's state has a leading axis over its boundaries;
        ``top`` belongs to the output boundary xL.
        """
        return carry_lib.decode(carry)["state"]

    def update(self, carry: carry_lib.AdjointCarry, carry_grad: carry_lib.AdjointCarry, strict: bool = True):
        """Fold the carry's cotangent into the next carry.

        Returns:
          ``(new_carry, stats)`` where stats holds per-boundary float32
          arrays of length L+1 (index i is boundary x_i): ``adjoint_norm``
          (the adjoint as the VJP produced it) and
          ``adjoint_norm_after_passes``; plus ``step`` (steps done before this
          one) and ``calls`` (backward runs that wrote this carry: 1 when all
          is well). The new carry's step is one higher.

        With ``strict`` (default) a carry written by zero or several
        backward passes raises (see `eae_jax.carry.decode_update`);
        either way the old state is kept then.
        """
        new, calls = carry_lib.decode_update(carry, carry_grad, strict=strict)
        tree = carry_lib.decode(new)
        stats = dict(tree["stats"])
        stats["step"] = tree["step"]
        stats["calls"] = calls
        tree["step"] = tree["step"] + 1
        return carry_lib.encode_like(tree, new, calls=0.0), stats

    # ------------------------------------------------------------------ forward
    def _store(self, h):
        if self.boundary_dtype is not None and jnp.issubdtype(h.dtype, jnp.floating):
            h = h.astype(self.boundary_dtype)
        if self.offload:
            h = offload_lib.to_host(_first_order_only(h, "offload"))
        return h

    def _load(self, stored, spec):
        if self.offload:
            stored = offload_lib.to_device(stored)
        return stored.astype(spec.dtype)

    #: Whether an offloaded scan's backward loads boundaries one block ahead
    #: (`_prefetch_scan`). Off: on the H200 (jax 0.11.2, medium stack, same
    #: run) the scan with the prefetch took 113.1 ms, the one loading each
    #: boundary in its own iteration 110.2 ms and one boundary less memory:
    #: XLA lowers both copies to slices of the one stacked host buffer, which
    #: do not overlap the loop's compute either way. The ``'unrolled'``
    #: schedule is the one whose copies overlap. Kept as a switch for
    #: `experiments/bench_stack.py`'s ``eae-offload-prefetch`` diagnostic.
    _offload_prefetch = False

    def _prefetches(self, seg: _Segment, n: int) -> bool:
        """Whether a scanned segment's backward loads boundaries one block ahead:
        the host-to-device copy of boundary i-1 issued while block i
        recomputes and takes its VJP (nothing in that iteration waits on it;
        one extra boundary of device memory). Offloaded boundary-only
        storage only, and only with ``_offload_prefetch``."""
        return self._offload_prefetch and self.offload and self.policy is None and seg.scanned and n >= 2

    def _block_forward(self, seg, p, h, side, layouts):
        """Run one block forward; return (output, residuals for its backward)."""
        if self.policy is None:
            return self._call_block(seg, p, h, side), self._store(h)
        fn = jax.checkpoint(lambda pp, hh: self._call_block(seg, pp, hh, side), policy=self.policy)
        if jnp.issubdtype(h.dtype, jnp.floating):
            y, vjp = jax.vjp(fn, p, h)
        else:
            y, vjp = jax.vjp(lambda pp: fn(pp, h), p)
        leaves, treedef = jax.tree_util.tree_flatten(vjp)
        # Residuals that are the params themselves are not stored again (that
        # would copy the whole stacked params); the backward re-supplies them.
        p_ids = {id(l): i for i, l in enumerate(jax.tree_util.tree_leaves(p))}
        layout = tuple(p_ids.get(id(l), -1) for l in leaves)
        kept = [l for l, pos in zip(leaves, layout) if pos < 0]
        layouts[seg.name] = (treedef, layout)
        return y, kept

    def _unrolls(self, seg: _Segment) -> bool:
        """Whether an offloaded scanned segment runs block by block (the
        ``'unrolled'`` schedule) instead of as a scan."""
        return self.offload_schedule == "unrolled" and self.policy is None and seg.scanned

    def _unrolled_forward(self, seg, p, h, side, n):
        """Forward over a segment block by block, each boundary its own host array.

        Each copy to the host is an independent transfer that XLA can run on
        a copy stream beside block i; the optimization barrier makes block
        i+1's input wait for that copy, so at most one boundary is in flight
        and device memory never holds more than two of them.
        """
        stored = []
        for i in range(n):
            p_i = jax.tree_util.tree_map(lambda a, i=i: a[i], p)
            s_i = self._store(h)
            h, s_i = self._tie_store(self._call_block(seg, p_i, h, side), s_i)
            stored.append(s_i)
        return h, _HostBoundaries(tuple(stored))

    def _tie_store(self, y, stored):
        """``(y, stored)`` with block i's output ``y`` (block i+1's input)
        waiting for boundary i's copy to the host: one copy in flight."""
        return jax.lax.optimization_barrier((y, stored))

    def _fetch_after(self, src, g):
        """``(device copy of the host boundary src, g)``, the copy started
        only once the adjoint ``g`` exists (a barrier on its host operand)."""
        src, g = jax.lax.optimization_barrier((src, g))
        return offload_lib.to_device(src), g

    def _unrolled_backward(self, seg, p, res, g, states, off, spec, side, step, num):
        """Backward of an unrolled offloaded segment: block i recomputes and
        takes its VJP while boundary i-1 comes back from the host.

        The copy of boundary i-1 is started only once block i's adjoint
        exists (barrier on its operand) and must be done when block i's
        input adjoint is (barrier on the result), so exactly one copy is in
        flight. Returns like the reverse ``lax.scan`` of `_backward`.
        """
        n = len(res.arrays)
        float_in = _is_float(spec)
        cur = offload_lib.to_device(res.arrays[n - 1])
        # Gradients go straight into their stacked buffers (in place), so a
        # block's gradients die as soon as they are written.
        grads = None
        sts, nins, nouts = [None] * n, [None] * n, [None] * n
        for i in reversed(range(n)):
            nxt = None
            if i > 0:
                nxt, g = self._fetch_after(res.arrays[i - 1], g)
            # Block i's weights are sliced from params that pass a barrier
            # with its adjoint: the same slice in the forward would otherwise
            # be merged with this one (CSE), and the forward's copy of each
            # block's weights (those a GEMM reads through a concatenation)
            # would stay on the device until the backward reaches that block.
            p, g = jax.lax.optimization_barrier((p, g))
            p_i = jax.tree_util.tree_map(lambda a, i=i: a[i], p)
            st_i = jax.tree_util.tree_map(lambda a, i=i: a[i], states)
            gp, gh = self._vjp_at(seg, p_i, cur.astype(spec.dtype), g, float_in, side)
            if grads is None:
                grads = jax.tree_util.tree_map(lambda l: jnp.zeros((n,) + l.shape, l.dtype), gp)
            grads = jax.tree_util.tree_map(lambda buf, l, i=i: buf.at[i].set(l), grads, gp)
            if nxt is not None:
                # All of block i's backward (its weight gradients included,
                # which nothing downstream waits for) completes before block
                # i-1 may start: one block's internals live at a time.
                gh, grads, nxt = jax.lax.optimization_barrier((gh, grads, nxt))
            g, sts[i], nins[i], nouts[i] = self._tie_stats(
                self._scan_boundary(gh, g, st_i, jnp.int32(off + i), step, num))
            cur = nxt

        return g, (grads, jax.tree_util.tree_map(lambda *ls: jnp.stack(ls), *sts), jnp.stack(nins), jnp.stack(nouts))

    def _slot_plan(self, seg: _Segment, p, h) -> Optional[grad_slots.SlotPlan]:
        """The gradient-slot layout for a scanned segment's boundaries, or None
        when they are stored the ordinary way (a policy's residuals, offload,
        or blocks whose float params are smaller than a boundary)."""
        if not (self.boundaries_in_grads and seg.scanned and self.policy is None and not self.offload):
            return None
        if not jnp.issubdtype(h.dtype, jnp.floating):
            return None
        stored = self.boundary_dtype if self.boundary_dtype is not None else h.dtype
        specs = [(l.shape[1:], l.dtype) for l in jax.tree_util.tree_leaves(p)]
        return grad_slots.plan(specs, h.shape, stored)

    def _slot_forward(self, seg, p, h, side, plan, n):
        def body(carry, xs):
            hh, bufs = carry
            pp, i = xs
            y = self._call_block(seg, pp, hh, side)
            stored = self._store(_first_order_only(hh, "boundaries_in_grads"))
            return (y, grad_slots.pack(plan, stored, bufs, i)), None

        (h, bufs), _ = jax.lax.scan(body, (h, grad_slots.empty_slots(plan, n)), (p, jnp.arange(n, dtype=jnp.int32)))
        return h, _SlotStore(bufs)

    def _forward(self, plist, x, side, layouts):
        h = x
        saved = []
        for seg, p in zip(self.segments, plist):
            # Named scopes mark each segment's ops in compiled HLO and profiles
            # (eae_jax.train.profile attributes step time by them).
            with jax.named_scope(f"forward.{seg.name}"):
                h, res = self._segment_forward(seg, p, h, side, layouts)
            saved.append(res)
        return h, saved

    def _segment_forward(self, seg, p, h, side, layouts):
        # A scanned run of depth 0 (the identity) takes the plain scan:
        # slots and the unrolled schedule need at least one block.
        empty = seg.scanned and self._depth(seg, p) == 0
        plan = None if empty else self._slot_plan(seg, p, h)
        if plan is not None:
            layouts[("slots", seg.name)] = plan
            return self._slot_forward(seg, p, h, side, plan, self._depth(seg, p))
        if self._unrolls(seg) and not empty:
            return self._unrolled_forward(seg, p, h, side, self._depth(seg, p))
        if seg.scanned:
            def body(hh, pp):
                return self._block_forward(seg, pp, hh, side, layouts)

            return jax.lax.scan(body, h, p)
        return self._block_forward(seg, p, h, side, layouts)

    # ------------------------------------------------------------------ backward
    def _block_backward(self, seg, p, res, g, spec, side, layouts):
        """VJP of one block at adjoint ``g``; returns (param grads, input adjoint or None)."""
        float_in = _is_float(spec)
        if self.policy is None:
            return self._vjp_at(seg, p, self._load(res, spec), g, float_in, side)
        treedef, layout = layouts[seg.name]
        p_leaves = jax.tree_util.tree_leaves(p)
        kept = iter(res)
        leaves = [p_leaves[pos] if pos >= 0 else next(kept) for pos in layout]
        vjp = jax.tree_util.tree_unflatten(treedef, leaves)
        if float_in:
            gp, gh = vjp(g)
        else:
            (gp,), gh = vjp(g), None
        return gp, gh

    def _vjp_at(self, seg, p, h, g, float_in, side):
        """Recompute one block from its (device-resident) input ``h`` and pull ``g`` back."""
        if float_in:
            _, vjp = jax.vjp(lambda pp, hh: self._call_block(seg, pp, hh, side), p, h)
            gp, gh = vjp(g)
        else:
            _, vjp = jax.vjp(lambda pp: self._call_block(seg, pp, h, side), p)
            (gp,), gh = vjp(g), None
        return gp, gh

    def _boundary(self, g, state, boundary, step, num):
        """Apply the pass chain at one boundary; return (g, state, norm_in, norm_out)."""
        if g is None:
            zero = jnp.zeros((), jnp.float32)
            return None, state, zero, zero
        norm_in = _norm(g) if self.collect_stats else jnp.zeros((), jnp.float32)
        ctx = PassContext(jnp.asarray(boundary, jnp.int32), jnp.asarray(boundary, jnp.int32), step, num)
        with jax.named_scope("passes"):
            g, state = apply_pass(self.passes, g, state, ctx)
        norm_out = _norm(g) if (self.collect_stats and self.passes.name != "identity") else norm_in
        return g, state, norm_in, norm_out

    def _scan_boundary(self, gh, gg, state, boundary, step, num):
        """`_boundary` inside a reverse scan: a non-float block input passes
        nothing on, so the carry keeps the incoming adjoint ``gg`` (and its type)."""
        gh, state, norm_in, norm_out = self._boundary(gh, state, boundary, step, num)
        return (gg if gh is None else gh), state, norm_in, norm_out

    @staticmethod
    def _tie_stats(out):
        """``(g, state, norm_in, norm_out)`` from a boundary outside a scan,
        with the adjoint that flows on waiting for the statistics and pass
        state. Nothing downstream needs those but the step's outputs, so
        XLA's scheduler would otherwise compute them after the last block and
        keep every block's input adjoint (one boundary each) alive until
        then; in a scan body the loop orders them already."""
        g, rest = out[0], out[1:]
        if g is None:
            return out
        return jax.lax.optimization_barrier((g,) + tuple(rest))

    def _backward(self, plist, saved, carry, side, specs, depths, g, layouts):
        tree = carry_lib.decode(carry)
        step = tree["step"]
        seg_states = list(tree["state"]["segments"])
        num = len(specs)
        norms_in = [None] * len(self.segments)
        norms_out = [None] * len(self.segments)
        grads = [None] * len(self.segments)

        g, top, top_in, top_out = self._tie_stats(self._boundary(g, tree["state"]["top"], num - 1, step, num))
        offsets = [sum(depths[:s]) for s in range(len(self.segments))]
        for s in reversed(range(len(self.segments))):
            seg = self.segments[s]
            with jax.named_scope(f"backward.{seg.name}"):  # see _forward
                g, (grads[s], seg_states[s], norms_in[s], norms_out[s]) = self._segment_backward(
                    seg, plist[s], saved[s], g, seg_states[s], offsets[s], depths[s], specs[offsets[s]], side, step,
                    num, layouts)

        if self.collect_stats:
            stats = {
                "adjoint_norm": jnp.concatenate(norms_in + [top_in[None]]),
                "adjoint_norm_after_passes": jnp.concatenate(norms_out + [top_out[None]]),
            }
        else:
            stats = tree["stats"]
        new_tree = {"step": step, "state": {"segments": seg_states, "top": top}, "stats": stats}
        return grads, g, carry_lib.encode_like(new_tree, carry, calls=1.0)

    def _segment_backward(self, seg, p, res, g, state, off, n, spec, side, step, num, layouts):
        """Backward of one segment at output adjoint ``g``: ``(input adjoint or None,
        (param grads, pass state, adjoint norms in, out))``."""
        if not seg.scanned:
            gp, gh = self._block_backward(seg, p, res, g, spec, side, layouts)
            g, st, nin, nout = self._tie_stats(self._boundary(gh, state, off, step, num))
            return g, (gp, st, nin[None], nout[None])

        def body(gg, xs):
            p_i, res_i, st_i, b = xs
            gp, gh = self._block_backward(seg, p_i, res_i, gg, spec, side, layouts)
            gh, st_i, nin, nout = self._scan_boundary(gh, gg, st_i, b, step, num)
            return gh, (gp, st_i, nin, nout)

        idx = off + jnp.arange(n, dtype=jnp.int32)
        if isinstance(res, _HostBoundaries):
            g_new, out = self._unrolled_backward(seg, p, res, g, state, off, spec, side, step, num)
        elif isinstance(res, _SlotStore):
            g_new, out = self._slot_scan(seg, p, res, g, state, idx, spec, side, step, num,
                                         layouts[("slots", seg.name)])
        elif self._prefetches(seg, n):
            g_new, out = self._prefetch_scan(seg, p, res, g, state, idx, spec, side, step, num)
        else:
            g_new, out = jax.lax.scan(body, g, (p, res, state, idx), reverse=True)
        return (g_new if _is_float(spec) else None), out

    def _check_carry(self, carry, depths, specs, expected=None):
        """Raise ValueError when ``carry`` was made for another stack or depth
        (the backward would otherwise fail inside its scans with a bare shape
        error, or misread the state), or when its pass state differs in
        structure, shape or dtype from ``expected()`` (what `init` makes for
        this call: a state made for other shapes or dtypes would otherwise be
        broadcast against or cast into the adjoints)."""
        tree = jax.eval_shape(carry_lib.decode, carry)
        hint = "make the carry with this stack's init() from params and x of the shapes the stack is called with"
        try:
            num = tree["stats"]["adjoint_norm"].shape[0]
            seg_states = tree["state"]["segments"]
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(f"the carry was not made by Reconstructed.init ({hint})") from err
        if num != len(specs) or len(seg_states) != len(self.segments):
            raise ValueError(
                f"the carry was made for a stack with {num} boundaries in {len(seg_states)} segments; this call "
                f"has {len(specs)} boundaries in {len(self.segments)} segments (depths {depths}); {hint}"
            )
        for seg, n, st in zip(self.segments, depths, seg_states):
            if seg.scanned:
                lead = {l.shape[0] if l.ndim else None for l in jax.tree_util.tree_leaves(st)}
                if lead - {n}:
                    raise ValueError(
                        f"the carry's pass state for segment {seg.name!r} covers {sorted(lead, key=str)} blocks, "
                        f"this call has {n}; {hint}"
                    )
        if expected is None:
            return
        want = jax.eval_shape(carry_lib.decode, expected())
        got_leaves, got_def = jax.tree_util.tree_flatten_with_path(tree["state"])
        want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want["state"])
        if got_def != want_def:
            raise ValueError(f"the carry's pass state has another structure than this stack's passes make for this "
                             f"call; {hint}")
        for (path, a), (_, b) in zip(got_leaves, want_leaves):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"the carry's pass state {jax.tree_util.keystr(path)} is {a.dtype}{list(a.shape)}, this call's "
                    f"passes need {b.dtype}{list(b.shape)} (params, x or side of other shapes or dtypes than the "
                    f"carry was made for); {hint}"
                )

    def _slot_scan(self, seg, p, res, g, states, idx, spec, side, step, num, plan):
        """Reverse scan whose carry holds the slot buffers: iteration i reads
        boundary i out of row i, then overwrites that row with block i's
        gradients of the chosen leaves (in place); the other leaves' gradients
        are stacked as usual. Returns like ``lax.scan`` over the segment."""
        n = idx.shape[0]
        float_in = _is_float(spec)
        chosen = set(plan.leaves)

        def body(carry, xs):
            gg, bufs = carry
            p_i, st_i, b, i = xs
            h_i = grad_slots.unpack(plan, bufs, i)
            gp, gh = self._vjp_at(seg, p_i, self._load(h_i, spec), gg, float_in, side)
            leaves = jax.tree_util.tree_leaves(gp)
            # Gradients written as raw bytes into the slots: no derivative
            # path either (refuse, see `_first_order_only`).
            slotted = [_first_order_only(l, "boundaries_in_grads") if k in chosen else l for k, l in enumerate(leaves)]
            bufs = grad_slots.store_grads(plan, bufs, slotted, i)
            rest = [None if k in chosen else l for k, l in enumerate(leaves)]
            gh, st_i, nin, nout = self._scan_boundary(gh, gg, st_i, b, step, num)
            return (gh, bufs), (rest, st_i, nin, nout)

        (g_new, bufs), (rest, st, nin, nout) = jax.lax.scan(
            body, (g, res.bufs), (p, states, idx, jnp.arange(n, dtype=jnp.int32)), reverse=True)
        p_leaves, treedef = jax.tree_util.tree_flatten(p)
        from_slots = {k: g.reshape(p_leaves[k].shape) for k, g in zip(plan.leaves, grad_slots.to_grads(plan, bufs))}
        grads = [from_slots[k] if k in from_slots else r for k, r in enumerate(rest)]
        return g_new, (jax.tree_util.tree_unflatten(treedef, grads), st, nin, nout)

    def _prefetch_scan(self, seg, p, res, g, states, idx, spec, side, step, num):
        """Reverse scan over an offloaded segment, loading boundary i-1 while block i runs.

        ``res`` holds the segment's stored boundaries in pinned host memory
        (leading axis over blocks). The loop carries the adjoint and the
        device copy of the current block's input; each iteration starts the
        host-to-device copy of the next input (clamped at block 0, where the
        copy is redundant) before the block's recompute + VJP, which does not
        depend on it. JAX's offload checkpoint policies do not cover a scan's
        carried residuals (jax-ml/jax#23869), hence this explicit schedule.
        """
        n = idx.shape[0]
        float_in = _is_float(spec)
        ahead_idx = jnp.maximum(jnp.arange(n, dtype=jnp.int32) - 1, 0)

        def fetch(i):
            return offload_lib.to_device(jax.lax.dynamic_index_in_dim(res, i, axis=0, keepdims=False))

        def body(carry, xs):
            gg, cur = carry
            p_i, st_i, b, nxt = xs
            ahead = fetch(nxt)
            gp, gh = self._vjp_at(seg, p_i, cur.astype(spec.dtype), gg, float_in, side)
            gh, st_i, nin, nout = self._scan_boundary(gh, gg, st_i, b, step, num)
            return (gh, ahead), (gp, st_i, nin, nout)

        first = offload_lib.to_device(jax.lax.index_in_dim(res, n - 1, axis=0, keepdims=False))
        (g_new, _), out = jax.lax.scan(body, (g, first), (p, states, idx, ahead_idx), reverse=True)
        return g_new, out

    # ------------------------------------------------------------------ call
    def __call__(self, params, x, carry: Optional[carry_lib.AdjointCarry] = None, side=None):
        """Apply the stack: ``x0 = x``, ``x(i+1) = block_i(params_i, x_i)``; returns xL.

        Args:
          params: the stacked params (one block fn given) or a list with one
            entry per segment.
          x: the stack's input (any dtype; int token ids are fine for an
            embedding block: no adjoint flows into them).
          carry: from `init`; without one, a fresh carry is made on the fly
            and its updates are dropped (fine for stateless passes).
          side: optional input given to every block as a third argument
            (masks, positions, tables). It is a constant to the backward,
            like ``lax.stop_gradient(side)``: its cotangent is zero.

        Raises:
          ValueError / TypeError: mismatched params, shapes or dtypes, naming
            the block.
        """
        plist = self._param_list(params)
        x = _as_array(x)
        depths, specs = self.layout(params, x, side)
        if carry is None:
            carry = self.init(params, x, side=side)
        elif not isinstance(carry, carry_lib.AdjointCarry):
            raise TypeError(f"carry must be the AdjointCarry made by init(), got {type(carry).__name__}")
        layouts = {}  # per call: vjp residual layouts recorded by the forward for the backward
        x_float = _is_float(specs[0])

        @jax.custom_vjp
        def run(plist, x, carry, side):
            return self._forward(plist, x, side, layouts)[0]

        def expected():
            return jax.eval_shape(lambda p, x_, s: self.init(p, x_, side=s), params, x, side)

        def fwd(plist, x, carry, side):
            self._check_carry(carry, depths, specs, expected)
            y, saved = self._forward(plist, x, side, layouts)
            return y, (plist, saved, carry, side)

        def bwd(res, g):
            plist, saved, carry, side = res
            grads, gx, gcarry = self._backward(plist, saved, carry, side, specs, depths, g, layouts)
            if not x_float:
                gx = None
            return grads, gx, gcarry, None

        run.defvjp(fwd, bwd)
        return run(plist, x, carry, side)


def reconstruct(
    blocks: Any,
    *,
    passes: Any = None,
    boundary_dtype: Any = None,
    offload: Any = False,
    policy: Any = None,
    stats: bool = True,
    boundaries_in_grads: bool = True,
) -> Reconstructed:
    """Turn pure block functions into a stack with explicit adjoint execution.

    Args:
      blocks: either one block function ``fn(params_i, x) -> x`` applied over
        a stacked params tree (leading depth axis, scanned; a lone `Scan`
        means the same, with its name), or a sequence
        whose items are block functions (one block, its own params) or
        `Scan` (a scanned run of identical blocks). With a sequence, params
        is a list with one entry per item. Blocks may close over constants,
        not over values being differentiated; pass those as ``side``.
      passes: an adjoint pass (`eae_jax.passes`), an optax
        GradientTransformation, or a list of them (chained). Applied at every
        float boundary, the output boundary xL included; None is the identity.
      boundary_dtype: store the boundaries in this dtype (e.g. bf16 for an
        fp32 model); the forward is unaffected, the backward recomputes each
        block from the rounded boundary.
      offload: keep the stored boundaries in pinned host memory (boundary-only
        storage, ``policy=None``; a policy's kept internals stay on device).
        True or ``'scan'``: scanned runs stay scans, their boundaries one
        stacked host array, each iteration of the backward copying its own
        boundary back (at most two boundaries on the device); ``'unrolled'``:
        scanned runs are unrolled block by block so that each boundary is
        its own host array and each copy an independent transfer, the copy
        of boundary i-1 overlapping block i's backward (faster on the H200;
        compile time grows with depth).
      policy: None/``'boundaries'`` (keep only boundaries), ``'dots'``,
        ``'dots_all'``, ``'everything'``, or a `jax.checkpoint_policies`
        callable: which block internals the forward also keeps so the
        backward need not recompute them.
      stats: collect per-boundary adjoint norms into the carry.
      boundaries_in_grads: a scanned run stores boundary i inside the buffer
        that later receives block i's gradients of its largest parameters
        (`eae_jax.grad_slots`): the backward reads the boundary out and
        overwrites it with the gradients in place, saving L boundaries of
        peak memory. Applies to boundary-only storage on device (no policy,
        no offload) when a block's float params outweigh one boundary;
        otherwise boundaries are stored the ordinary way. Results are
        identical either way. Bytes in slots (and offloaded boundaries) carry
        no derivative: differentiating the backward pass (grad of grad)
        raises ValueError; pass False (and no offload) for that.

    Returns:
      A `Reconstructed` stack.

    Raises:
      TypeError: ``blocks`` or ``passes`` of the wrong kind.
    """
    # One block fn, or one `Scan` (a NamedTuple, not a sequence of blocks):
    # params is the stacked tree itself.
    single = isinstance(blocks, Scan) or callable(blocks)
    if not single and (isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__")):
        raise TypeError(
            f"reconstruct: blocks must be a block function, an eae_jax.Scan or a list of them, "
            f"got {type(blocks).__name__}"
        )
    items: Sequence[Any] = [blocks if isinstance(blocks, Scan) else Scan(blocks)] if single else list(blocks)
    if not items:
        raise ValueError("reconstruct needs at least one block")
    segments = []
    for i, item in enumerate(items):
        if isinstance(item, Scan):
            if not callable(item.fn):
                raise TypeError(f"Scan item {i} holds {item.fn!r}, not a function")
            segments.append(_Segment(item.fn, item.name or f"{getattr(item.fn, '__name__', 'block')}[{i}]", True))
        elif callable(item):
            segments.append(_Segment(item, f"{getattr(item, '__name__', 'block')}[{i}]", False))
        else:
            raise TypeError(f"block {i} is {item!r}; expected a function or eae_jax.Scan")
    if passes is None:
        chain_ = identity()
    elif isinstance(passes, list) or (isinstance(passes, tuple) and not hasattr(passes, "_fields")):
        # A pass (and an optax transform) is itself a NamedTuple: only plain
        # lists/tuples are sequences of passes.
        from eae_jax.passes.base import chain

        chain_ = chain(*passes)
    else:
        chain_ = as_pass(passes)
    if not isinstance(offload, (bool, str)) or (isinstance(offload, str) and offload not in OFFLOAD_SCHEDULES):
        raise ValueError(f"offload must be a bool or one of {OFFLOAD_SCHEDULES}, got {offload!r}")
    if boundary_dtype is not None:
        from eae_jax.dtypes import parse_compute_dtype

        boundary_dtype = parse_compute_dtype(boundary_dtype)
    return Reconstructed(segments, chain_, boundary_dtype, offload, resolve_policy(policy), stats, single,
                         bool(boundaries_in_grads))
