"""What each storage option costs a stack, measured on the backend that will run it.

The memory planner (`eae_jax.reconstruct.budget`) needs, for every segment
and every candidate storage, the device bytes one more block adds to the
step's peak and the time it adds. Both come from small *probe* programs:
the stack's own gradient step (its loss, passes and side input included)
with every scanned segment cut to 2 blocks, compiled once per option with
one segment at 2 and at up to 8 blocks (`probe_depth`). The peak of a probe is its compiled
``memory_analysis()``: argument + output + temp - alias bytes (device
memory only: the same sum the GPU allocator's ``peak_bytes_in_use`` reaches
for a step that holds nothing else). The difference between 3 and 2 blocks
per block is one block's cost (its params, its gradients and what its storage keeps);
what is left at 2 blocks beyond the reference option is the option's extra
working memory for one block (`OptionCost.transient`).

Measuring rather than deriving from shapes matters: XLA:CPU copies the
gradient-slot buffers out at the end (slots cost a leaf per block there,
nothing on a GPU), hoists bf16-to-f32 weight conversions out of scans, and
deduplicates some residuals a policy names. Time is the probes' FLOPs
(``cost_analysis()``) at a given rate plus host transfers at a given
bandwidth (``timing='flops'``: deterministic, works inside ``jit``), or one
profiled call of each probe (``timing='profile'``: the real device, outside
``jit`` only).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.reconstruct.host import Host
from eae_jax.reconstruct.policy import Policy, split_vjp
from eae_jax.reconstruct.slots import GradSlots
from eae_jax.reconstruct.storage import OnDevice, SegmentLayout, Storage

#: How `measure_costs` prices time.
TIMINGS = ("flops", "profile")


class Option(NamedTuple):
    """A candidate storage for a block: its short ``name``, the `Storage`,
    ``where`` its residuals live and ``what`` they are (for the plan table).

    >>> default_options()[0].name, default_options()[0].where
    ('slots', 'grad slots')
    """

    name: str
    storage: Storage
    where: str
    what: str


def default_options() -> Tuple[Option, ...]:
    """The ladder the planner chooses from, least memory first.

    Names a policy keeps are the ones `eae_jax.blocks` gives
    (``attn_q/k/v``, ``attn_out``, ``ffn_gate``, ``ffn_up``); an option that
    keeps nothing more than the boundary in a given block is dropped for it.

    >>> [o.name for o in default_options()]
    ['slots', 'device', 'host', 'ffn', 'qkv_ffn', 'dots', 'dots_attn', 'everything']
    """
    cp = jax.checkpoint_policies
    names = cp.save_only_these_names
    return (
        Option("slots", GradSlots(), "grad slots", "boundary"),
        Option("device", OnDevice(), "device", "boundary"),
        Option("host", Host(), "pinned host", "boundary"),
        Option("ffn", Policy(names("ffn_gate", "ffn_up")), "device", "boundary + FFN gate/up"),
        Option("qkv_ffn", Policy(names("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")), "device",
               "boundary + q/k/v + FFN gate/up"),
        Option("dots", Policy("dots"), "device", "boundary + matmul outputs"),
        Option("dots_attn", Policy(cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                                              names("attn_out"))),
               "device", "boundary + matmul outputs + attention output"),
        Option("everything", Policy("everything"), "device", "every internal (plain autodiff)"),
    )


class OptionCost(NamedTuple):
    """One option's measured cost in one segment.

    Attributes:
      bytes_per_block: device bytes one more block adds to the peak
        (its params, gradients and kept residuals).
      kept_per_block: ``bytes_per_block`` less the block's params and
        gradients: what the storage keeps.
      transient: extra working bytes of one block under this option, beyond
        the reference option's (counted once, for the largest option used).
      seconds_per_block: time one more block adds to the step.
      host_bytes_per_block: bytes kept in host memory per block.

    >>> OptionCost(10, 2, 0, 1e-3, 0).kept_per_block
    2
    """

    bytes_per_block: int
    kept_per_block: int
    transient: int
    seconds_per_block: float
    host_bytes_per_block: int


@dataclasses.dataclass
class SegmentCosts:
    """The measured options of one segment (``options``: name -> `OptionCost`).

    >>> SegmentCosts("blocks", 4, True, {}).depth
    4
    """

    name: str
    depth: int
    scanned: bool
    options: Dict[str, OptionCost]


@dataclasses.dataclass
class Costs:
    """Every segment's option costs and the probe they are relative to.

    ``base_peak`` / ``base_seconds``: the reference probe (every option at
    the reference, scanned segments at ``PROBE_DEPTH`` blocks). ``params``,
    ``grads``: one device's bytes of the full-depth params and their float
    gradients.
    Serializable (`to_json` / `from_json`) so one measurement serves many
    budgets.

    >>> c = Costs([], "device", 100, 1e-3, 40, 40, "flops", "cpu")
    >>> Costs.from_json(c.to_json()).base_peak
    100
    """

    segments: List[SegmentCosts]
    reference: str
    base_peak: int
    base_seconds: float
    params: int
    grads: int
    timing: str
    backend: str
    what: Dict[str, Tuple[str, str]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        doc = dataclasses.asdict(self)
        doc["segments"] = [{**dataclasses.asdict(s), "options": {k: list(v) for k, v in s.options.items()}}
                           for s in self.segments]
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> "Costs":
        doc = json.loads(text)
        doc["segments"] = [SegmentCosts(s["name"], s["depth"], s["scanned"],
                                        {k: OptionCost(*v) for k, v in s["options"].items()})
                           for s in doc["segments"]]
        doc["what"] = {k: tuple(v) for k, v in doc.get("what", {}).items()}
        return cls(**doc)


#: Blocks per scanned segment in the reference probe (a one-trip loop would
#: be inlined by XLA, another program than the real step's loop).
PROBE_DEPTH = 2

#: The deepest second probe: XLA packs buffers with some slack, so a slope
#: over several blocks is steadier than one block's difference (a scan's
#: compile time does not grow with depth).
MAX_PROBE_DEPTH = 8


#: Timed runs of each probe under ``timing='profile'`` (the median counts).
PROFILE_RUNS = 7


def probe_depth(depth: int) -> int:
    """The depth of the second probe of a scanned segment of ``depth`` blocks:
    the segment itself up to `MAX_PROBE_DEPTH` blocks, at least 3.

    >>> probe_depth(1), probe_depth(6), probe_depth(48)
    (3, 6, 8)
    """
    return max(PROBE_DEPTH + 1, min(depth, MAX_PROBE_DEPTH))


def nbytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (shapes only; keys count their data).

    >>> nbytes({"a": jnp.ones((2, 3)), "b": jax.ShapeDtypeStruct((4,), jnp.bfloat16)})
    32
    """
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            total += int(np.prod(leaf.shape, dtype=np.int64)) * 8
        else:
            total += int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    return total


