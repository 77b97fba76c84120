"""`reconstruct`, the stack it returns, its layout checks and its custom VJP."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Literal, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from eae_jax import carry as carry_lib
from eae_jax.passes.base import AdjointTransformation, as_pass, chain, identity
from eae_jax.reconstruct.adjoint import AtBoundary
from eae_jax.reconstruct.budget import MemoryBudget
from eae_jax.reconstruct.host import Host, HostUnrolled
from eae_jax.reconstruct.policy import Policy, resolve_policy
from eae_jax.reconstruct.slots import GradSlots
from eae_jax.reconstruct.state import as_prng_key, check_carry, init_carry
from eae_jax.reconstruct.storage import OnDevice, Segment, SegmentLayout, Storage, zero_grads

#: How an offloaded scanned run is scheduled (see `reconstruct`'s ``offload``).
OFFLOAD_SCHEDULES = ("scan", "unrolled")

#: A block: ``fn(params, x) -> y`` or ``fn(params, x, side) -> y`` (``(y, new_state)`` with ``block_state``).
BlockFn = Callable[..., Any]
#: What ``passes=`` takes: a pass, an optax transform, or a sequence of them (chained).
PassLike = Union[AdjointTransformation, optax.GradientTransformation]
#: A policy name (`resolve_policy`) or a `jax.checkpoint` policy callable.
PolicyLike = Union[Literal["boundaries", "dots", "dots_all", "everything"], Callable[..., Any], None]


class Scan(NamedTuple):
    """A run of identical blocks applied with `jax.lax.scan`.

    ``fn(params_i, x) -> x`` must keep the shape and dtype of ``x``; its
    params in the stack's param list carry a leading depth axis.

    >>> stack = reconstruct([Scan(lambda w, x: x * w, "scale"), lambda b, x: x + b])
    >>> stack([jnp.full((3, 2), 2.0), jnp.ones(2)], jnp.ones(2))
    Array([9., 9.], dtype=float32)
    """

    fn: Callable
    name: Optional[str] = None


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
    # A typed PRNG key's dtype (key<fry>) is no numpy dtype.
    is_key = jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key)
    return f"{spec.dtype if is_key else jnp.dtype(spec.dtype).name}{list(spec.shape)}"


def _tree_shapes(tree) -> str:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    parts = [f"{jax.tree_util.keystr(k)}: {_fmt(v)}" for k, v in leaves[:12]]
    if len(leaves) > 12:
        parts.append(f"... ({len(leaves)} leaves)")
    return "{" + ", ".join(parts) + "}"


def _depth_hint(seg: Segment, n: int) -> str:
    """For a scanned segment: the depth read off the params, which is where a
    missing depth axis shows (the first param axis taken for the depth)."""
    if not seg.scanned:
        return ""
    return (f" (a scanned block's params carry a leading depth axis; it was read as {n} blocks: "
            "if that is not the depth, the params lack it)")


class Reconstructed:
    """A stack of pure blocks with explicit adjoint execution.

    Call it as ``stack(params, x, carry=None, side=None)``; see
    `reconstruct` for the meaning of each argument.

    >>> stack = reconstruct(lambda w, x: jnp.tanh(x * w))
    >>> w, x = jnp.ones((3, 2)), jnp.ones(2)
    >>> carry = stack.init(w, x)
    >>> g_w, g_c = jax.grad(lambda w, c: stack(w, x, c).sum(), argnums=(0, 1))(w, carry)
    >>> carry, stats = stack.update(carry, g_c)
    >>> stats["adjoint_norm"].shape, int(stats["calls"])
    ((4,), 1)
    """

    def __init__(self, segments: List[Segment], passes: AdjointTransformation, storage: List[Storage], stats: bool,
                 single: bool, block_state: bool = False, budget: Any = None):
        self.segments = segments
        self.passes = passes
        self.storage = storage  # one per segment, bound to each call's layout by `storages`
        self.collect_stats = stats
        self._single = single  # the user gave one block fn: params is the stacked tree itself
        self.budget = budget  # a MemoryBudget: the storages come from a plan per input shape
        self._plans = {}
        self.block_state = block_state  # blocks return (y, new_state); the stack returns (xL, states)

    # ------------------------------------------------------------------ layout
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

    @staticmethod
    def _depth(seg: Segment, p) -> int:
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

    def _layouts(self, params, x, side) -> List[SegmentLayout]:
        """Trace shapes only: one `SegmentLayout` per segment, checking every block."""
        h = _spec(_as_array(x))
        side_spec = None if side is None else jax.eval_shape(lambda s: s, side)
        layouts, index = [], 0
        for seg, p in zip(self.segments, self._param_list(params)):
            if seg.scanned:
                n = self._depth(seg, p)
                p_one = jax.tree_util.tree_map(lambda l: jax.ShapeDtypeStruct(l.shape[1:], l.dtype), p)
            else:
                n, p_one = 1, jax.eval_shape(lambda t: t, p)
            lay = SegmentLayout(seg, n, p_one, h, side_spec, index)
            try:
                out = jax.eval_shape(lambda pp, hh: lay.call(pp, hh, side), p_one, h)
            except Exception as err:  # re-raised with the block named
                raise ValueError(
                    f"block {seg.name!r} (block index {index}) failed on input {_fmt(h)} with params "
                    f"{_tree_shapes(p_one)}{_depth_hint(seg, n)}: {err}"
                ) from err
            if seg.stateful:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError(f"block {seg.name!r} must return (y, new_state) (the stack was built with "
                                    f"block_state=True), got {out}")
                out = out[0]
            if not isinstance(out, jax.ShapeDtypeStruct):
                raise TypeError(f"block {seg.name!r} must return one array" +
                                (" as y of (y, new_state)" if seg.stateful else "") + f", got {out}")
            if seg.scanned and (out.shape != h.shape or out.dtype != h.dtype):
                raise ValueError(
                    f"scanned block {seg.name!r} maps {_fmt(h)} to {_fmt(out)} with params {_tree_shapes(p_one)}; "
                    f"blocks inside a Scan must keep the shape and dtype of their input{_depth_hint(seg, n)}"
                )
            layouts.append(lay)
            index += n
            h = out
        return layouts + [h]

    def layout(self, params, x, side=None):
        """Trace shapes only: returns ``(depths, boundary_specs)``.

        ``depths[s]`` is the number of blocks in segment s; ``boundary_specs``
        lists the `jax.ShapeDtypeStruct` of x0..xL.

        Raises:
          ValueError: a block fails on its input or changes a scanned
            boundary's shape/dtype; the message names the block and shapes.

        >>> stack = reconstruct(lambda w, x: x * w)
        >>> depths, specs = stack.layout(jnp.ones((3, 2)), jnp.ones(2))
        >>> depths, len(specs)
        ([3], 4)
        """
        *layouts, top = self._layouts(params, x, side)
        specs = [lay.x for lay in layouts for _ in range(lay.depth)] + [top]
        return [lay.depth for lay in layouts], specs

    def storages(self, params, x, side=None) -> List[Storage]:
        """The storage serving each segment for inputs of these shapes: each
        segment's `Storage` bound to its layout (which may choose another,
        e.g. `GradSlots` falls back to `OnDevice` for blocks too small).

        >>> stack = reconstruct([lambda w, x: x @ w, Scan(lambda w, x: jnp.tanh(x @ w))])
        >>> [s.kind for s in stack.storages([jnp.ones((2, 2)), jnp.ones((3, 2, 2))], jnp.ones((1, 2)))]
        ['device', 'grad_slots']
        """
        *layouts, _ = self._layouts(params, x, side)
        return [store.bind(lay) for store, lay in zip(self._unbound(params, x, side), layouts)]

    def _unbound(self, params, x, side) -> List[Storage]:
        return self.storage if self.budget is None else self.plan(params, x, side).storages

    def plan(self, params, x, side=None):
        """The memory plan of a stack built with ``memory_budget`` for inputs of
        these shapes (made on the first call for them, then reused): a
        `eae_jax.reconstruct.Plan`.

        >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w), memory_budget="1MiB")
        >>> stack.plan(jnp.ones((3, 4, 4)), jnp.ones((2, 4))).segments[0].runs
        ((3, 'everything'),)
        """
        if self.budget is None:
            raise ValueError("this stack was built without memory_budget: it has no plan (see plan_memory)")
        from eae_jax.reconstruct.budget import planned_for
        return planned_for(self, self._plans, params, x, side)

    # ------------------------------------------------------------------ carry
    def init(self, params: Any, x: Any, key: Union[jax.Array, int, None] = None,
             side: Any = None) -> carry_lib.AdjointCarry:
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

        >>> stack = reconstruct(lambda w, x: x * w)
        >>> type(stack.init(jnp.ones((3, 2)), jnp.ones(2), key=7)).__name__
        'AdjointCarry'
        """
        key = as_prng_key(key)
        depths, specs = self.layout(params, x, side)
        return init_carry(self.passes, [s.scanned for s in self.segments], depths, specs, key)

    def state(self, carry: carry_lib.AdjointCarry):
        """Decoded pass state: ``{'segments': [...], 'top': ...}``.

        A scanned segment's state has a leading axis over its boundaries;
        ``top`` belongs to the output boundary xL.

        >>> stack = reconstruct(lambda w, x: x * w)
        >>> sorted(stack.state(stack.init(jnp.ones((3, 2)), jnp.ones(2))))
        ['segments', 'top']
        """
        return carry_lib.decode(carry)["state"]

    @staticmethod
    def update(carry: carry_lib.AdjointCarry, carry_grad: carry_lib.AdjointCarry,
               strict: bool = True) -> Tuple[carry_lib.AdjointCarry, Dict[str, jax.Array]]:
        """Fold the carry's cotangent into the next carry (a static method:
        it needs no stack, so ``Reconstructed.update(carry, g)`` works too).

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

        >>> stack = reconstruct(lambda w, x: x * w)
        >>> w, x = jnp.ones((3, 2)), jnp.ones(2)
        >>> carry = stack.init(w, x)
        >>> carry, stats = stack.update(carry, jax.grad(lambda c: stack(w, x, c).sum())(carry))
        >>> int(stats["step"]), int(stack.update(carry, jax.grad(lambda c: stack(w, x, c).sum())(carry))[1]["step"])
        (0, 1)
        """
        new, calls = carry_lib.decode_update(carry, carry_grad, strict=strict)
        tree = carry_lib.decode(new)
        stats = dict(tree["stats"])
        stats["step"] = tree["step"]
        stats["calls"] = calls
        tree["step"] = tree["step"] + 1
        return carry_lib.encode_like(tree, new, calls=0.0), stats

    # ------------------------------------------------------------------ forward / backward
    @staticmethod
    def _forward(layouts, stores, plist, x, side):
        """``(xL, residuals per segment, new block states per segment)``."""
        h, saved, states = x, [], []
        for lay, store, p in zip(layouts, stores, plist):
            # Named scopes mark each segment's ops in compiled HLO and profiles
            # (eae_jax.train.profile attributes step time by them).
            with jax.named_scope(f"forward.{lay.segment.name}"):
                if lay.segment.scanned:
                    out, res = store.forward(lay, p, h, side)
                else:
                    out, res = store.save(lay, p, h, side)
            h, state = lay.split(out)
            saved.append(res)
            states.append(state)
        return h, saved, states

    def _output(self, y, states):
        if not self.block_state:
            return y
        return y, (states[0] if self._single else states)

    def _backward(self, layouts, stores, plist, saved, carry, side, num, g):
        tree = carry_lib.decode(carry)
        seg_states = list(tree["state"]["segments"])
        at = AtBoundary(self.passes, tree["step"], num, self.collect_stats)
        norms_in, norms_out, grads = ([None] * len(layouts) for _ in range(3))

        g, top, top_in, top_out = at.tied(g, tree["state"]["top"], num - 1)
        for s in reversed(range(len(layouts))):
            lay, store, p, res = layouts[s], stores[s], plist[s], saved[s]
            with jax.named_scope(f"backward.{lay.segment.name}"):  # see _forward
                if g is None:  # an integer output (tokens to tokens): no adjoint reaches this segment
                    gp, st, nin, nout = zero_grads(p), seg_states[s], *[jnp.zeros((lay.depth,), jnp.float32)] * 2
                elif lay.segment.scanned:
                    g_new, (gp, st, nin, nout) = store.backward(lay, p, res, g, seg_states[s], at, side)
                    g = g_new if lay.float_in else None
                else:
                    gp, gh = store.restore(lay, p, res, g, side)
                    g, st, nin, nout = at.tied(gh, seg_states[s], lay.first)
                    nin, nout = nin[None], nout[None]
            grads[s], seg_states[s], norms_in[s], norms_out[s] = gp, st, nin, nout

        if self.collect_stats:
            stats = {
                "adjoint_norm": jnp.concatenate(norms_in + [top_in[None]]),
                "adjoint_norm_after_passes": jnp.concatenate(norms_out + [top_out[None]]),
            }
        else:
            stats = tree["stats"]
        new_tree = {"step": tree["step"], "state": {"segments": seg_states, "top": top}, "stats": stats}
        return grads, g, carry_lib.encode_like(new_tree, carry, calls=1.0)

    def __call__(self, params: Any, x: Any, carry: Optional[carry_lib.AdjointCarry] = None,
                 side: Any = None) -> Union[jax.Array, Tuple[jax.Array, Any]]:
        """Apply the stack: ``x0 = x``, ``x(i+1) = block_i(params_i, x_i)``; returns xL.

        With ``block_state=True`` every block returns ``(y, new_state)`` and
        the stack returns ``(xL, states)``: the new states stacked over the
        blocks of the (single) scanned run, or a list with one entry per
        segment. The states come from the forward; the backward recomputes
        each block from its params as given (the old state in them), so it
        sees what its forward saw. The states are not differentiated: their
        cotangent is dropped, as ``lax.stop_gradient`` would.

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

        >>> stack = reconstruct(lambda w, x, gate: x * w * gate)
        >>> stack(jnp.full((2, 2), 3.0), jnp.ones(2), side=jnp.array([1.0, 0.5]))
        Array([9.  , 2.25], dtype=float32)
        """
        plist = self._param_list(params)
        x = _as_array(x)
        *layouts, _ = self._layouts(params, x, side)
        num = sum(lay.depth for lay in layouts) + 1
        # The storage of every segment is fixed here, before the VJP exists:
        # forward and backward read the same bound objects.
        stores = [store.bind(lay) for store, lay in zip(self._unbound(params, x, side), layouts)]
        if carry is None:
            carry = self.init(params, x, side=side)
        elif not isinstance(carry, carry_lib.AdjointCarry):
            raise TypeError(f"carry must be the AdjointCarry made by init(), got {type(carry).__name__}")
        x_float = layouts[0].float_in

        @jax.custom_vjp
        def run(plist, x, carry, side):
            y, _, states = self._forward(layouts, stores, plist, x, side)
            return self._output(y, states)

        def expected():
            return jax.eval_shape(lambda p, x_, s: self.init(p, x_, side=s), params, x, side)

        def fwd(plist, x, carry, side):
            check_carry(carry, [s.name for s in self.segments], [s.scanned for s in self.segments],
                        [lay.depth for lay in layouts], num, expected)
            y, saved, states = self._forward(layouts, stores, plist, x, side)
            return self._output(y, states), (plist, saved, carry, side)

        def bwd(res, g):
            plist, saved, carry, side = res
            if self.block_state:
                g = g[0]  # the new states' cotangent: not differentiated (see above)
            grads, gx, gcarry = self._backward(layouts, stores, plist, saved, carry, side, num, g)
            return grads, (gx if x_float else None), gcarry, None

        run.defvjp(fwd, bwd)
        return run(plist, x, carry, side)


