"""fp8 seams: replaceable GEMM regions of a block, and their guarded calls.

A `Seam` names a region (`ffn_seam`: SwiGLU, gate and up as one GEMM;
`dense_seam`: linears sharing an input, `qkv_seam`, `out_proj_seam`), its
weights and its `Recipe`, `Guard` and `Contract`. `apply` traces the
high-precision path for trace-time problems and swaps it in through one
``lax.cond`` (whose decision the backward keeps) for value problems.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import observe as obs_lib
from eae_jax.blocks.linear import linear
from eae_jax.blocks.swiglu import swiglu
from eae_jax.fp8 import state as st
from eae_jax.fp8.quant import (E4M3, CastWeight, FrozenWeight, LiveWeight, cast_weight, fp8_linear, quantize_weight,
                               row_amax, scale_from_amax, weight_amax)
from eae_jax.fp8.state import Contract, Guard, GuardRefused, Recipe, SeamState

KINDS = ("swiglu", "dense")
_OWNERS = {**{f.name: "guard" for f in dataclasses.fields(Guard)}, **{f: "recipe" for f in Recipe._fields},
           **{f.name: "contract" for f in dataclasses.fields(Contract)}}


@dataclasses.dataclass(frozen=True)
class Seam:
    """A named GEMM region (static): ``name`` (reports, errors), ``kind``
    (``'swiglu'`` or ``'dense'``), the param names it reads (``weights``) and
    its `Recipe`, `Guard` and `Contract`.

    >>> ffn_seam(weight="delayed", check_values=False).recipe.weight
    'delayed'
    """

    name: str
    kind: str
    weights: Tuple[str, ...]
    recipe: Recipe = Recipe()
    guard: Guard = Guard()
    contract: Contract = Contract()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown seam kind {self.kind!r}; expected one of {KINDS}")
        if not self.weights:
            raise ValueError("a seam needs at least one weight")
        object.__setattr__(self, "weights", tuple(self.weights))
        self.recipe.check()

    @property
    def points(self) -> int:
        """Activation quantization points (= fused GEMMs): 2 for swiglu, 1 for dense."""
        return 2 if self.kind == "swiglu" else 1

    gemms = points

    def replace(self, **fields) -> "Seam":
        """A copy with seam, recipe, guard or contract fields changed by name
        (ValueError for a name none of them has)."""
        parts: Dict[str, Dict[str, Any]] = {"seam": {}, "recipe": {}, "guard": {}, "contract": {}}
        for k, v in fields.items():
            owner = "seam" if k in [f.name for f in dataclasses.fields(Seam)] else _OWNERS.get(k)
            if owner is None:
                raise ValueError(f"unknown seam setting {k!r}")
            parts[owner][k] = v
        seam = dataclasses.replace(self, **parts["seam"])
        return dataclasses.replace(seam, recipe=seam.recipe._replace(**parts["recipe"]),
                                   guard=dataclasses.replace(seam.guard, **parts["guard"]),
                                   contract=dataclasses.replace(seam.contract, **parts["contract"]))


def ffn_seam(name: str = "ffn", **fields) -> Seam:
    """The SwiGLU FFN seam over ``{'w_gate': (F, D), 'w_up': (F, D), 'w_down': (D, F)}``;
    ``fields`` set recipe / guard / contract fields (`Seam.replace`).

    >>> ffn_seam().points
    2
    """
    return Seam(name, "swiglu", ("w_gate", "w_up", "w_down")).replace(**fields)


def dense_seam(weights: Sequence[str], name: Optional[str] = None, **fields) -> Seam:
    """Linears ``x @ w.T`` sharing one input as one fp8 GEMM (outputs split per weight).

    >>> dense_seam(("wq", "wk")).name
    'wq+wk'
    """
    return Seam(name or "+".join(weights), "dense", tuple(weights)).replace(**fields)


def qkv_seam(name: str = "qkv", **fields) -> Seam:
    """The attention input projections ``wq, wk, wv`` as one seam.

    >>> qkv_seam().weights
    ('wq', 'wk', 'wv')
    """
    return dense_seam(("wq", "wk", "wv"), name, **fields)


def out_proj_seam(name: str = "o", **fields) -> Seam:
    """The attention output projection ``wo``.

    >>> out_proj_seam().weights
    ('wo',)
    """
    return dense_seam(("wo",), name, **fields)


class FrozenParams(NamedTuple):
    """Params with weights quantized once (`freeze`): ``hp`` (for the fallback)
    and ``fp8``, a `FrozenWeight` per GEMM.

    >>> FrozenParams({}, ())._fields
    ('hp', 'fp8')
    """

    hp: dict
    fp8: tuple


def _hp_params(params):
    return params.hp if isinstance(params, FrozenParams) else params


def seam_dims(seam: Seam, params: Any) -> Dict[str, Any]:
    """``params`` checked against ``seam``: swiglu ``{'D', 'F'}``, dense ``{'K', 'N': (N_1, ...)}``.

    ValueError lists missing weights or shapes that do not fit.

    >>> seam_dims(out_proj_seam(), {"wo": jnp.zeros((4, 8))})
    {'K': 8, 'N': (4,)}
    """
    params = _hp_params(params)
    if not isinstance(params, dict):
        raise ValueError(f"seam {seam.name!r} params must be a dict of weights, got {type(params).__name__}")
    missing = [n for n in seam.weights if n not in params]
    if missing:
        raise ValueError(f"seam {seam.name!r}: params lack {missing} (have {sorted(params)})")
    shapes = {n: tuple(params[n].shape) for n in seam.weights}
    bad = [f"{n}: {s}" for n, s in shapes.items() if len(s) != 2]
    if bad:
        raise ValueError(f"seam {seam.name!r}: weights must be 2-D (out, in): {', '.join(bad)}")
    if seam.kind == "swiglu":
        (f, d), (f2, d2), (d3, f3) = shapes["w_gate"], shapes["w_up"], shapes["w_down"]
        if not (f == f2 == f3 and d == d2 == d3):
            raise ValueError(f"seam {seam.name!r}: SwiGLU weights do not fit together: {shapes} "
                             "(expected w_gate, w_up (F, D) and w_down (D, F))")
        return {"D": d, "F": f}
    if len({s[1] for s in shapes.values()}) != 1:
        raise ValueError(f"seam {seam.name!r}: fused linears must share the input width, got {shapes}")
    return {"K": shapes[seam.weights[0]][1], "N": tuple(shapes[n][0] for n in seam.weights)}


def _widths(seam: Seam, params: Any) -> Tuple[int, int]:
    d = seam_dims(seam, params)
    return (d["D"], d["D"]) if seam.kind == "swiglu" else (d["K"], sum(d["N"]))


def _split_output(seam: Seam, params: Any, y: jax.Array):
    """A dense seam's fused output split per weight (one array for one weight)."""
    if seam.kind == "swiglu" or len(seam.weights) == 1:
        return y
    return tuple(jnp.split(y, np.cumsum(seam_dims(seam, params)["N"])[:-1].tolist(), axis=-1))