def float_bytes(tree) -> int:
    """Bytes of the floating leaves of ``tree`` (what its gradients take).

    >>> float_bytes({"w": jnp.ones(4), "n": jnp.int32(1)})
    16
    """
    return sum(nbytes(l) for l in jax.tree_util.tree_leaves(tree)
               if not jax.dtypes.issubdtype(l.dtype, jax.dtypes.prng_key) and jnp.issubdtype(l.dtype, jnp.inexact))


def shard_bytes(tree, shardings, floats_only: bool = False) -> int:
    """One device's bytes of ``tree``'s leaves laid out by ``shardings`` (a
    tree of `jax.sharding.Sharding` matching ``tree``, or one for every
    leaf); ``floats_only`` counts the floating leaves alone (their gradients).

    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    >>> shard_bytes({"w": jnp.ones((4, 2))}, NamedSharding(mesh, PartitionSpec("fsdp")))
    32
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if isinstance(shardings, jax.sharding.Sharding):
        per_leaf = [shardings] * len(leaves)
    else:
        per_leaf = treedef.flatten_up_to(shardings)
    total = 0
    for leaf, sharding in zip(leaves, per_leaf):
        if floats_only and not float_bytes(leaf):
            continue
        shape = tuple(leaf.shape) if sharding is None else tuple(sharding.shard_shape(tuple(leaf.shape)))
        total += nbytes(jax.ShapeDtypeStruct(shape, leaf.dtype))
    return total


def compiled_peak(compiled) -> int:
    """Device peak of a compiled program: argument + output + temp - alias bytes.

    >>> compiled_peak(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile())
    32
    """
    ma = compiled.memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)


def jaxpr_flops(jaxpr) -> float:
    """FLOPs of a jaxpr: matmuls and fused attention exactly, every other
    equation one per output element; scan bodies times their length (XLA's
    ``cost_analysis`` counts a loop body once, whatever its trip count).

    >>> jaxpr_flops(jax.make_jaxpr(lambda a: a @ a)(jnp.ones((4, 4))).jaxpr)
    128.0
    >>> step = lambda h, _: (jnp.tanh(h @ h), None)
    >>> jaxpr_flops(jax.make_jaxpr(lambda a: jax.lax.scan(step, a, None, length=3)[0])(jnp.ones((4, 4))).jaxpr)
    432.0
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = [getattr(v, "jaxpr", v) for value in eqn.params.values()
                for v in (value if isinstance(value, (tuple, list)) else (value,))
                if hasattr(getattr(v, "jaxpr", v), "eqns")]
        if name == "cond":
            total += max((jaxpr_flops(b) for b in subs), default=0.0)
        elif subs:
            times = eqn.params.get("length", 1) if name == "scan" else 1
            total += times * sum(jaxpr_flops(b) for b in subs)
        elif name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = int(np.prod([lhs[d] for d in contract], dtype=np.int64))
            total += 2.0 * k * int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
        elif "dot_product_attention" in name:
            total += _attention_flops(eqn)
        else:
            total += float(sum(int(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64)) for v in eqn.outvars))
    return total