def storage_from_flags(policy: Any = None, offload: Any = False, boundary_dtype: Any = None,
                       boundaries_in_grads: bool = True) -> Storage:
    """The one storage the keyword flags of `reconstruct` describe (names or objects),
    for code that builds a storage per segment from those flags.

    >>> storage_from_flags(boundary_dtype="bf16").kind, storage_from_flags(policy="dots").kind
    ('grad_slots', 'policy')
    """
    policy = resolve_policy(policy)
    if boundary_dtype is not None:
        from eae_jax.dtypes import parse_compute_dtype

        boundary_dtype = parse_compute_dtype(boundary_dtype)
    if policy is not None:
        return Policy(policy)
    if offload:
        return HostUnrolled(boundary_dtype) if offload == "unrolled" else Host(boundary_dtype)
    if boundaries_in_grads:
        return GradSlots(boundary_dtype)
    return OnDevice(boundary_dtype)


def _storage_list(storage, segments: List[Segment]) -> List[Storage]:
    items = list(storage) if isinstance(storage, (list, tuple)) else [storage] * len(segments)
    if len(items) != len(segments):
        raise ValueError(f"storage: {len(items)} storages given for {len(segments)} segments "
                         f"({', '.join(s.name for s in segments)}); give one, or one per segment")
    for i, item in enumerate(items):
        if not isinstance(item, Storage):
            raise TypeError(f"storage {i} is {item!r}; expected an eae_jax.reconstruct storage "
                            "(OnDevice, GradSlots, Policy, Host, HostUnrolled or a Storage subclass)")
    return items