def high_precision(seam: Seam, params: Any, x: jax.Array) -> jax.Array:
    """The seam's computation as the plain block does it (the fallback and the
    gate's reference), fused for dense seams, in ``x``'s dtype.

    >>> high_precision(out_proj_seam(), {"wo": jnp.eye(2)}, jnp.ones((1, 2)))
    Array([[1., 1.]], dtype=float32)
    """
    params = _hp_params(params)
    if seam.kind == "swiglu":
        return swiglu(params, x).astype(x.dtype)
    outs = [linear(x, params[n]) for n in seam.weights]
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)).astype(x.dtype)


def _groups(seam: Seam, params: dict):
    if seam.kind == "swiglu":
        return ((params["w_gate"], params["w_up"]), (params["w_down"],))
    return (tuple(params[n] for n in seam.weights),)


def weight_scales_of(seam: Seam, params: Any) -> jax.Array:
    """float32 ``(gemms,)``: each GEMM's per-tensor e4m3 scale ``amax / 448`` now.

    >>> weight_scales_of(out_proj_seam(), {"wo": jnp.full((2, 2), 4.48)})
    Array([0.01], dtype=float32)
    """
    seam_dims(seam, params)
    return jnp.stack([scale_from_amax(weight_amax(g)) for g in _groups(seam, _hp_params(params))])


