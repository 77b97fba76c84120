"""What a seam is told and what it remembers: recipe, guards, ledger, state.

`Recipe` (numeric), `Guard` (checks, strict mode, detaching, the gate) and
`Contract` (the static form, `trace_check`) describe a seam; `SeamState`
holds its arrays, including the `eae_jax.observe` handles its calls report
through. A differentiated step's observations are the cotangents of those
handles (the one accumulation rule is `eae_jax.observe`'s: counts add, the
amax of one use per handle is exact) and `fold` turns them into the next
state. `report` and `LedgerMonitor` are the host's view.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import observe as obs_lib
from eae_jax.dtypes import fp8_dtype, parse_compute_dtype
from eae_jax.fp8.quant import E4M3, E5M2, fp8_max, scale_from_amax

ACTIVATION_SCALINGS = ("static", "delayed", "row")
WEIGHT_SCALINGS = ("channel", "delayed")
GRAD_SCALINGS = ("current", "delayed")


class GuardRefused(RuntimeError):
    """A seam was called outside its contract and could not (or, strict, was
    not allowed to) fall back.

    >>> issubclass(GuardRefused, RuntimeError)
    True
    """


class GateRefused(RuntimeError):
    """A bound fp8 seam missed its parity gate; ``worst`` holds the worst cosine.

    >>> GateRefused("refused", 0.99).worst
    0.99
    """

    def __init__(self, message: str, worst: float):
        super().__init__(message)
        self.worst = worst


class Fp8FallbackWarning(RuntimeWarning):
    """A seam ran its high-precision path, or detached itself.

    >>> issubclass(Fp8FallbackWarning, RuntimeWarning)
    True
    """


class Recipe(NamedTuple):
    """How a seam quantizes (docs/fp8.md says where each mode wins).

    >>> Recipe(weight="delayed").check().gradient
    'current'
    """

    activation: str = "static"  # calibrated | 'delayed': fold follows the observed amax | 'row': per row, in graph
    weight: str = "channel"  # per output channel, from the live weight | 'delayed': per tensor, last step's amax
    gradient: str = "current"  # e5m2 scale from each gradient's amax | 'delayed': from the last step's
    margin: float = 0.0  # headroom of the activation scales, in binades
    grad_margin: float = 2.0  # headroom of the gradient scales, in binades
    fast_accum_fwd: bool = True  # forward GEMMs may use fast fp8 accumulation
    fast_accum_bwd: bool = False  # gradient GEMMs (contracting over every token) may too

    def check(self) -> "Recipe":
        """The recipe itself, validated (ValueError naming the bad field)."""
        for field, valid in (("activation", ACTIVATION_SCALINGS), ("weight", WEIGHT_SCALINGS),
                             ("gradient", GRAD_SCALINGS)):
            if getattr(self, field) not in valid:
                raise ValueError(f"unknown {field} scaling {getattr(self, field)!r}; expected one of {valid}")
        if not -16.0 <= self.margin <= 16.0:  # NaN fails too; past 16 binades no fp8 precision is left
            raise ValueError(f"margin must be in [-16, 16] binades, got {self.margin}")
        if not 0.0 <= self.grad_margin <= 16.0:
            raise ValueError(f"grad_margin must be in [0, 16] binades, got {self.grad_margin}")
        return self


@dataclasses.dataclass(frozen=True)
class Guard:
    """What a seam checks and what a failed check does.

    >>> Guard(check_values=False).detach_after
    32
    """

    check_values: bool = True  # in-graph checks (non-finite, saturation, detached); False: fp8 always
    check_hidden: bool = True  # check saturation at the FFN's down-projection input too
    saturation_threshold: float = 1e-3  # fall back when more of a point's elements lie beyond the range
    strict: bool = False  # raise GuardRefused instead of falling back
    detach_after: Optional[int] = 32  # consecutive fallbacks until high precision for good (None/0: never)
    gate_cos: float = 0.999  # the parity gate's cosine threshold (0: no gate)

    def __post_init__(self):
        for bad, what in ((not 0.0 <= self.saturation_threshold < 1.0, "saturation_threshold must be in [0, 1)"),
                          (not 0.0 <= self.gate_cos <= 1.0, "gate_cos must be in [0, 1]"),
                          (self.detach_after is not None and self.detach_after < 0, "detach_after must be >= 0")):
            if bad:
                raise ValueError(f"{what}, got {self}")


#: Platform names a contract may allow (``'gpu'`` covers cuda and rocm).
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Contract:
    """The static form the fp8 path accepts (dtypes, rows, platforms (CPU
    emulates fp8 exactly), GPU compute capability); outside it the traced
    graph takes the high-precision path, counted on every call.

    >>> Contract(platforms="gpu").platforms
    ('gpu',)
    """

    dtypes: Tuple[Any, ...] = ("bf16", "fp16", "fp32")
    min_rows: int = 1
    max_rows: Optional[int] = None
    platforms: Optional[Tuple[str, ...]] = None
    min_compute_capability: float = 8.9

    def __post_init__(self):
        dtypes = (self.dtypes,) if isinstance(self.dtypes, str) else tuple(self.dtypes)
        try:
            object.__setattr__(self, "dtypes", tuple(parse_compute_dtype(d) for d in dtypes))
        except ValueError as err:
            raise ValueError(f"Contract dtypes: {err}") from err
        if self.platforms is not None:
            names = (self.platforms,) if isinstance(self.platforms, str) else tuple(self.platforms)
            bad = [p for p in names if p not in PLATFORMS]
            if bad:
                raise ValueError(f"unknown platform(s) {bad}; expected names from {PLATFORMS}")
            object.__setattr__(self, "platforms", names)
        if self.min_rows < 0 or (self.max_rows is not None and self.max_rows < max(self.min_rows, 1)):
            raise ValueError(f"bad row bounds: min_rows={self.min_rows}, max_rows={self.max_rows} "
                             "(need 0 <= min_rows <= max_rows, max_rows >= 1)")


def _platform_problem(contract: Contract, x) -> Optional[str]:
    try:
        devices = x.devices()
        device = next(iter(devices)) if len(devices) == 1 else jax.devices()[0]
    except Exception:  # a tracer or numpy input has no device: the default one runs it
        device = jax.devices()[0]
    platform = device.platform
    if contract.platforms is not None and not {platform, "gpu" if platform in ("cuda", "rocm") else platform} \
            & set(contract.platforms):
        return f"platform {platform!r} not in {contract.platforms}"
    cc = str(getattr(device, "compute_capability", "")) if platform in ("gpu", "cuda") else ""
    if re.fullmatch(r"\d+(\.\d+)?", cc) and float(cc) < contract.min_compute_capability:
        return f"GPU compute capability {cc} has no fp8 tensor cores (needs >= {contract.min_compute_capability})"
    return None


def trace_check(contract: Contract, x: Any, width: int) -> Optional[Tuple[str, str]]:
    """None when fp8 may run on ``x``, else ``(reason, detail)``: ``'dtype'``,
    ``'rows'`` or ``'device'``. A wrong width or a non-float input raises
    `GuardRefused` (no path can run it).

    >>> trace_check(Contract(max_rows=2), jnp.ones((4, 8)), 8)
    ('rows', '4 row(s) (bound for [1, 2])')
    """
    shape = tuple(x.shape)
    if not shape or shape[-1] != width:
        raise GuardRefused(f"input of shape {shape} has width {shape[-1] if shape else None}; "
                           f"the seam was bound for width {width}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise GuardRefused(f"input dtype {x.dtype} is not floating; a seam computes on float activations")
    if jnp.dtype(x.dtype) not in contract.dtypes:
        return "dtype", f"input dtype {jnp.dtype(x.dtype).name} (bound for {', '.join(d.name for d in contract.dtypes)})"
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if rows < contract.min_rows or (contract.max_rows is not None and rows > contract.max_rows):
        return "rows", f"{rows} row(s) (bound for [{contract.min_rows}, {contract.max_rows}])"
    problem = _platform_problem(contract, x)
    return None if problem is None else ("device", problem)


def magnitude(x: jax.Array) -> jax.Array:
    """float32 ``|x|`` with NaN as inf (XLA's CPU max may drop NaNs).

    >>> magnitude(jnp.array([-2.0, jnp.nan]))
    Array([ 2., inf], dtype=float32)
    """
    mag = jnp.abs(x.astype(jnp.float32))
    return jnp.where(jnp.isnan(mag), jnp.inf, mag)


def saturation_limit(fmt: Any = "e4m3") -> float:
    """Scaled magnitude beyond which clipping changes a value by more than
    rounding would (max plus half an ulp).

    >>> saturation_limit("e4m3"), saturation_limit("e5m2")
    (464.0, 61440.0)
    """
    fmax, info = fp8_max(fmt), jnp.finfo(fp8_dtype(fmt))
    return fmax + 2.0 ** (int(np.floor(np.log2(fmax))) - int(info.nmant) - 1)


def value_stats(x: jax.Array, scale: Optional[jax.Array]) -> Tuple[jax.Array, jax.Array]:
    """``(amax, saturated fraction)`` of values about to be quantized to e4m3 at
    ``scale`` (None: per row, cannot saturate), in one pass; NaN/inf give inf.

    >>> [float(v) for v in value_stats(jnp.array([1.0, 500.0]), jnp.float32(1.0))]
    [500.0, 0.5]
    """
    mag = magnitude(jax.lax.stop_gradient(x))  # statistics, not values to differentiate
    if scale is None:
        return jnp.max(mag), jnp.zeros((), jnp.float32)
    limit = saturation_limit() * jnp.asarray(scale, jnp.float32)
    amax, count = jax.lax.reduce((mag, (mag > limit).astype(jnp.float32)), (jnp.float32(0), jnp.float32(0)),
                                 lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]), tuple(range(x.ndim)))
    return amax, count / max(1, x.size)


# ---------------------------------------------------------------------- ledger and state
#: Why a call ran high precision: value reasons (in the graph), trace-time
#: ones, a detached seam, and fallbacks that are not the seam's own.
REASONS = ("nonfinite", "saturation", "hidden_saturation", "dtype", "rows", "device", "detached", "block", "step")
#: Reasons that neither extend a seam's run of fallbacks nor detach it.
NOT_OWN = (REASONS.index("block"), REASONS.index("step"))
OWN_VALUE = tuple(REASONS.index(r) for r in ("nonfinite", "saturation", "hidden_saturation", "detached"))


def reason_index(name: str) -> int:
    """Index of a reason in `REASONS` (ValueError listing them otherwise).

    >>> reason_index("saturation")
    1
    """
    if name not in REASONS:
        raise ValueError(f"unknown fallback reason {name!r}; expected one of {REASONS}")
    return REASONS.index(name)


class Ledger(NamedTuple):
    """A seam's float32 counters: ``calls``, ``fp8_calls``, ``reasons`` (per
    `REASONS`), ``amax`` (last per point), ``consecutive`` own fallbacks,
    ``detached``, ``last_reason`` (-1: none). Exact up to 2**24 calls.

    >>> new_state(1, 1).ledger.reasons.shape
    (9,)
    """

    calls: jax.Array
    fp8_calls: jax.Array
    reasons: jax.Array
    amax: jax.Array
    consecutive: jax.Array
    detached: jax.Array
    last_reason: jax.Array


class Observed(NamedTuple):
    """The `eae_jax.observe` handles a seam reports through.

    >>> new_state(2, 2).observed.gemm.calls.shape
    (2,)
    """

    counts: obs_lib.Handle  # reduce 'sum': calls, fp8_calls, reasons
    act: obs_lib.Handle  # reduce 'max': amax per quantization point
    gemm: obs_lib.Handle  # reduce 'max': a linear_observer per GEMM, stacked: gradient and weight amax


class CastWeights(NamedTuple):
    """A seam's weights cast once for a step (`eae_jax.fp8.cast_weights`).

    >>> CastWeights((), jnp.zeros((0,)))._fields
    ('q', 'amax')
    """

    q: Tuple[jax.Array, ...]
    amax: jax.Array


class SeamState(NamedTuple):
    """A seam's arrays (any leading axes, e.g. layers): plain data that stacks,
    scans, checkpoints and donates (every leaf its own buffer).

    >>> new_state(2, 2, scales=[0.25, 0.5]).scales.tolist()
    [0.25, 0.5]
    """

    scales: jax.Array  # (points,) e4m3 activation scales
    grad_scales: jax.Array  # (gemms,) e5m2 gradient scales (0: never observed)
    weight_scales: jax.Array  # (gemms,) per-tensor e4m3 weight scales (0: not started)
    grad_clipped: jax.Array  # (gemms,) steps a gradient outgrew its delayed scale
    weight_clipped: jax.Array  # (gemms,) steps a weight outgrew its delayed scale
    ledger: Ledger
    observed: Observed
    cast: Optional[CastWeights] = None  # the step's cast weights (fold drops them)


def _f32(value, shape) -> jax.Array:
    """A fresh float32 buffer of ``shape`` (never an alias of ``value``)."""
    return jnp.array(np.broadcast_to(np.asarray(value, np.float32), shape), jnp.float32, copy=True)


def new_state(points: int, gemms: int, scales: Any = None, weight_scales: Any = None) -> SeamState:
    """A fresh `SeamState` (activation scales default 1, weight scales 0,
    nothing observed yet).

    >>> new_state(2, 2).grad_scales.tolist()
    [0.0, 0.0]
    """
    z = lambda shape=(): jnp.zeros(shape, jnp.float32)  # noqa: E731 - a new buffer per call
    counts = obs_lib.handle({"calls": z(), "fp8_calls": z(), "reasons": z((len(REASONS),))}, "sum")
    gemm = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[obs_lib.handle(
        {"grad": z(), "weight": z()}, "max") for _ in range(gemms)])
    ledger = Ledger(z(), z(), z((len(REASONS),)), z((points,)), z(), z(), _f32(-1.0, ()))
    return SeamState(_f32(1.0 if scales is None else scales, (points,)), z((gemms,)),
                     _f32(0.0 if weight_scales is None else weight_scales, (gemms,)), z((gemms,)), z((gemms,)),
                     ledger, Observed(counts, obs_lib.handle(z((points,)), "max"), gemm))


def _call_counts(code: jax.Array) -> Dict[str, jax.Array]:
    """The counts one call adds: ``code`` -1 when fp8 ran, else a `REASONS` index."""
    code = jnp.asarray(code, jnp.int32)
    # calls derived from code, so that under vmap it is batched like the others
    return {"calls": (code >= -1).astype(jnp.float32), "fp8_calls": (code < 0).astype(jnp.float32),
            "reasons": (jnp.arange(len(REASONS), dtype=jnp.int32) == code).astype(jnp.float32)}


def observations(state: SeamState, cot: Any) -> Dict[str, Any]:
    """One step's observations (counts, amaxes) from the cotangent of ``state``
    or of its `Observed`; ValueError for another state's.

    >>> st = new_state(1, 1)
    >>> observations(st, st)["counts"]["calls"]
    Array(0., dtype=float32)
    """
    obs = cot.observed if isinstance(cot, SeamState) else cot
    if not isinstance(obs, Observed):
        raise ValueError(f"expected a SeamState cotangent or its Observed, got {type(cot).__name__}")
    out = {}
    for name, mine, theirs in zip(Observed._fields, state.observed, obs):
        if not isinstance(theirs, obs_lib.Handle) or [jnp.shape(a) for a in jax.tree_util.tree_leaves(mine)] != \
                [jnp.shape(a) for a in jax.tree_util.tree_leaves(theirs)]:
            raise ValueError(f"the {name} observations are shaped for another state (layers or seam differ)")
        out[name] = obs_lib.receive(mine, theirs)[0]
    return out


def fold(recipe: Recipe, detach_after: Optional[int], state: SeamState, seen: Dict[str, Any]) -> SeamState:
    """A state after one step's `observations` (any leading axes). Counts add;
    ``consecutive`` counts fallbacks of the seam's own (a step with an fp8
    call resets it) and ``detached`` is set for good at ``detach_after``.
    Observed amaxes become scales: activation ones when delayed, gradient
    ones (with ``grad_margin``; delayed scaling counts an amax beyond the
    scale's range in ``grad_clipped``) and weight ones (beyond 464/448 of the
    range counts in ``weight_clipped``). Cast weights are dropped.

    >>> st = new_state(1, 1)
    >>> fold(Recipe(), 32, st, observations(st, st)).ledger.calls
    Array(0., dtype=float32)
    """
    led, counts, act = state.ledger, seen["counts"], seen["act"]
    fell_back = counts["calls"] - counts["fp8_calls"] - sum(counts["reasons"][..., i] for i in NOT_OWN)
    consecutive = jnp.where(counts["fp8_calls"] > 0, 0.0, led.consecutive + fell_back)
    detached = jnp.maximum(led.detached, (consecutive >= detach_after).astype(jnp.float32)) if detach_after \
        else led.detached
    newest = jnp.max(jnp.where(counts["reasons"] > 0, jnp.arange(len(REASONS), dtype=jnp.float32), -1.0), axis=-1)
    ledger = Ledger(led.calls + counts["calls"], led.fp8_calls + counts["fp8_calls"], led.reasons + counts["reasons"],
                    jnp.where(act > 0, act, led.amax), consecutive, detached,
                    jnp.where(newest >= 0, newest, led.last_reason))
    scales = state.scales
    if recipe.activation == "delayed":
        scales = jnp.where(act > 0, scale_from_amax(act, E4M3, recipe.margin), scales)
    g, gs = seen["gemm"]["grad"], state.grad_scales
    grad_clipped = state.grad_clipped
    if recipe.gradient == "delayed":  # a never-observed (0) scale saturated everything: clipped too
        grad_clipped = grad_clipped + ((g > 0) & (g > gs * fp8_max(E5M2))).astype(jnp.float32)
    w, ws = seen["gemm"]["weight"], state.weight_scales
    weight_clipped = state.weight_clipped + ((w > 0) & (ws > 0) & (w > ws * saturation_limit(E4M3))).astype(jnp.float32)
    return state._replace(scales=scales, grad_scales=jnp.where(g > 0, scale_from_amax(g, E5M2, recipe.grad_margin), gs),
                          weight_scales=jnp.where(w > 0, scale_from_amax(w, E4M3), ws), grad_clipped=grad_clipped,
                          weight_clipped=weight_clipped, ledger=ledger, cast=None)


def own_fallbacks(seen: Dict[str, Any]) -> jax.Array:
    """Per seam instance: calls that failed a check of their own in the graph.

    >>> own_fallbacks({"counts": {"reasons": jnp.eye(9)[0]}})
    Array(1., dtype=float32)
    """
    return sum(seen["counts"]["reasons"][..., i] for i in OWN_VALUE)


def _as_step_fallback(seen: Dict[str, Any], bad: jax.Array) -> Dict[str, Any]:
    """`observations` of a step that is dropped (``bad``): fp8 calls count as
    fallbacks with reason ``'step'``, gradient and weight amaxes are dropped."""
    counts = dict(seen["counts"])
    moved = jnp.where(bad, counts["fp8_calls"], 0.0)
    counts["reasons"] = counts["reasons"].at[..., REASONS.index("step")].add(moved)
    counts["fp8_calls"] = counts["fp8_calls"] - moved
    gemm = jax.tree_util.tree_map(lambda a: jnp.where(bad, jnp.zeros_like(a), a), seen["gemm"])
    return {**seen, "counts": counts, "gemm": gemm}


def report(state: Any, name: str = "seam") -> List[Dict[str, Any]]:
    """Host-side receipt of a `SeamState` per seam instance (``name[i]`` for
    layers): counts, reasons, detaching, amax, per GEMM scales and clipped steps.

    >>> report(new_state(1, 1), "ffn")[0]["calls"]
    0
    """
    if not isinstance(state, SeamState):
        raise TypeError(f"report needs a SeamState, got {type(state).__name__}")
    led = Ledger(*[np.asarray(a) for a in state.ledger])
    per_gemm = {k: np.asarray(getattr(state, k)) for k in ("grad_scales", "grad_clipped", "weight_scales",
                                                             "weight_clipped")}
    out = []
    for index in np.ndindex(*led.calls.shape):
        reasons, last = led.reasons[index], int(led.last_reason[index])
        entry = {"seam": name if not index else f"{name}[{','.join(str(i) for i in index)}]",
                 "calls": int(led.calls[index]), "fp8_calls": int(led.fp8_calls[index]),
                 "fallbacks": int(led.calls[index] - led.fp8_calls[index]),
                 "by_reason": {REASONS[r]: int(reasons[r]) for r in range(len(REASONS)) if reasons[r] > 0},
                 "last_reason": REASONS[last] if last >= 0 else None, "consecutive": int(led.consecutive[index]),
                 "detached": bool(led.detached[index] > 0), "amax": [float(a) for a in led.amax[index]]}
        for k, v in per_gemm.items():
            entry[k] = [(int if k.endswith("clipped") else float)(a) for a in v[index]]
        out.append(entry)
    return out


class LedgerMonitor:
    """Warns once per seam and reason, and once per detached seam (host state).

    >>> LedgerMonitor().observe([])
    """

    def __init__(self):
        self._said = set()

    def _say(self, key, message):
        if key not in self._said:
            self._said.add(key)
            warnings.warn(message, Fp8FallbackWarning, stacklevel=3)

    def trace_fallback(self, seam: str, reason: str, detail: str) -> None:
        """A trace-time contract failure (said when the seam is traced)."""
        self._say((seam, reason), f"eae_jax.fp8: seam {seam!r} takes its high-precision path: {reason} "
                                  f"({detail}). Every call is counted in the ledger; this is said once.")

    def observe(self, entries: List[Dict[str, Any]]) -> None:
        """Warn about the reasons and detachments in `report` entries."""
        for e in entries:
            for reason, n in ((r, n) for r, n in e["by_reason"].items() if r != "detached"):
                why = "because another seam of the same block call fell back" if reason == "block" else f"({reason})"
                self._say((e["seam"], reason), f"eae_jax.fp8: seam {e['seam']!r} fell back to high precision {why}; "
                          f"{n} such call(s) so far. Further ones are counted in report(), not said.")
            if e["detached"]:
                self._say((e["seam"], "detached"), f"eae_jax.fp8: seam {e['seam']!r} fell back {e['consecutive']} "
                          f"times in a row (last: {e['last_reason']}) and has detached itself for good: it now "
                          "always runs high precision.")

    def notify(self, states: Dict[str, SeamState]) -> None:
        """From a traced step: one ``jax.debug.callback`` handing the states to `observe`."""
        jax.debug.callback(lambda sts: self.observe([e for n, s in sts.items() for e in report(s, n)]), states)


def _raise_strict(seam: str, code) -> None:
    if int(code) >= 0:
        raise GuardRefused(f"eae_jax.fp8: seam {seam!r} refused a call in strict mode: {REASONS[int(code)]}")


def strict_check(seam: str, code: jax.Array) -> None:
    """Strict mode: a host callback raising `GuardRefused` when ``code >= 0``.

    >>> strict_check("ffn", jnp.int32(-1))
    """
    jax.debug.callback(functools.partial(_raise_strict, seam), code)