def _attention_flops(eqn) -> float:
    """A fused attention call (cuDNN): QK^T and PV, 2 FLOPs per multiply-add,
    the backward two and a half times the forward."""
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape  # (B, S, H, D), (B, T, Hk, D)
    fwd = 4.0 * q[0] * q[2] * q[1] * k[1] * q[3]
    return fwd * (2.5 if "bwd" in eqn.primitive.name else 1.0)


def _with_depth(spec_tree, depth: int):
    return jax.tree_util.tree_map(lambda l: jax.ShapeDtypeStruct((depth,) + tuple(l.shape[1:]), l.dtype), spec_tree)


def _example(spec, key):
    """A concrete array for ``spec`` (small normal floats, zero ints, keys)."""
    if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
        n = int(np.prod(spec.shape, dtype=np.int64))
        return jax.random.split(key, max(n, 1))[:n].reshape(spec.shape)
    if jnp.issubdtype(spec.dtype, jnp.inexact):
        return (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)
    return jnp.zeros(spec.shape, spec.dtype)


def _examples(tree, seed: int):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    return jax.tree_util.tree_unflatten(treedef, [_example(l, k) for l, k in zip(leaves, keys)])


def default_loss(out) -> jax.Array:
    """The probes' loss when none is given: the sum of the output in float32.

    >>> float(default_loss(jnp.ones((2, 3), jnp.bfloat16)))
    6.0
    """
    return jnp.sum(out.astype(jnp.float32))


def stack_output(stack, params, x, side=None) -> jax.Array:
    """The stack's output ``xL``, what a planning loss is applied to (a stack
    built with ``block_state=True`` also returns its blocks' new states: the
    loss does not read them).

    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: (x * w, w), block_state=True)
    >>> stack_output(stack, jnp.full((2, 3), 2.0), jnp.ones(3))
    Array([4., 4., 4.], dtype=float32)
    """
    out = stack(params, x, side=side)
    return out[0] if stack.block_state else out