def freeze(seam: Seam, params: dict) -> FrozenParams:
    """Quantize a seam's weights once, per output channel (inference).

    >>> freeze(out_proj_seam(), {"wo": jnp.ones((2, 2))}).fp8[0].q.dtype == E4M3
    True
    """
    seam_dims(seam, params)
    return FrozenParams(params, tuple(quantize_weight(g) for g in _groups(seam, params)))


def _sources(seam: Seam, params: Any, weight_scales, cast):
    """The weight source of each GEMM (`fp8_linear`'s ``w``)."""
    if isinstance(params, FrozenParams):
        return params.fp8
    groups = _groups(seam, params)
    if seam.recipe.weight == "channel":
        return [LiveWeight(g) for g in groups]
    if cast is None:
        return [LiveWeight(g, weight_scales[i]) for i, g in enumerate(groups)]
    return [CastWeight(g, cast.q[i], weight_scales[i], cast.amax[i]) for i, g in enumerate(groups)]


def _check_cast(seam: Seam, params: Any, cast: Any) -> None:
    if seam.recipe.weight != "delayed":
        raise ValueError(f"seam {seam.name!r}: weights cast to fp8 (cast_weights) need weight='delayed', "
                         f"got {seam.recipe.weight!r}")
    if not isinstance(cast, st.CastWeights):
        raise ValueError(f"seam {seam.name!r}: the state's cast must be CastWeights, got {type(cast).__name__}")
    if isinstance(params, FrozenParams):
        return
    want = [(sum(w.shape[0] for w in g), g[0].shape[1]) for g in _groups(seam, params)]
    got = [tuple(q.shape) for q in cast.q]
    if got != want or any(q.dtype != E4M3 for q in cast.q) or tuple(cast.amax.shape) != (len(want),):
        raise ValueError(f"seam {seam.name!r}: cast weights {got} ({[str(q.dtype) for q in cast.q]}), amax "
                         f"{tuple(cast.amax.shape)} do not fit its weights {want} (float8_e4m3fn; amax "
                         f"({len(want)},)): cast them from these params with cast_weights")


def _run(seam: Seam, srcs, x2, scales, grad_scales=None, observers=None):
    """The fp8 computation on 2-D ``x2``: ``(y, hidden or None)``."""
    r = seam.recipe

    def gemm(i, h):
        xs = jax.lax.stop_gradient(scale_from_amax(row_amax(h), E4M3, r.margin)) if r.activation == "row" \
            else scales[i]
        gs = grad_scales[i] if r.gradient == "delayed" and grad_scales is not None else None
        ob = None if observers is None else jax.tree_util.tree_map(lambda a: a[i], observers)
        return fp8_linear(h, srcs[i], xs, grad_scale=gs, observer=ob, fast_accum=(r.fast_accum_fwd, r.fast_accum_bwd))

    a = gemm(0, x2)
    if seam.kind == "dense":
        return a, None
    f = a.shape[-1] // 2  # silu and the product in float32, inside the fusion that quantizes the hidden
    hidden = (jax.nn.silu(a[:, :f].astype(jnp.float32)) * a[:, f:].astype(jnp.float32)).astype(x2.dtype)
    return gemm(1, hidden), hidden


def fp8_forward(seam: Seam, params: Any, x: jax.Array, scales: Any, weight_scales: Any = None,
                cast: Optional[st.CastWeights] = None) -> jax.Array:
    """The unguarded, uncounted fp8 computation on ``x`` (any leading axes; fused
    output; current gradient scaling). Delayed weights default to `weight_scales_of`.

    >>> seam = out_proj_seam()
    >>> fp8_forward(seam, {"wo": 3.5 * jnp.eye(2)}, jnp.ones((1, 2)), [2.0 ** -8]).tolist()
    [[3.5, 3.5]]
    """
    if cast is not None:
        _check_cast(seam, params, cast)
        if weight_scales is None:
            raise ValueError(f"seam {seam.name!r}: cast weights without the weight_scales they were cast at")
    if seam.recipe.weight == "delayed" and weight_scales is None and not isinstance(params, FrozenParams):
        weight_scales = jax.lax.stop_gradient(weight_scales_of(seam, params))
    y = _run(seam, _sources(seam, params, weight_scales, cast), x.reshape(-1, x.shape[-1]),
             jnp.asarray(scales, jnp.float32))[0]
    return y.reshape(x.shape[:-1] + (y.shape[-1],))