def reconstruct(
    blocks: Union[BlockFn, Scan, Sequence[Union[BlockFn, Scan]]],
    *,
    passes: Union[PassLike, Sequence[PassLike], None] = None,
    boundary_dtype: Optional[DTypeLike] = None,
    offload: Union[bool, Literal["scan", "unrolled"]] = False,
    policy: PolicyLike = None,
    stats: bool = True,
    boundaries_in_grads: bool = True,
    storage: Union[Storage, Sequence[Storage], None] = None,
    memory_budget: Union[int, float, str, MemoryBudget, None] = None,
    block_state: bool = False,
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
        storage, ``policy=None``): True or ``'scan'`` keeps scanned runs
        scans (`Host`); ``'unrolled'`` unrolls them so that each boundary's
        copy back overlaps the next block's backward (`HostUnrolled`).
      policy: None/``'boundaries'`` (keep only boundaries), ``'dots'``,
        ``'dots_all'``, ``'everything'``, or a `jax.checkpoint_policies`
        callable: which block internals the forward also keeps so the
        backward need not recompute them (`Policy`).
      stats: collect per-boundary adjoint norms into the carry.
      boundaries_in_grads: a scanned run stores boundary i inside the buffer
        that later receives block i's gradients of its largest parameters
        (`GradSlots`): the backward reads the boundary out and overwrites
        it with the gradients in place, saving L boundaries of peak memory.
        Applies to boundary-only storage on device (no policy, no offload)
        when a block's float params outweigh one boundary; otherwise
        boundaries are stored the ordinary way; results are identical.
        Slots carry no derivative: grad of grad raises ValueError; pass
        False (and no offload) for that.
      storage: instead of ``boundary_dtype``, ``offload``, ``policy`` and
        ``boundaries_in_grads``: one `Storage` for every segment, or a list
        with one per segment (see the `eae_jax.reconstruct` package
        docstring for the storages and how to write one).
      memory_budget: instead of storages: bytes (``'6GiB'``), a fraction in
        (0, 1] of plain autodiff's activations, or a
        `eae_jax.reconstruct.MemoryBudget`. The stack plans, on its first
        call for each input shape, the fastest storage per run of blocks
        whose gradient step fits (`eae_jax.reconstruct.plan_memory`; the
        plan: `Reconstructed.plan`). The budget covers params, gradients,
        the stack's activations and the default loss (the output's sum);
        pass a `MemoryBudget` for another loss or an optimizer's state.
      block_state: every block returns ``(y, new_state)`` instead of ``y``
        (state a block updates as it runs: RNG counters, batch statistics),
        and the stack returns ``(xL, new states)`` (see
        `Reconstructed.__call__`). The old state is read from the block's
        params, so the backward's recomputation of a block sees the state
        its forward saw (the same dropout mask).

    Returns:
      A `Reconstructed` stack.

    Raises:
      TypeError: ``blocks``, ``passes`` or ``storage`` of the wrong kind.
      ValueError: an unknown ``offload`` schedule or ``policy`` name, or
        ``storage`` given together with the storage keywords.

    >>> from eae_jax.passes import clip_by_norm
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w), passes=clip_by_norm(1.0))
    >>> w, x = jnp.ones((4, 3, 3)) * 0.5, jnp.ones((2, 3))
    >>> jax.grad(lambda w: stack(w, x).sum())(w).shape
    (4, 3, 3)

    One storage per segment:

    >>> from eae_jax.reconstruct import GradSlots, OnDevice
    >>> stack = reconstruct([Scan(lambda w, x: jnp.tanh(x @ w)), lambda w, x: x @ w],
    ...                     storage=[GradSlots(), OnDevice("bfloat16")])
    >>> [s.kind for s in stack.storages([jnp.ones((3, 2, 2)), jnp.ones((2, 2))], jnp.ones((1, 2)))]
    ['grad_slots', 'device']

    Blocks that update state (here a counter kept in the params):

    >>> stack = reconstruct(lambda p, x: (x * p["w"], p["n"] + 1), block_state=True)
    >>> y, states = stack({"w": jnp.full((3, 2), 2.0), "n": jnp.arange(3)}, jnp.ones(2))
    >>> y, states
    (Array([8., 8.], dtype=float32), Array([1, 2, 3], dtype=int32))
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
            segments.append(Segment(item.fn, item.name or f"{getattr(item.fn, '__name__', 'block')}[{i}]", True,
                                    bool(block_state)))
        elif callable(item):
            segments.append(Segment(item, f"{getattr(item, '__name__', 'block')}[{i}]", False, bool(block_state)))
        else:
            raise TypeError(f"block {i} is {item!r}; expected a function or eae_jax.Scan")
    if passes is None:
        chain_ = identity()
    elif isinstance(passes, list) or (isinstance(passes, tuple) and not hasattr(passes, "_fields")):
        # A pass (and an optax transform) is itself a NamedTuple: only plain
        # lists/tuples are sequences of passes.
        chain_ = chain(*passes)
    else:
        chain_ = as_pass(passes)
    if not isinstance(offload, (bool, str)) or (isinstance(offload, str) and offload not in OFFLOAD_SCHEDULES):
        raise ValueError(f"offload must be a bool or one of {OFFLOAD_SCHEDULES}, got {offload!r}")
    budget = None
    if memory_budget is not None:
        if storage is not None:
            raise ValueError("reconstruct: give either storage= or memory_budget=, not both (the budget chooses "
                             "the storages)")
        budget = memory_budget if isinstance(memory_budget, MemoryBudget) else MemoryBudget(memory_budget)
        storage = GradSlots()  # checked below like a given storage; the plan replaces it
    if storage is not None:
        given = [name for name, value, default in (("boundary_dtype", boundary_dtype, None), ("offload", offload, False),
                                                   ("policy", policy, None),
                                                   ("boundaries_in_grads", boundaries_in_grads, True))
                 if value is not default and value != default]
        if given:
            what = "memory_budget=" if budget is not None else "storage="
            raise ValueError(f"reconstruct: give either {what} or {', '.join(given)}, not both (a storage "
                             "holds its own dtype and placement)")
        stores = _storage_list(storage, segments)
    else:
        stores = [storage_from_flags(policy, offload, boundary_dtype, bool(boundaries_in_grads))
                  ] * len(segments)
    return Reconstructed(segments, chain_, stores, stats, single, bool(block_state), budget)