class _Prober:
    """Compiles (and with ``profile`` times) the stack's gradient step at
    reduced depths, one storage per segment."""

    def __init__(self, stack, layouts, params, x, side, loss, loss_args, timing, flops_per_s, in_shardings, wrap):
        self.stack, self.layouts, self.side, self.timing = stack, layouts, side, timing
        self.loss, self.loss_args, self.flops_per_s, self.in_shardings = loss, loss_args, flops_per_s, in_shardings
        self.wrap = wrap
        self.plist = stack._param_list(jax.eval_shape(lambda p: p, params))
        self.x = jax.eval_shape(lambda a: a, x)
        self.side_spec = None if side is None else jax.eval_shape(lambda s: s, side)
        self.args_spec = jax.eval_shape(lambda a: a, tuple(loss_args))

    def params_at(self, depths: Sequence[int]):
        plist = [(_with_depth(p, d) if lay.segment.scanned else p)
                 for p, lay, d in zip(self.plist, self.layouts, depths)]
        return plist[0] if self.stack._single else plist

    def run(self, storages: Sequence[Storage], depths: Sequence[int]) -> Tuple[int, float]:
        """``(peak bytes, seconds)`` of the probe with these storages and depths."""
        from eae_jax.reconstruct.stack import Reconstructed

        storages = list(storages) if self.wrap is None else list(self.wrap(list(storages)))
        probe = Reconstructed(self.stack.segments, self.stack.passes, storages, self.stack.collect_stats,
                              self.stack._single, self.stack.block_state)
        loss = self.loss

        def step(p, x, side, args):
            return jax.value_and_grad(lambda pp: loss(stack_output(probe, pp, x, side), *args))(p)

        p_spec = self.params_at(depths)
        jitted = jax.jit(step) if self.in_shardings is None else jax.jit(
            step, in_shardings=self.in_shardings(p_spec, self.x))
        traced = jitted.trace(p_spec, self.x, self.side_spec, self.args_spec)
        compiled = traced.lower().compile()
        peak = compiled_peak(compiled)
        if self.timing == "flops":
            return peak, jaxpr_flops(traced.jaxpr.jaxpr) / self.flops_per_s
        # Concrete inputs and runs even while a jit traces the stack (a plan
        # made on its first call).
        with jax.ensure_compile_time_eval():
            args = (_examples(p_spec, 1), _examples(self.x, 2), _examples(self.side_spec, 4),
                    _examples(self.args_spec, 3))
            jax.block_until_ready(compiled(*args))
            times = []
            for _ in range(PROFILE_RUNS):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                times.append(time.perf_counter() - t0)
        return peak, float(np.median(times))

    def device_bytes(self, depths: Sequence[int], floats_only: bool = False) -> List[int]:
        """Per segment, one device's bytes of its params (or of their float
        gradients) at these depths: the shards under ``in_shardings``."""
        p_spec = self.params_at(depths)
        plist = [p_spec] if self.stack._single else p_spec
        if self.in_shardings is None:
            count = float_bytes if floats_only else nbytes
            return [count(p) for p in plist]
        shardings = self.in_shardings(p_spec, self.x)[0]
        slist = [shardings] if self.stack._single else shardings
        return [shard_bytes(p, s, floats_only) for p, s in zip(plist, slist)]

    def x_share(self) -> float:
        """The fraction of the stack's input one device holds (1 without ``in_shardings``)."""
        whole = nbytes(self.x)
        if self.in_shardings is None or not whole:
            return 1.0
        return shard_bytes(self.x, self.in_shardings(self.params_at([1] * len(self.layouts)), self.x)[1]) / whole


def _distinct_options(layout: SegmentLayout, options: Sequence[Option]) -> List[Option]:
    """The options that differ in this segment: the first of those bound to
    the same storage kind and keeping the same residual shapes."""
    seen, out = set(), []
    for opt in options:
        bound = opt.storage.bind(layout)
        if isinstance(bound, Policy):
            lay1 = layout._replace(depth=1)
            split = split_vjp(lay1, bound.policy)
            outs = split.forward.jaxpr.outvars[1:]
            kept = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v, (src, _) in zip(outs, split.sources)
                         if src == "kept")
            key = ("device", None) if kept == ((tuple(layout.x.shape), str(layout.x.dtype)),) else ("policy", kept)
        else:
            key = (bound.kind, getattr(bound, "dtype", None))
        if key not in seen:
            seen.add(key)
            out.append(opt)
    return out