def init_state(seam: Seam, scales: Any = None, params: Any = None) -> SeamState:
    """A fresh state: activation ``scales`` (default ones) and the weights'
    per-tensor scales from ``params`` (required by delayed weights).

    >>> init_state(ffn_seam(), [0.01, 0.02]).scales.shape
    (2,)
    """
    if scales is not None and np.shape(scales) != (seam.points,):
        raise ValueError(f"seam {seam.name!r} needs {seam.points} scale(s), got shape {np.shape(scales)}")
    if params is None and seam.recipe.weight == "delayed":
        raise ValueError(f"seam {seam.name!r} has weight='delayed': its state starts from the weights' scales; "
                         "pass params=")
    ws = None if params is None else np.asarray(weight_scales_of(seam, params))
    return st.new_state(seam.points, seam.gemms, scales, ws)


def cast_weights(seam: Seam, state: SeamState, params: Any) -> SeamState:
    """``state`` with ``params``' weights cast to e4m3 once at its delayed scales:
    the step's calls (a reconstruct step runs each block twice) read the bytes,
    bit for bit the uncast results for these ``params``. `fold` drops them.
    One layer's state; ValueError for other weights, frozen or unfit params.

    >>> seam = out_proj_seam(weight="delayed")
    >>> p = {"wo": jnp.ones((2, 2))}
    >>> cast_weights(seam, init_state(seam, params=p), p).cast.q[0].shape
    (2, 2)
    """
    if seam.recipe.weight != "delayed":
        raise ValueError(f"seam {seam.name!r}: cast_weights needs weight='delayed' (the bytes carry the delayed "
                         f"per-tensor scales), got {seam.recipe.weight!r}")
    if isinstance(params, FrozenParams):
        raise ValueError(f"seam {seam.name!r}: frozen params are quantized already; cast_weights takes live weights")
    seam_dims(seam, params)
    if state.weight_scales.shape != (seam.gemms,):
        raise ValueError(f"seam {seam.name!r}: cast_weights takes one layer's state (weight_scales ({seam.gemms},)), "
                         f"got weight_scales of shape {state.weight_scales.shape}")
    casts = [cast_weight(g, state.weight_scales[i]) for i, g in enumerate(_groups(seam, params))]
    return state._replace(cast=st.CastWeights(tuple(c.q for c in casts), jnp.stack([c.amax for c in casts])))


def amax_points(seam: Seam, params: Any, x: jax.Array) -> jax.Array:
    """float32 ``(points,)`` amax at the quantization points, in high precision.

    >>> amax_points(out_proj_seam(), {"wo": jnp.eye(2)}, jnp.array([[1.0, -3.0]]))
    Array([3.], dtype=float32)
    """
    params = _hp_params(params)
    a_in = jnp.max(st.magnitude(x))
    if seam.kind == "dense":
        return a_in[None]
    g, u = (linear(x, params[n]).astype(jnp.float32) for n in ("w_gate", "w_up"))
    return jnp.stack([a_in, jnp.max(st.magnitude(jax.nn.silu(g) * u))])


def cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine similarity of two arrays flattened, in float32 (1 for two zeros).

    >>> float(cosine(jnp.ones(3), 2 * jnp.ones(3)))
    1.0
    """
    a, b = a.astype(jnp.float32).reshape(-1), b.astype(jnp.float32).reshape(-1)
    na, nb = jnp.sqrt(jnp.sum(a * a)), jnp.sqrt(jnp.sum(b * b))
    return jnp.where((na == 0) & (nb == 0), 1.0, jnp.sum(a * b) / jnp.maximum(na * nb, 1e-30))


# ---------------------------------------------------------------------- guarded calls
class _Attempt(NamedTuple):  # code: -1, or the REASONS index to fall back for
    y: jax.Array
    code: jax.Array
    amax: jax.Array
    trace_reason: Optional[int]


def _check_state(seam: Seam, state: Any) -> None:
    """Refuse a state that is not one instance of this seam's (ValueError naming
    the field; a stacked per-layer state is named as such)."""
    if not isinstance(state, SeamState):
        raise ValueError(f"seam {seam.name!r}: expected its SeamState, got {type(state).__name__}")
    for field, shape in (("scales", (seam.points,)), ("grad_scales", (seam.gemms,)), ("weight_scales", (seam.gemms,))):
        got = tuple(jnp.shape(getattr(state, field)))
        if got != shape:
            lead = got[:len(got) - len(shape)]
            hint = (f"; this is a stacked state with leading axes {lead}: give one call one instance (e.g. "
                    "tree_map(lambda a: a[i], state)), or run the layers through lax.scan / eae_jax.reconstruct"
                    ) if len(got) > len(shape) and got[len(lead):] == shape else ""
            raise ValueError(f"seam {seam.name!r}: state.{field} has shape {got}, expected {shape}{hint}")


def _attempt(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor=None) -> _Attempt:
    """The fp8 path with its checks, not falling back. Trace-time problems trace
    the high-precision path (strict: `GuardRefused`); value problems only set
    ``code``: the checks reduce the values being quantized (XLA fuses them)
    and the caller's one cond decides."""
    g = seam.guard
    width = _widths(seam, params)[0]
    try:
        problem = st.trace_check(seam.contract, x, width)
    except GuardRefused as err:
        raise GuardRefused(f"eae_jax.fp8: seam {seam.name!r}: {err}") from None
    no_fallback = jnp.int32(-1)
    if problem is not None:
        if g.strict:
            raise GuardRefused(f"eae_jax.fp8: seam {seam.name!r} refused at trace time (strict): {problem[0]}: "
                               f"{problem[1]}")
        if monitor is not None:
            monitor.trace_fallback(seam.name, *problem)
        return _Attempt(high_precision(seam, params, x), jnp.int32(st.reason_index(problem[0])),
                       jnp.zeros((seam.points,), jnp.float32), st.reason_index(problem[0]))
    if state.cast is not None:
        _check_cast(seam, params, state.cast)
    static = seam.recipe.activation != "row"
    scales = state.scales.astype(jnp.float32)
    x2 = x.reshape(-1, width)
    amax_in, sat_in = st.value_stats(x2, scales[0] if static else None)
    y2, hidden = _run(seam, _sources(seam, params, state.weight_scales, state.cast), x2, scales, state.grad_scales,
                      state.observed.gemm)
    amax = amax_in[None]
    code = jnp.where(sat_in > g.saturation_threshold, st.reason_index("saturation"), -1)
    if hidden is not None:
        amax_h, sat_h = st.value_stats(hidden, scales[1] if static else None)
        amax = jnp.stack([amax_in, amax_h])
        if g.check_hidden:
            code = jnp.where((code < 0) & (sat_h > g.saturation_threshold), st.reason_index("hidden_saturation"), code)
    y8 = y2.reshape(x.shape[:-1] + (y2.shape[-1],))
    if not g.check_values:
        return _Attempt(y8, no_fallback, amax, None)
    code = jnp.where(~jnp.isfinite(amax_in), st.reason_index("nonfinite"), code).astype(jnp.int32)
    if g.strict:  # nothing falls back: the call ran fp8 or the host raises
        st.strict_check(seam.name, code)
        return _Attempt(y8, no_fallback, amax, None)
    return _Attempt(y8, jnp.where(state.ledger.detached > 0, st.reason_index("detached"), code).astype(jnp.int32),
                   amax, None)


def _can_fall_back(seam: Seam) -> bool:
    """Whether a seam's attempt can ask for a fallback in the graph."""
    return seam.guard.check_values and not seam.guard.strict