def measure_costs(stack, params, x, side=None, *, loss: Optional[Callable] = None, loss_args: Sequence = (),
                  options: Optional[Sequence[Option]] = None, timing: str = "flops",
                  flops_per_s: Optional[float] = None, host_bytes_per_s: Optional[float] = None,
                  reference: str = "device", in_shardings: Optional[Callable] = None,
                  block_options: Optional[Sequence[str]] = ("device", "host"),
                  wrap: Optional[Callable] = None) -> Costs:
    """Measure what each option costs each segment of ``stack`` (see the module doc).

    Args:
      stack: a `Reconstructed` (its segments, passes and statistics are
        probed; its own storages are not).
      params, x, side: the step's inputs, or their shapes.
      loss: ``loss(stack_output, *loss_args) -> scalar`` of the real step
        (default `default_loss`): its working memory is part of the peak.
      options: the candidates (default `default_options`); options that
        keep the same thing in a segment are measured once.
      timing: ``'flops'`` or ``'profile'`` (concrete inputs, outside jit).
      flops_per_s, host_bytes_per_s: rates of the ``'flops'`` model
        (default: `device_rates`).
      reference: the option the probes are relative to (``'device'``).
      in_shardings: ``f(param_specs, x_spec) -> in_shardings`` for the
        probes' ``jit`` under a mesh: the peaks, and the params' and
        gradients' bytes, are then one device's.
      block_options: the option names a single (unscanned) block may take
        (default: its boundary on the device or in host memory; None: all).
        Each costs one probe: an embedding or an LM head rarely gains from
        keeping its internals.
      wrap: ``wrap(storages) -> storages`` the stack runs with a plan's
        storages (one per segment), e.g. each wrapped in
        `eae_jax.parallel.Sharded` on an FSDP mesh; the probes run those.

    Returns:
      `Costs`.

    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w))
    >>> c = measure_costs(stack, jnp.ones((4, 8, 8)), jnp.ones((2, 8)))
    >>> sorted(c.segments[0].options)[:3], c.segments[0].options["device"].kept_per_block
    (['device', 'dots', 'everything'], 64)
    """
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    options = list(default_options() if options is None else options)
    by_name = {o.name: o for o in options}
    if len(by_name) != len(options):
        raise ValueError(f"options: names must differ, got {[o.name for o in options]}")
    if reference not in by_name:
        raise ValueError(f"reference option {reference!r} is not among the options {list(by_name)}")
    default_flops, default_host = device_rates()
    flops_per_s = flops_per_s or default_flops
    host_bytes_per_s = host_bytes_per_s or default_host
    *layouts, _ = stack._layouts(params, x, side)
    prober = _Prober(stack, layouts, params, x, side, loss or default_loss, loss_args, timing, flops_per_s,
                     in_shardings, wrap)
    ref = by_name[reference].storage
    base_depths = [PROBE_DEPTH if lay.segment.scanned else 1 for lay in layouts]
    base_peak, base_s = prober.run([ref] * len(layouts), base_depths)
    # One device's share: of each segment's params and gradients, and of a boundary (split like x).
    full_depths = [lay.depth for lay in layouts]
    params_dev, grads_dev = prober.device_bytes(full_depths), prober.device_bytes(full_depths, floats_only=True)
    x_share = prober.x_share()
    segments = []
    for s, lay in enumerate(layouts):
        block_bytes = (params_dev[s] + grads_dev[s]) // lay.depth
        costs: Dict[str, OptionCost] = {}
        ref_slope = None
        candidates = [by_name[reference]] + [o for o in options if o.name != reference and (
            lay.segment.scanned or block_options is None or o.name in block_options)]
        for opt in _distinct_options(lay, candidates):
            stores = [ref] * len(layouts)
            stores[s] = opt.storage
            if lay.segment.scanned:
                if opt.name == reference:
                    p2, t2 = base_peak, base_s
                else:
                    p2, t2 = prober.run(stores, base_depths)
                deeper = list(base_depths)
                deeper[s] = probe_depth(lay.depth)
                p3, t3 = prober.run(stores, deeper)
                span = deeper[s] - PROBE_DEPTH
                slope, slope_s = (p3 - p2) // span, (t3 - t2) / span
                if opt.name == reference:
                    ref_slope = slope
                transient = (p2 - PROBE_DEPTH * slope) - (base_peak - PROBE_DEPTH * ref_slope)
            else:
                p1, t1 = (base_peak, base_s) if opt.name == reference else prober.run(stores, base_depths)
                # A single block is in the base probe already: what an option
                # changes there is all it costs (relative to the reference,
                # which keeps the block's input).
                slope, slope_s, transient = p1 - base_peak + block_bytes + int(nbytes(lay.x) * x_share), t1 - base_s, 0
            bound = opt.storage.bind(lay)
            host = 0
            if bound.kind == "host":
                host = int(nbytes(jax.ShapeDtypeStruct(lay.x.shape, getattr(bound, "dtype", None) or lay.x.dtype))
                           * x_share)
            if timing == "flops" and host:
                slope_s += 2 * host / host_bytes_per_s  # to the host and back, not overlapped
            costs[opt.name] = OptionCost(int(slope), int(slope - block_bytes), int(transient), float(slope_s),
                                         int(host))
        segments.append(SegmentCosts(lay.segment.name, lay.depth, lay.segment.scanned, costs))
    return Costs(segments, reference, int(base_peak), float(base_s), int(sum(params_dev)), int(sum(grads_dev)), timing,
                 jax.default_backend(), {o.name: (o.where, o.what) for o in options})


#: Nominal (flops/s, host bytes/s) of the ``'flops'`` time model per device
#: kind (dense bf16 peak at 40% utilization; host link one way).
_RATES = {"H100": (0.4 * 989e12, 50e9), "H200": (0.4 * 989e12, 50e9), "A100": (0.4 * 312e12, 25e9)}


def device_rates(device=None) -> Tuple[float, float]:
    """``(flops/s, host bytes/s)`` the ``'flops'`` time model uses for ``device``.

    Known GPUs by name; other devices get 1e11 FLOP/s and 10 GB/s (only the
    ratio between the two decides between recomputing and moving to host).

    >>> device_rates(jax.devices("cpu")[0])
    (100000000000.0, 10000000000.0)
    """
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    for name, rates in _RATES.items():
        if name in kind:
            return rates
    return 1e11, 10e9