def _decide_once(attempt_fn, high_precision_fn):
    """``f(params, x, states) -> (y, aux)`` deciding once forward and once
    backward: ``y = y8`` of ``attempt_fn(params, x, states) -> (y8, (bad,
    aux))`` unless ``bad`` (None: nothing to decide), else
    ``high_precision_fn(params, x)``. The backward runs the attempt's VJP
    outside any cond (a cond materialises its operands) and one cond swaps in
    the fallback's; a reconstruct recomputation's cond is then dead code. A
    fallen-back attempt's observations are dropped."""

    def select(bad, y8, params, x):
        if bad is None:
            return y8
        return jax.lax.cond(bad, lambda ops: high_precision_fn(*ops[1:]), lambda ops: ops[0], (y8, params, x))

    @jax.custom_vjp
    def run(params, x, states):
        y8, (bad, aux) = attempt_fn(params, x, states)
        return select(bad, y8, params, x), aux

    def fwd(params, x, states):
        y8, vjp8, (bad, aux) = jax.vjp(attempt_fn, params, x, states, has_aux=True)
        return (select(bad, y8, params, x), aux), (vjp8, bad, params, x)

    def bwd(res, cts):
        vjp8, bad, params, x = res
        gp, gx, gstates = vjp8(cts[0])  # a failed attempt's VJP may be NaN: the cond discards it
        if bad is not None:
            gp, gx = jax.lax.cond(bad, lambda ops: jax.vjp(high_precision_fn, ops[1], ops[2])[1](ops[3]),
                                  lambda ops: ops[0], ((gp, gx), params, x, cts[0]))
            gstates = jax.tree_util.tree_map(lambda a: jnp.where(bad, jnp.zeros_like(a), a), gstates)
        return gp, gx, gstates

    run.defvjp(fwd, bwd)
    return run


def _guarded(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor):
    """``(fused output, (call counts, amax))`` of one guarded call."""
    def attempt_fn(p, h, s):
        a = _attempt(seam, s, p, h, monitor)
        bad = None if a.trace_reason is not None or not _can_fall_back(seam) else a.code >= 0
        return a.y, (bad, (st._call_counts(a.code), a.amax))

    if not _can_fall_back(seam):
        y, (_, aux) = attempt_fn(params, x, state)
        return y, aux
    return _decide_once(attempt_fn, functools.partial(high_precision, seam))(params, x, state)


def _report_call(y: jax.Array, state: SeamState, aux) -> jax.Array:
    """``y``, reporting one call's ``(counts, amax)`` through ``state``'s handles."""
    counts, amax = aux
    return obs_lib.observe(obs_lib.observe(y, state.observed.counts, counts), state.observed.act, amax)


def apply(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor=None):
    """Guarded, counted call (differentiate with respect to ``state`` too and
    `fold_state` its cotangent): swiglu ``(..., D)``, dense a tuple of
    ``(..., N_i)`` (one array for one weight), in ``x.dtype``. `GuardRefused`
    for a wrong width or non-float input (strict: any trace-time problem).

    >>> seam, p = out_proj_seam(), {"wo": 3.5 * jnp.eye(2)}
    >>> apply(seam, init_state(seam, [2.0 ** -8]), p, jnp.ones((1, 2))).tolist()
    [[3.5, 3.5]]
    """
    _check_state(seam, state)
    y, aux = _guarded(seam, state, params, x, monitor)
    return _split_output(seam, params, _report_call(y, state, aux))


def _observed_of(state: SeamState, aux) -> st.Observed:
    """The `Observed` cotangent of one call's ``(counts, amax)`` without a backward."""
    counts, amax = aux
    o = state.observed
    return st.Observed(obs_lib.emit(o.counts, counts), obs_lib.emit(o.act, amax), obs_lib.silent(o.gemm))


def apply_with_ledger(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor=None):
    """Like `apply`, returning ``(y, observations)`` (an `Observed` cotangent
    for `fold_state`) for inference without a VJP.

    >>> seam, p = out_proj_seam(), {"wo": jnp.eye(2)}
    >>> s = init_state(seam, [1 / 448])
    >>> fold_state(seam, s, apply_with_ledger(seam, s, p, jnp.ones((1, 2)))[1]).ledger.fp8_calls
    Array(1., dtype=float32)
    """
    _check_state(seam, state)
    y, aux = _guarded(seam, state, params, x, monitor)
    return _split_output(seam, params, y), _observed_of(state, aux)


def fold_state(seam: Seam, state: SeamState, cot: Any) -> SeamState:
    """``state`` after one step: ``cot`` is its cotangent (or an `Observed`);
    see `eae_jax.fp8.state.fold` for the rules.

    >>> seam = out_proj_seam()
    >>> s = init_state(seam)
    >>> fold_state(seam, s, s).ledger.calls
    Array(0., dtype=float32)
    """
    return st.fold(seam.recipe, seam.guard.detach_after, state, st.observations(state, cot))
