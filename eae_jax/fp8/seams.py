"""fp8 seams: replaceable GEMM regions of a block, bound to static scales.

A `Seam` names a region and the weights it multiplies:

* `ffn_seam`: the SwiGLU FFN ``down(silu(gate(x)) * up(x))``, two
  quantization points (its input; the down-projection input). Gate and up
  run as one fused GEMM on the concatenated ``(2F, D)`` weight.
* `dense_seam`: one or more linears sharing their input, fused into one
  GEMM — `qkv_seam` (``wq, wk, wv``) and `out_proj_seam` (``wo``) are the
  attention projections. One quantization point.

`bind` measures the amax at each quantization point on calibration inputs
(the activations the seam really sees), reduces it across samples at a
percentile, derives the static e4m3 scales ``amax / 448``, and gates the
fp8 version against the high-precision one: the cosine on every calibration
sample (at the block boundary, residual included, when residuals are
given) must reach ``gate_cos`` (0.999), else `GateRefused` names the worst.
The `BoundSeam` carries a `Certification` record and its initial state.

A bound seam is called with ``(state, params, x)``: the state (`SeamState`:
scales and `Ledger`) is data, so it can be stacked over layers, scanned and
carried through ``jit``. Calls are guarded (`eae_jax.fp8.guards`) and
counted (`eae_jax.fp8.ledger`).

Activation scaling modes (`SeamConfig.act_scaling`):

* ``'static'``: the calibrated scales, forever; saturation is guarded.
* ``'delayed'``: start from the calibrated scales; `BoundSeam.fold`
  replaces them each step by the amax the step observed (for training,
  where activations drift).
* ``'row'``: a scale per row computed from the row's amax in the graph
  (cannot saturate; the calibrated scales are recorded, not used).

Weight scaling (`SeamConfig.weight_scaling`): per output channel from the
live weight (``'channel'``), per tensor from the live weight (``'tensor'``),
or per tensor from the amax observed in the previous step (``'delayed'``,
kept in `SeamState.weight_scales`; `bind` starts them from the weights). A
frozen `FrozenParams` weight is quantized once, per channel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.blocks.linear import linear
from eae_jax.blocks.swiglu import swiglu
from eae_jax.fp8 import ledger as ledger_lib
from eae_jax.dtypes import parse_compute_dtype
from eae_jax.fp8.guards import Contract, GuardRefused, magnitude, platform_names, trace_check, value_stats
from eae_jax.fp8.quant import (
    E4M3,
    E5M2,
    WEIGHT_SCALINGS,
    Fp8Weight,
    cast_weight,
    weight_amax,
    fp8_linear,
    fp8_max,
    quantize_weight_blocks,
    row_amax,
    scale_from_amax,
)

SCALINGS = ("static", "delayed", "row")
GRAD_SCALINGS = ("current", "delayed")
KINDS = ("swiglu", "dense")


class GateRefused(RuntimeError):
    """The bound fp8 seam missed its parity gate; ``worst`` holds the worst cosine."""

    def __init__(self, message: str, worst: float):
        super().__init__(message)
        self.worst = worst


@dataclasses.dataclass(frozen=True)
class SeamConfig:
    """How a seam quantizes, guards and gates.

    Attributes:
      act_scaling: ``'static'``, ``'delayed'`` or ``'row'`` (module docstring).
      margin: headroom of the activation scales, in powers of two.
      saturation_threshold: fall back when more than this fraction of a
        point's elements lies beyond the fp8 range after scaling.
      check_values: run the in-graph checks (non-finite, saturation,
        detached) and fall back through ``lax.cond``. False: trace-time
        checks only, fp8 always (no cond, no detaching). On a GPU each cond
        reads its predicate back to the host: a reconstruct train step pays
        3 per seam and layer (forward, recomputation, transposed cond),
        measured at 12.7 ms of a 93 ms medium step on the H200. A block
        can decide once per call instead (`eae_jax.fp8.fp8_block` with
        ``fallback='block'``).
      check_hidden: also check saturation at the FFN's down-projection input
        (static/delayed scaling), falling back for the whole call.
      strict: raise `GuardRefused` instead of falling back (trace-time
        problems at trace time; value problems from a host callback).
      detach_after: consecutive fallbacks after which the seam detaches for
        good (None/0: never).
      dtypes, min_rows, max_rows, platforms, min_compute_capability: the
        trace-time contract (`eae_jax.fp8.guards.Contract`).
      gate_cos: the parity gate's cosine threshold (0 disables the gate).
      fast_accum_fwd, fast_accum_bwd: let the forward / gradient GEMMs use
        cuBLASLt's fp8 fast accumulation (`eae_jax.fp8.quant.fp8_matmul`;
        no effect off GPU). The gradient GEMMs default to float32-promoted
        accumulation: their contractions run over every token.
      grad_scaling: how each GEMM's output gradient gets its e5m2 scale.
        ``'current'``: from that gradient's own amax (a reduction over the
        whole gradient that its quantization has to wait for).
        ``'delayed'``: from the amax observed at the same GEMM in the
        previous step (`SeamState.grad_scales`, updated by `fold_state`),
        so reduction and quantization can share one pass. Needs observed
        scales: run a step with ``'current'`` first (observations are
        recorded in either mode); `require_grad_scales` checks.
      grad_margin: headroom of delayed gradient scales, in powers of two
        (a gradient that grew by more than that since the last step
        saturates; `fold_state` counts it in ``grad_clipped``).
      weight_scaling: ``'channel'`` (one e4m3 scale per output channel of
        each live weight), ``'tensor'`` (one per weight: a cheaper
        quantization, a scalar output scale, and dgrad reads the forward's
        fp8 weight transposed; see `eae_jax.fp8.quant`) or ``'delayed'``
        (one per weight, from the weight amax observed in the previous step,
        `SeamState.weight_scales`: the quantization no longer waits for a
        reduction over the weight; a weight that grew past the scale's range
        saturates and `fold_state` counts it in ``weight_clipped``). Frozen
        weights (`freeze`) are quantized per channel in every mode.
    """

    act_scaling: str = "static"
    margin: float = 0.0
    saturation_threshold: float = 1e-3
    check_values: bool = True
    check_hidden: bool = True
    strict: bool = False
    detach_after: Optional[int] = 32
    dtypes: Tuple[Any, ...] = ("bf16", "fp16", "fp32")
    min_rows: int = 1
    max_rows: Optional[int] = None
    platforms: Optional[Tuple[str, ...]] = None
    min_compute_capability: float = 8.9
    gate_cos: float = 0.999
    fast_accum_fwd: bool = True
    fast_accum_bwd: bool = False
    grad_scaling: str = "current"
    grad_margin: float = 2.0
    weight_scaling: str = "channel"

    def __post_init__(self):
        if self.act_scaling not in SCALINGS:
            raise ValueError(f"unknown act_scaling {self.act_scaling!r}; expected one of {SCALINGS}")
        if self.grad_scaling not in GRAD_SCALINGS:
            raise ValueError(f"unknown grad_scaling {self.grad_scaling!r}; expected one of {GRAD_SCALINGS}")
        if self.weight_scaling not in WEIGHT_SCALINGS:
            raise ValueError(f"unknown weight_scaling {self.weight_scaling!r}; expected one of {WEIGHT_SCALINGS}")
        if not 0.0 <= self.grad_margin <= 16.0:
            raise ValueError(f"grad_margin must be in [0, 16] binades, got {self.grad_margin}")
        # NaN fails both comparisons; past 16 binades the scale leaves no fp8 precision at all.
        if not -16.0 <= self.margin <= 16.0:
            raise ValueError(f"margin must be in [-16, 16] binades, got {self.margin}")
        if self.min_rows < 0 or (self.max_rows is not None and self.max_rows < max(self.min_rows, 1)):
            raise ValueError(f"bad row bounds: min_rows={self.min_rows}, max_rows={self.max_rows} "
                             "(need 0 <= min_rows <= max_rows, max_rows >= 1)")
        if not 0.0 <= self.saturation_threshold < 1.0:
            raise ValueError(f"saturation_threshold must be in [0, 1), got {self.saturation_threshold}")
        if not 0.0 <= self.gate_cos <= 1.0:
            raise ValueError(f"gate_cos must be in [0, 1], got {self.gate_cos}")
        if self.detach_after is not None and self.detach_after < 0:
            raise ValueError(f"detach_after must be >= 0 or None, got {self.detach_after}")
        if isinstance(self.dtypes, str):  # one name, not its characters
            object.__setattr__(self, "dtypes", (self.dtypes,))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        try:  # validated now, not at the first call
            for d in self.dtypes:
                parse_compute_dtype(d)
        except ValueError as err:
            raise ValueError(f"SeamConfig dtypes: {err}") from err
        object.__setattr__(self, "platforms", platform_names(self.platforms))  # 'gpu' is one name


@dataclasses.dataclass(frozen=True)
class Seam:
    """A named, replaceable GEMM region (static description, no arrays).

    Attributes:
      name: used in ledgers, warnings and errors.
      kind: ``'swiglu'`` or ``'dense'``.
      weights: the param names it reads (``w_gate, w_up, w_down`` for
        swiglu; the fused linears for dense, in output order).
      config: a `SeamConfig`.
    """

    name: str
    kind: str
    weights: Tuple[str, ...]
    config: SeamConfig = SeamConfig()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown seam kind {self.kind!r}; expected one of {KINDS}")
        if not self.weights:
            raise ValueError("a seam needs at least one weight")
        object.__setattr__(self, "weights", tuple(self.weights))

    @property
    def points(self) -> int:
        """Number of activation quantization points (2 for swiglu, 1 for dense)."""
        return 2 if self.kind == "swiglu" else 1

    @property
    def gemms(self) -> int:
        """Number of fused GEMMs, each with an output gradient to scale (2 for
        swiglu: gate|up and down; 1 for dense)."""
        return 2 if self.kind == "swiglu" else 1

    def replace(self, **changes) -> "Seam":
        """A copy with fields (or config fields, by name) changed."""
        cfg_fields = {f.name for f in dataclasses.fields(SeamConfig)}
        cfg = {k: v for k, v in changes.items() if k in cfg_fields}
        own = {k: v for k, v in changes.items() if k not in cfg_fields}
        if cfg:
            own["config"] = dataclasses.replace(own.get("config", self.config), **cfg)
        return dataclasses.replace(self, **own)


def ffn_seam(name: str = "ffn", config: Optional[SeamConfig] = None, **config_fields) -> Seam:
    """The SwiGLU FFN seam over params ``{'w_gate': (F, D), 'w_up': (F, D), 'w_down': (D, F)}``."""
    return Seam(name, "swiglu", ("w_gate", "w_up", "w_down"), _config(config, config_fields))


def dense_seam(weights: Sequence[str], name: Optional[str] = None, config: Optional[SeamConfig] = None,
               **config_fields) -> Seam:
    """Linears ``x @ w.T`` sharing one input, fused into one fp8 GEMM.

    Args:
      weights: param names, each an ``(N_i, K)`` weight; the seam returns a
        tuple of outputs in this order (one array for a single weight).
    """
    return Seam(name or "+".join(weights), "dense", tuple(weights), _config(config, config_fields))


def qkv_seam(name: str = "qkv", config: Optional[SeamConfig] = None, **config_fields) -> Seam:
    """The attention input projections ``wq, wk, wv`` as one seam."""
    return dense_seam(("wq", "wk", "wv"), name, config, **config_fields)


def out_proj_seam(name: str = "o", config: Optional[SeamConfig] = None, **config_fields) -> Seam:
    """The attention output projection ``wo``."""
    return dense_seam(("wo",), name, config, **config_fields)


def _config(config, fields):
    config = config or SeamConfig()
    return dataclasses.replace(config, **fields) if fields else config


class SeamState(NamedTuple):
    """A seam's arrays (any leading axes, e.g. one per layer).

    Attributes:
      scales: ``(points,)`` float32 activation scales.
      ledger: its `Ledger`.
      grad_scales: ``(gemms,)`` float32 e5m2 scales of each GEMM's output
        gradient from the amax last observed there (0: never observed).
        Delayed gradient scaling quantizes with them; in either mode the
        backward's observation leaves as their cotangent and `fold_state`
        turns it into the next scales. None: no observation (a state made
        before gradient scales existed; current scaling only).
      grad_clipped: ``(gemms,)`` float32: steps in which a delayed-scaled
        gradient exceeded its scale's range (its largest values saturated).
      weight_scales: ``(gemms,)`` float32 per-tensor e4m3 scales of each
        GEMM's weight, from the weight amax last observed (delayed weight
        scaling only; None otherwise, so the states of the other modes keep
        their shape and their checkpoints).
      weight_clipped: ``(gemms,)`` float32: steps in which a weight had
        outgrown its delayed scale (its largest values saturated).
      weight_cast: None, or the step's weights cast to fp8 once
        (`cast_weights`, delayed weight scaling): every call of the step
        reads them instead of quantizing its weights. They belong to one
        step and one set of weights: `fold_state` drops them.
    """

    scales: jax.Array
    ledger: ledger_lib.Ledger
    grad_scales: Optional[jax.Array] = None
    grad_clipped: Optional[jax.Array] = None
    weight_scales: Optional[jax.Array] = None
    weight_clipped: Optional[jax.Array] = None
    weight_cast: Optional["CastWeights"] = None


class CastWeights(NamedTuple):
    """A seam's weights cast to e4m3 once for a step (`cast_weights`).

    Attributes:
      q: one ``(N_i, K_i)`` float8_e4m3fn array per fused GEMM (swiglu:
        gate|up, down; dense: the concatenation), quantized at the state's
        delayed ``weight_scales`` (any leading axes, like the state's).
      amax: ``(gemms,)`` float32: each weight's amax, observed by the cast;
        a differentiated call hands it out as ``weight_scales``' cotangent,
        as an uncast delayed call does with the amax it observes.
    """

    q: Tuple[jax.Array, ...]
    amax: jax.Array


class FrozenParams(NamedTuple):
    """Params with their fp8 weights quantized once (inference).

    Attributes:
      hp: the high-precision params (the fallback path needs them).
      fp8: one `Fp8Weight` per fused GEMM (swiglu: gate|up, down; dense: one).
    """

    hp: dict
    fp8: tuple


def init_state(seam: Seam, scales: Any = None, params: Any = None) -> SeamState:
    """A state with the given activation scales (default ones), a zeroed
    ledger, unobserved gradient scales and, for ``weight_scaling='delayed'``,
    weight scales from ``params``' current weights (`weight_scales_of`).

    Raises:
      ValueError: scales of the wrong shape; delayed weight scaling without
        ``params``.
    """
    if scales is None:
        scales = jnp.ones((seam.points,), jnp.float32)
    scales = jnp.asarray(scales, jnp.float32)
    if scales.shape != (seam.points,):
        raise ValueError(f"seam {seam.name!r} needs {seam.points} scale(s), got shape {scales.shape}")
    zeros = jnp.zeros((seam.gemms,), jnp.float32)
    if seam.config.weight_scaling != "delayed":
        return SeamState(scales, ledger_lib.init_ledger(seam.points), zeros, zeros)
    if params is None:
        raise ValueError(f"seam {seam.name!r} has weight_scaling='delayed': its state starts from the weights' "
                         "scales; pass params=")
    return SeamState(scales, ledger_lib.init_ledger(seam.points), zeros, zeros, weight_scales_of(seam, params), zeros)


def weight_scales_of(seam: Seam, params: Any) -> jax.Array:
    """float32 ``(gemms,)``: the per-tensor e4m3 scale (``amax / 448``) of each
    fused GEMM's weight (swiglu: gate|up, down; dense: the concatenation),
    from ``params`` as they are now (high-precision weights of a
    `FrozenParams`).

    Raises:
      ValueError: params that do not fit the seam.
    """
    seam_dims(seam, params)
    hp = params.hp if isinstance(params, FrozenParams) else params
    groups = _groups(seam, hp)
    return jnp.stack([scale_from_amax(weight_amax(g), E4M3) for g in groups])


# ---------------------------------------------------------------------- shapes
def seam_dims(seam: Seam, params: Any) -> Dict[str, Any]:
    """Check ``params`` against the seam and return its dims.

    Returns:
      swiglu: ``{'D': D, 'F': F}``; dense: ``{'K': K, 'N': (N_1, ...)}``.

    Raises:
      ValueError: a missing weight or a shape that does not fit, all listed.
    """
    if isinstance(params, FrozenParams):
        params = params.hp
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
    ks = {s[1] for s in shapes.values()}
    if len(ks) != 1:
        raise ValueError(f"seam {seam.name!r}: fused linears must share the input width, got {shapes}")
    return {"K": ks.pop(), "N": tuple(shapes[n][0] for n in seam.weights)}


def input_width(seam: Seam, params: Any) -> int:
    dims = seam_dims(seam, params)
    return dims["D"] if seam.kind == "swiglu" else dims["K"]


def output_width(seam: Seam, params: Any) -> int:
    dims = seam_dims(seam, params)
    return dims["D"] if seam.kind == "swiglu" else sum(dims["N"])


def split_output(seam: Seam, params: Any, y: jax.Array):
    """Fused dense output -> tuple per weight (one array for a single weight)."""
    if seam.kind == "swiglu":
        return y
    ns = seam_dims(seam, params)["N"]
    if len(ns) == 1:
        return y
    cuts = np.cumsum(ns)[:-1].tolist()
    return tuple(jnp.split(y, cuts, axis=-1))


# ---------------------------------------------------------------------- math
def high_precision(seam: Seam, params: Any, x: jax.Array) -> jax.Array:
    """The seam's original computation (fused output for dense seams), in ``x``'s dtype.

    This is the fallback path and the gate's reference: `swiglu`, or
    `linear` per weight, exactly as the plain block computes them.
    """
    if isinstance(params, FrozenParams):
        params = params.hp
    if seam.kind == "swiglu":
        y = swiglu(params, x)
    else:
        outs = [linear(x, params[n]) for n in seam.weights]
        y = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
    return y.astype(x.dtype)


def _groups(seam: Seam, params: Any):
    """The weights of each fused GEMM: frozen `Fp8Weight`s, or live weights as
    tuples of row blocks (`fp8_linear` quantizes them apart and joins only
    the fp8 bytes, so no high-precision concatenation is materialised)."""
    if isinstance(params, FrozenParams):
        return params.fp8
    if seam.kind == "swiglu":
        return ((params["w_gate"], params["w_up"]), (params["w_down"],))
    return (tuple(params[n] for n in seam.weights),)


def freeze(seam: Seam, params: dict) -> FrozenParams:
    """Quantize a seam's weights once (per output channel) for inference."""
    seam_dims(seam, params)
    groups = _groups(seam, params)
    return FrozenParams(params, tuple(quantize_weight_blocks(g) for g in groups))


def _act_scale(seam: Seam, x2: jax.Array, static_scale: jax.Array) -> jax.Array:
    if seam.config.act_scaling == "row":
        # Per-row dynamic scale; a constant as far as differentiation goes.
        return jax.lax.stop_gradient(scale_from_amax(row_amax(x2), E4M3, seam.config.margin))
    return static_scale


def _fast(seam: Seam) -> Tuple[bool, bool]:
    return (seam.config.fast_accum_fwd, seam.config.fast_accum_bwd)


def _scale_kw(seam: Seam, grad_scales, weight_scales, i: int, group, weight_cast=None) -> dict:
    """`fp8_linear`'s scale arguments for GEMM ``i``: gradient scales (none
    without ``grad_scales``: current scaling, nothing observed) and, for a
    live weight ``group``, the config's weight scaling (with its delayed
    scale from ``weight_scales`` and the step's cast bytes, if any)."""
    kw = {}
    if not isinstance(group, Fp8Weight):
        kw["weight_scaling"] = seam.config.weight_scaling
        if seam.config.weight_scaling == "delayed":
            kw["weight_scale"] = weight_scales[i]
            if weight_cast is not None:
                kw["weight_cast"] = (weight_cast.q[i], weight_cast.amax[i])
    if grad_scales is None:
        return kw
    return {**kw, "grad_scale": grad_scales[i], "delayed_grad": seam.config.grad_scaling == "delayed"}


def _first_gemm(seam, groups, x2, scales, grad_scales=None, weight_scales=None, weight_cast=None):
    a = fp8_linear(x2, groups[0], _act_scale(seam, x2, scales[0]), _fast(seam),
                   **_scale_kw(seam, grad_scales, weight_scales, 0, groups[0], weight_cast))
    if seam.kind == "dense":
        return a
    f = a.shape[-1] // 2
    g, u = a[:, :f], a[:, f:]
    # silu and the product in float32 (free inside the fusion that also
    # quantizes the result for the down projection).
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x2.dtype)


def _second_gemm(seam, groups, h, scales, grad_scales=None, weight_scales=None, weight_cast=None):
    return fp8_linear(h, groups[1], _act_scale(seam, h, scales[1]), _fast(seam),
                      **_scale_kw(seam, grad_scales, weight_scales, 1, groups[1], weight_cast))


def fp8_forward(seam: Seam, params: Any, x: jax.Array, scales: jax.Array,
                grad_scales: Optional[jax.Array] = None, weight_scales: Optional[jax.Array] = None,
                weight_cast: Optional[CastWeights] = None) -> jax.Array:
    """The unguarded fp8 computation of the seam on ``x`` (any leading axes).

    No checks, no counting: what the gate measures and what benchmarks time
    as "the fp8 seam" without guards. Differentiable (fp8 backward; with
    ``grad_scales``, ``(gemms,)``, their cotangent is the observed gradient
    amax and ``grad_scaling='delayed'`` quantizes with them; without,
    current scaling whatever the config says). ``weight_scales``
    ``(gemms,)``: the delayed weight scales (``weight_scaling='delayed'``;
    their cotangent is the observed weight amax); without them such a seam
    uses `weight_scales_of` the given weights. ``weight_cast``: the
    weights cast at ``weight_scales`` (`cast_weights`), read instead of
    quantizing them.

    Returns:
      The fused output in ``x.dtype``.

    Raises:
      ValueError: a ``weight_cast`` without delayed weight scaling, or not
        cast from weights of these shapes.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    groups = _groups(seam, params)
    scales = jnp.asarray(scales, jnp.float32)
    if weight_cast is not None:
        # Before the default below: bytes are only valid with the scales they were cast at.
        _check_cast(seam, params, weight_cast, weight_scales)
    if seam.config.weight_scaling == "delayed" and weight_scales is None and not isinstance(params, FrozenParams):
        weight_scales = jax.lax.stop_gradient(weight_scales_of(seam, params))
    h = _first_gemm(seam, groups, x2, scales, grad_scales, weight_scales, weight_cast)
    y = h if seam.kind == "dense" else _second_gemm(seam, groups, h, scales, grad_scales, weight_scales, weight_cast)
    return y.reshape(lead + (y.shape[-1],))


def _check_cast(seam: Seam, params: Any, cast: Any, weight_scales) -> None:
    """Trace-time check of a state's `CastWeights` against the seam and
    params it is used with (ValueError naming what does not fit)."""
    if seam.config.weight_scaling != "delayed":
        raise ValueError(f"seam {seam.name!r}: weights cast to fp8 (cast_weights) need weight_scaling='delayed', "
                         f"got {seam.config.weight_scaling!r}")
    if not isinstance(cast, CastWeights):
        raise ValueError(f"seam {seam.name!r}: weight_cast must be a CastWeights, got {type(cast).__name__}")
    if weight_scales is None:
        raise ValueError(f"seam {seam.name!r}: cast weights without the weight_scales they were cast at")
    if isinstance(params, FrozenParams):
        return
    groups = _groups(seam, params)
    want = [(sum(w.shape[0] for w in g), g[0].shape[1]) for g in groups]
    got = [tuple(q.shape) for q in cast.q]
    if got != want or any(q.dtype != E4M3 for q in cast.q) or tuple(cast.amax.shape) != (len(groups),):
        raise ValueError(f"seam {seam.name!r}: cast weights {got} ({[str(q.dtype) for q in cast.q]}), amax "
                         f"{tuple(cast.amax.shape)} do not fit its weights {want} (float8_e4m3fn; amax "
                         f"({len(groups)},)): cast them from these params with cast_weights")


def cast_weights(seam: Seam, state: SeamState, params: Any) -> SeamState:
    """``state`` with ``params``' weights cast to e4m3 once (`CastWeights`).

    For a step that calls the seam more than once on the same weights (a
    reconstruct train step runs every block forward twice: the forward and
    the backward's recomputation), or wherever the weights are fixed for a
    while: each call then multiplies the cast bytes instead of quantizing
    its weights (one elementwise pass per weight and call saved). The
    results are those of the uncast state bit for bit (same delayed scales,
    same observed amax; the gradient still reaches ``params``), as long as
    the calls get the ``params`` the bytes were cast from: cast again after
    every update (`fold_state` drops the bytes, so a folded state cannot
    carry stale ones into the next step).

    Args:
      seam: a seam with ``weight_scaling='delayed'`` (the bytes carry the
        state's delayed per-tensor scales).
      state: its `SeamState` (no leading axes; `eae_jax.fp8.BoundBlock.cast_weights`
        casts every layer of a stack).
      params: the weights the calls will get (high precision).

    Raises:
      ValueError: another weight scaling, a state without ``weight_scales``,
        params that do not fit the seam, or `FrozenParams` (already fp8).
    """
    if seam.config.weight_scaling != "delayed":
        raise ValueError(f"seam {seam.name!r}: cast_weights needs weight_scaling='delayed' (the bytes carry the "
                         f"delayed per-tensor scales), got {seam.config.weight_scaling!r}")
    if not isinstance(state, SeamState) or state.weight_scales is None:
        raise ValueError(f"seam {seam.name!r}: cast_weights needs a state with weight_scales "
                         "(bind / init_state(seam, scales, params))")
    if isinstance(params, FrozenParams):
        raise ValueError(f"seam {seam.name!r}: frozen params are quantized already; cast_weights takes live weights")
    seam_dims(seam, params)
    if state.weight_scales.shape != (seam.gemms,):
        raise ValueError(f"seam {seam.name!r}: cast_weights takes one layer's state (weight_scales "
                         f"({seam.gemms},)), got weight_scales of shape {state.weight_scales.shape}")
    pairs = [cast_weight(g, state.weight_scales[i]) for i, g in enumerate(_groups(seam, params))]
    return state._replace(weight_cast=CastWeights(tuple(q for q, _ in pairs), jnp.stack([a for _, a in pairs])))


def amax_points(seam: Seam, params: Any, x: jax.Array) -> jax.Array:
    """float32 ``(points,)``: amax of the seam input and (swiglu) of the
    down-projection input, computed in high precision."""
    if isinstance(params, FrozenParams):
        params = params.hp
    a_in = jnp.max(magnitude(x))
    if seam.kind == "dense":
        return a_in[None]
    g = linear(x, params["w_gate"]).astype(jnp.float32)
    u = linear(x, params["w_up"]).astype(jnp.float32)
    return jnp.stack([a_in, jnp.max(magnitude(jax.nn.silu(g) * u))])


def cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine similarity of two arrays flattened, in float32 (1 for two zeros)."""
    a = a.astype(jnp.float32).reshape(-1)
    b = b.astype(jnp.float32).reshape(-1)
    na, nb = jnp.sqrt(jnp.sum(a * a)), jnp.sqrt(jnp.sum(b * b))
    both_zero = (na == 0) & (nb == 0)
    return jnp.where(both_zero, 1.0, jnp.sum(a * b) / jnp.maximum(na * nb, 1e-30))


# ---------------------------------------------------------------------- guarded call
def contract(seam: Seam, width: int) -> Contract:
    """The trace-time contract of a seam bound for input width ``width``."""
    c = seam.config
    return Contract(width=width, dtypes=c.dtypes, min_rows=c.min_rows, max_rows=c.max_rows,
                    platforms=c.platforms, min_compute_capability=c.min_compute_capability)


class Attempt(NamedTuple):
    """One seam call's fp8 attempt, before anything decides to fall back.

    Attributes:
      y: the fused output: fp8, or high precision when ``trace_reason`` is set.
      code: int32 scalar: -1 when the fp8 result may stand, else the index
        of the reason (`eae_jax.fp8.ledger.REASONS`) to fall back; always -1
        for a trace-time fallback (already high precision), strict mode
        (the host raises instead) and unchecked seams.
      amax: ``(points,)`` float32 amax observed at the quantization points.
      trace_reason: the trace-time fallback's reason index, or None.
    """

    y: jax.Array
    code: jax.Array
    amax: jax.Array
    trace_reason: Optional[int]


def attempt(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor=None) -> Attempt:
    """Run a seam's fp8 path with its checks, without falling back.

    Trace-time problems (`eae_jax.fp8.guards.trace_check`) are settled here:
    the high-precision path is traced instead (or, strict, `GuardRefused`).
    Value problems are only detected: ``code`` says whether and why the
    caller must replace ``y`` by the high-precision result. `apply` does so
    per seam call; `eae_jax.fp8.fp8_block` with ``fallback='block'`` once
    per block call.

    Raises:
      TypeError: ``state`` is not a `SeamState`.
      ValueError: delayed gradient (weight) scaling with a state without
        ``grad_scales`` (``weight_scales``).
      GuardRefused: wrong width / non-float input; a trace-time problem in
        strict mode.
    """
    cfg = seam.config
    if not isinstance(state, SeamState):
        raise TypeError(f"seam {seam.name!r}: state must be a SeamState, got {type(state).__name__}")
    if state.grad_scales is None and cfg.grad_scaling == "delayed":
        raise ValueError(f"seam {seam.name!r} has grad_scaling='delayed' but its state has no grad_scales")
    if state.weight_scales is None and cfg.weight_scaling == "delayed" and not isinstance(params, FrozenParams):
        raise ValueError(f"seam {seam.name!r} has weight_scaling='delayed' but its state has no weight_scales "
                         "(make it with bind / init_state(seam, scales, params))")
    width = input_width(seam, params)
    no_fallback = jnp.int32(-1)
    try:
        problem = trace_check(contract(seam, width), x)
    except GuardRefused as err:
        raise GuardRefused(f"eae_jax.fp8: seam {seam.name!r}: {err}") from None
    if problem is not None:
        reason, detail = problem
        if cfg.strict:
            raise GuardRefused(f"eae_jax.fp8: seam {seam.name!r} refused at trace time (strict): {reason}: {detail}")
        if monitor is not None:
            monitor.trace_fallback(seam.name, reason, detail)
        return Attempt(high_precision(seam, params, x), no_fallback, jnp.zeros((seam.points,), jnp.float32),
                       ledger_lib.reason_index(reason))

    lead = x.shape[:-1]
    fmax = fp8_max(E4M3)
    scales = state.scales.astype(jnp.float32)
    static = cfg.act_scaling != "row"
    thr = cfg.saturation_threshold

    # The fp8 path runs unconditionally and the checks are reductions over the
    # same values it quantizes, so XLA can fuse them into the quantizing
    # kernels; the caller's single lax.cond afterwards replaces the result
    # when a check failed (one branch point per decision: XLA cannot fuse
    # across a cond, and the common path pays no extra pass). A fallback
    # wastes the fp8 work, which is fine for something that should be rare
    # (a detached seam keeps paying it: drop the seam from the block to stop
    # that).
    x2 = x.reshape(-1, width)
    groups = _groups(seam, params)
    cast = state.weight_cast
    if cast is not None:
        _check_cast(seam, params, cast, state.weight_scales)
    amax_in, sat_in = value_stats(x2, scales[0] if static else None, fmax)
    h = _first_gemm(seam, groups, x2, scales, state.grad_scales, state.weight_scales, cast)
    if seam.kind == "dense":
        y2, amax_h, sat_h = h, None, None
    else:
        amax_h, sat_h = value_stats(h, scales[1] if static else None, fmax)
        y2 = _second_gemm(seam, groups, h, scales, state.grad_scales, state.weight_scales, cast)
    y8 = y2.reshape(lead + (y2.shape[-1],))
    amax = amax_in[None] if amax_h is None else jnp.stack([amax_in, amax_h])
    if not cfg.check_values:
        return Attempt(y8, no_fallback, amax, None)

    code = jnp.where(sat_in > thr, ledger_lib.reason_index("saturation"), -1)
    if sat_h is not None and cfg.check_hidden:
        code = jnp.where((code < 0) & (sat_h > thr), ledger_lib.reason_index("hidden_saturation"), code)
    code = jnp.where(~jnp.isfinite(amax_in), ledger_lib.reason_index("nonfinite"), code).astype(jnp.int32)
    if cfg.strict:
        ledger_lib.strict_check(seam.name, code)
        # Nothing falls back: the call ran fp8 or the host raised.
        return Attempt(y8, no_fallback, amax, None)
    code = jnp.where(state.ledger.detached > 0, ledger_lib.reason_index("detached"), code).astype(jnp.int32)
    return Attempt(y8, code, amax, None)


def attempt_increments(a: Attempt, code: Optional[jax.Array] = None) -> ledger_lib.Ledger:
    """The ledger increments of an attempt, with ``code`` (default ``a.code``)
    the reason it finally ran high precision (-1: it ran fp8)."""
    if a.trace_reason is not None:
        return ledger_lib.increments(jnp.int32(a.trace_reason), a.amax)
    return ledger_lib.increments(a.code if code is None else code, a.amax)


def decide_once(attempt_fn, high_precision_fn):
    """A guarded computation that decides once forward and once backward.

    Args:
      attempt_fn: ``(params, x, states) -> (y8, (bad, aux))``: the fp8
        attempt, whether its checks failed (a bool scalar; ``None`` when
        there is nothing to decide at run time, e.g. a trace-time fallback
        already made ``y8`` the high-precision result), and anything to hand
        back (ledger increments).
      high_precision_fn: ``(params, x) -> y``, the fallback.

    Returns:
      ``f(params, x, states) -> (y, aux)`` with ``y = y8`` unless ``bad``.
      Forward: one ``lax.cond``. Differentiated, the forward keeps the
      decision and the attempt's residuals; the backward always runs the
      attempt's VJP, outside any cond, and one ``lax.cond`` replaces its
      result with the fallback's VJP (recomputed, as a fallback is rare)
      when ``bad``. Left to autodiff, the transposed cond would need its
      primal cond's residual outputs, so a recomputation
      (`eae_jax.reconstruct`'s backward) would run the forward cond again;
      here the recomputed output is unused and that cond is dead code: two
      conds per call in a reconstruct train step instead of three. The
      attempt's residuals never enter a cond: operands of a cond are
      materialised, and with the float32 intermediates of the norms and the
      SwiGLU product crossing it, a guarded medium reconstruct step on the
      H200 ran 12.5 ms behind the unguarded one; with the VJP outside the
      cond (which fuses them away) the gap is 3.7 ms. ``states`` get the
      attempt's cotangent (the gradient amax each fp8 GEMM observed, see
      `SeamState.grad_scales`; zero after a fallback), nothing else: counts
      leave through `eae_jax.fp8.ledger.count`.
    """

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
        # A failed attempt's VJP may be garbage (NaN); the cond discards it.
        gp, gx, gstates = vjp8(cts[0])
        if bad is not None:
            gp, gx = jax.lax.cond(bad, lambda ops: jax.vjp(high_precision_fn, ops[1], ops[2])[1](ops[3]),
                                  lambda ops: ops[0], ((gp, gx), params, x, cts[0]))
            # What a fallen-back attempt observed is not trusted.
            gstates = jax.tree_util.tree_map(lambda a: jnp.where(bad, jnp.zeros_like(a), a), gstates)
        return gp, gx, gstates

    run.defvjp(fwd, bwd)
    return run


def _guarded(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor) -> Tuple[jax.Array, ledger_lib.Ledger]:
    """One guarded call: ``(fused output, ledger increments)``."""
    if not can_fall_back(seam):
        a = attempt(seam, state, params, x, monitor)
        return a.y, attempt_increments(a)

    def attempt_fn(params_, x_, state_):
        a = attempt(seam, state_, params_, x_, monitor)
        # A trace-time fallback has already run the high-precision path.
        return a.y, (None if a.trace_reason is not None else a.code >= 0, attempt_increments(a))

    return decide_once(attempt_fn, functools.partial(high_precision, seam))(params, x, state)


def can_fall_back(seam: Seam) -> bool:
    """Whether the seam's attempt can ask for a fallback in the graph."""
    return seam.config.check_values and not seam.config.strict


# ---------------------------------------------------------------------- public calls
def apply(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor=None):
    """Guarded, counted call of a seam (the differentiable form).

    Counts leave as the cotangent of ``state.ledger`` (differentiate with
    respect to ``state`` and `fold` it; see `eae_jax.fp8.ledger`).

    Args:
      state: this seam's `SeamState` (no leading axes).
      params: the seam's weights (dict) or `FrozenParams`.
      x: ``(..., K)`` activations.
      monitor: a `LedgerMonitor` for trace-time warnings (optional).

    Returns:
      swiglu: ``(..., D)``; dense: tuple of ``(..., N_i)`` (one array for
      one weight); in ``x.dtype``.

    Raises:
      GuardRefused: wrong width / non-float input, or a trace-time contract
        failure in strict mode.
      ValueError: a state that is not one instance of this seam's (`check_state`).
    """
    check_state(seam, state)
    y, inc = _guarded(seam, state, params, x, monitor)
    y = ledger_lib.count(y, state.ledger, inc)
    return split_output(seam, params, y)


def check_state(seam: Seam, state: Any) -> None:
    """Refuse a state that is not one instance of this seam's `SeamState`.

    Raises:
      ValueError: not a `SeamState`, or scales / gradient / weight scales /
        ledger of another shape (a stacked per-layer state given to one
        call is named as such).
    """
    if not isinstance(state, SeamState):
        raise ValueError(f"seam {seam.name!r}: expected its SeamState, got {type(state).__name__}")
    want = {"scales": (seam.points,), "grad_scales": (seam.gemms,), "weight_scales": (seam.gemms,)}
    for field, shape in want.items():
        value = getattr(state, field)
        if value is None:
            continue
        got = tuple(jnp.shape(value))
        if got != shape:
            stacked = len(got) > len(shape) and got[len(got) - len(shape):] == shape
            hint = (f"; this is a stacked state with leading axes {got[:len(got) - len(shape)]}: give one call "
                    "one instance (e.g. tree_map(lambda a: a[i], state)), or run the layers through "
                    "lax.scan / eae_jax.reconstruct") if stacked else ""
            raise ValueError(f"seam {seam.name!r}: state.{field} has shape {got}, expected {shape}{hint}")


def apply_with_ledger(seam: Seam, state: SeamState, params: Any, x: jax.Array, monitor=None):
    """Like `apply` but returns ``(y, increments)`` (inference: no VJP needed)."""
    check_state(seam, state)
    y, inc = _guarded(seam, state, params, x, monitor)
    return split_output(seam, params, y), inc


def fold_state(seam: Seam, state: SeamState, inc: Any) -> SeamState:
    """Fold a step's observations into a state (any leading axes).

    Args:
      inc: the state's cotangent (a `SeamState`: ledger increments,
        observed gradient amax and, with delayed weight scaling, observed
        weight amax) or ledger increments alone (a `Ledger`, e.g. summed
        forward increments; gradient and weight scales then stay).

    With ``'delayed'`` activation scaling the activation scales become
    ``amax_observed * 2**margin / 448`` wherever the step observed a finite,
    positive amax. Gradient scales (both modes) become
    ``grad_amax_observed * 2**grad_margin / 57344`` wherever a gradient
    amax was observed; under delayed gradient scaling a step whose observed
    amax exceeded the range of the scale it used adds one to
    ``grad_clipped``. Delayed weight scales become ``weight_amax_observed /
    448`` wherever a weight amax was observed, and a weight that had
    outgrown the scale it was quantized with by more than rounding covers
    (its amax beyond ``464 * scale``: values up to that round to 448 anyway)
    adds one to ``weight_clipped``.
    """
    grad_obs = weight_obs = None
    if isinstance(inc, SeamState):  # the whole state's cotangent was passed
        grad_obs, weight_obs = inc.grad_scales, inc.weight_scales
        inc = inc.ledger
    new_ledger = ledger_lib.fold(state.ledger, inc, seam.config.detach_after)
    scales = state.scales
    if seam.config.act_scaling == "delayed":
        fresh = scale_from_amax(inc.amax, E4M3, seam.config.margin)
        scales = jnp.where(inc.amax > 0, fresh, scales)
    grad_scales, clipped = state.grad_scales, state.grad_clipped
    if grad_obs is not None and grad_scales is not None:
        seen = grad_obs > 0
        if seam.config.grad_scaling == "delayed":
            # A zero (never observed) scale saturated every gradient of the step: clipped too.
            over = seen & (grad_obs > grad_scales * fp8_max(E5M2))
            clipped = (jnp.zeros_like(grad_scales) if clipped is None else clipped) + over.astype(jnp.float32)
        grad_scales = jnp.where(seen, scale_from_amax(grad_obs, E5M2, seam.config.grad_margin), grad_scales)
    weight_scales, w_clipped = state.weight_scales, state.weight_clipped
    if weight_obs is not None and weight_scales is not None:
        seen = weight_obs > 0
        # Beyond the top value by less than half its rounding step, a weight
        # saturates to what rounding would have given it anyway: not clipped.
        over = seen & (weight_scales > 0) & (weight_obs > weight_scales * _rounding_limit(E4M3))
        w_clipped = (jnp.zeros_like(weight_scales) if w_clipped is None else w_clipped) + over.astype(jnp.float32)
        weight_scales = jnp.where(seen, scale_from_amax(weight_obs, E4M3), weight_scales)
    # Cast weights (if any) are not carried over: the next step's weights differ.
    return SeamState(scales, new_ledger, grad_scales, clipped, weight_scales, w_clipped)


def combine_observations(a: SeamState, b: SeamState) -> SeamState:
    """Combine two seam-state cotangents (observations) of separately
    differentiated calls that share one state in a step, e.g. microbatches:
    ledger counts add up; every amax (the ledger's, gradients', weights')
    takes the maximum (a sum would overstate the next scales). The cast
    weights' cotangent is no observation and is dropped.

    Within one differentiation, cotangents of calls sharing a state are
    added by autodiff, amaxes included: give each call its own state (as
    stacked per-layer states do) or differentiate the calls separately and
    combine their cotangents here.

    Raises:
      ValueError: the two are not shaped alike.
    """
    strip = dict(grad_scales=None, weight_scales=None, weight_cast=None)
    try:
        summed = jax.tree_util.tree_map(jnp.add, a._replace(**strip), b._replace(**strip))
    except ValueError as err:
        raise ValueError(f"combine_observations: the two observations differ in structure: {err}") from err

    def peak(x, y):
        return None if x is None else jnp.maximum(x, y)

    ledger = summed.ledger._replace(amax=jnp.maximum(a.ledger.amax, b.ledger.amax))
    return summed._replace(ledger=ledger, grad_scales=peak(a.grad_scales, b.grad_scales),
                           weight_scales=peak(a.weight_scales, b.weight_scales))


def _rounding_limit(dtype) -> float:
    """The magnitude below which a value rounds to an fp8 format's largest
    finite one (max plus half the spacing of its top binade): 464 for
    e4m3fn."""
    fmax = fp8_max(dtype)
    spacing = 2.0 ** np.floor(np.log2(fmax)) * float(jnp.finfo(dtype).eps)
    return fmax + spacing / 2


def state_report(state: SeamState, name: str) -> List[Dict[str, Any]]:
    """Host-side receipt of a seam state, one entry per seam instance (layer):
    `eae_jax.fp8.ledger.report`'s entries (calls, fp8 calls, fallbacks by
    reason, last reason, consecutive, detached, amax) plus ``grad_scales``
    and ``grad_clipped`` per GEMM (when the state has them), and
    ``weight_scales`` / ``weight_clipped`` (delayed weight scaling)."""
    out = ledger_lib.report(state.ledger, name)
    for kind in ("grad", "weight"):
        scales, clipped = getattr(state, kind + "_scales"), getattr(state, kind + "_clipped")
        if scales is None:
            continue
        scales = np.asarray(scales)
        clipped = np.zeros_like(scales) if clipped is None else np.asarray(clipped)
        lead = scales.shape[:-1]
        for entry, index in zip(out, np.ndindex(*lead) if lead else [()]):
            entry[kind + "_scales"] = [float(v) for v in scales[index]]
            entry[kind + "_clipped"] = [int(v) for v in clipped[index]]
    return out


def require_grad_scales(seam: Seam, state: SeamState) -> None:
    """Raise unless every gradient scale of ``state`` has been observed (host check,
    concrete state): what delayed gradient scaling needs before its first step.

    Raises:
      ValueError: no ``grad_scales`` in the state, or some never observed
        (listed by layer and GEMM).
    """
    if state.grad_scales is None:
        raise ValueError(f"seam {seam.name!r}: the state has no grad_scales (made before gradient scaling "
                         "existed); init_state / bind make them")
    gs = np.asarray(state.grad_scales)
    missing = np.argwhere(~(gs > 0))
    if missing.size:
        listing = ", ".join(str(tuple(int(i) for i in m)) for m in missing[:8])
        raise ValueError(f"seam {seam.name!r}: gradient scales never observed at {listing}"
                         f"{' ...' if len(missing) > 8 else ''} (index: layer..., GEMM); run a step with "
                         "grad_scaling='current' and fold it first")


# ---------------------------------------------------------------------- binding
class Certification(NamedTuple):
    """What `bind` measured and promised.

    Attributes:
      seam, kind: the seam's name and kind.
      dims: see `seam_dims`.
      scales: the activation scales bound (per point).
      calibrated_scales: what calibration measured (equal to ``scales``
        unless scales were overridden).
      amax: the amax per point after the percentile reduction.
      percentile: the percentile across samples.
      samples: number of calibration samples; ``rows``: their row counts.
      worst_cos: the worst gate cosine; ``cosines``: per sample.
      bare_cosines: the same at the bare seam output.
      gate_cos: the threshold; ``gate_boundary``: ``'block boundary (incl.
        residual)'`` or ``'bare seam'``.
      max_saturation: largest saturated fraction over samples and points.
      act_scaling: the scaling mode.
    """

    seam: str
    kind: str
    dims: dict
    scales: list
    calibrated_scales: list
    amax: list
    percentile: float
    samples: int
    rows: list
    worst_cos: float
    cosines: list
    bare_cosines: list
    gate_cos: float
    gate_boundary: str
    max_saturation: float
    act_scaling: str

    def as_dict(self) -> dict:
        return dict(self._asdict())


def _as_list(samples) -> List[jax.Array]:
    if samples is None:
        return []
    if isinstance(samples, (list, tuple)):
        return [jnp.asarray(s) for s in samples]
    return [jnp.asarray(samples)]


def reduce_amax(amax: np.ndarray, percentile: float) -> np.ndarray:
    """Reduce per-sample amax ``(samples, ...)`` across samples at ``percentile``
    (linear interpolation; 100 is the max)."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    return np.percentile(np.asarray(amax, np.float64), percentile, axis=0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class BoundSeam:
    """A seam bound to calibrated scales, with its certification.

    Attributes:
      seam: the `Seam`.
      state: the initial `SeamState` (scales + zeroed ledger).
      certification: the `Certification` record.
      monitor: host-side `LedgerMonitor` (warn once per reason, detach notice).
    """

    seam: Seam
    state: SeamState
    certification: Certification
    monitor: ledger_lib.LedgerMonitor = dataclasses.field(default_factory=ledger_lib.LedgerMonitor, compare=False)

    @property
    def name(self) -> str:
        return self.seam.name

    def __call__(self, state: SeamState, params: Any, x: jax.Array):
        """`apply` (guarded, counted through the VJP)."""
        return apply(self.seam, state, params, x, self.monitor)

    def apply_with_ledger(self, state: SeamState, params: Any, x: jax.Array):
        """``(y, increments)`` for inference."""
        return apply_with_ledger(self.seam, state, params, x, self.monitor)

    def high_precision(self, params: Any, x: jax.Array):
        """The original computation (split like `apply`'s output)."""
        return split_output(self.seam, params, high_precision(self.seam, params, x))

    def fp8(self, params: Any, x: jax.Array, state: Optional[SeamState] = None):
        """The unguarded fp8 computation with this seam's (or ``state``'s) scales."""
        st = state or self.state
        return split_output(self.seam, params, fp8_forward(self.seam, params, x, st.scales,
                                                           weight_scales=st.weight_scales,
                                                           weight_cast=st.weight_cast))

    def cast_weights(self, state: SeamState, params: Any) -> SeamState:
        """`cast_weights` for this seam."""
        return cast_weights(self.seam, state, params)

    def freeze(self, params: dict) -> FrozenParams:
        """Quantize the weights once for inference (see `FrozenParams`)."""
        return freeze(self.seam, params)

    def fold(self, state: SeamState, inc: Any, notify: bool = True) -> SeamState:
        """New state after a step (``inc``: the state's cotangent or summed increments).

        With ``notify`` one host callback hands the new ledger to the monitor
        (warnings once per reason; once on detaching).
        """
        new = fold_state(self.seam, state, inc)
        if notify:
            self.monitor.notify({self.seam.name: new.ledger})
        return new

    def report(self, state: SeamState) -> List[Dict[str, Any]]:
        """Per seam instance: see `state_report`."""
        return state_report(state, self.seam.name)


def bind(
    seam: Seam,
    params: Any,
    calibration_inputs: Union[jax.Array, Sequence[jax.Array]],
    residuals: Union[None, jax.Array, Sequence[jax.Array]] = None,
    *,
    percentile: float = 99.9,
    gate_cos: Optional[float] = None,
    scales: Any = None,
) -> BoundSeam:
    """Calibrate, build and gate an fp8 seam.

    Args:
      seam: what to bind (`ffn_seam`, `dense_seam` ...).
      params: its weights (dict with the seam's weight names).
      calibration_inputs: one array or a list of arrays ``(..., K)``: the
        activations the seam really sees (e.g. the normed hidden states).
      residuals: optional, aligned 1:1 with the samples: the residual
        stream the seam's output is added to. The gate is then measured at
        the block boundary ``residual + seam(x)``; without it, at the bare
        seam output (harsher). Only for seams whose output width equals
        the residual's.
      percentile: per-sample amax values are reduced across samples at this
        percentile (100 = max).
      gate_cos: cosine threshold (default ``seam.config.gate_cos``; 0
        disables the gate).
      scales: override the calibrated scales (``(points,)``), e.g. to reuse
        scales; the gate still runs on them.

    Returns:
      A `BoundSeam`.

    Raises:
      ValueError: no samples, mismatched widths/residuals, bad params,
        non-finite weights or a sample with non-finite values (at the input or,
        for the FFN, at the down-projection input).
      GateRefused: the fp8 seam's worst cosine is under the threshold.
    """
    dims = seam_dims(seam, params)
    width = input_width(seam, params)
    samples = _as_list(calibration_inputs)
    if not samples:
        raise ValueError(f"seam {seam.name!r}: bind needs at least one calibration sample")
    for i, s in enumerate(samples):
        if s.ndim < 1 or s.shape[-1] != width or not jnp.issubdtype(s.dtype, jnp.floating):
            raise ValueError(f"seam {seam.name!r}: calibration sample {i} has shape {s.shape} and dtype {s.dtype}; "
                             f"expected float (..., {width})")
        if s.size == 0:
            raise ValueError(f"seam {seam.name!r}: calibration sample {i} of shape {s.shape} has no rows; "
                             "nothing to calibrate on")
    res = _as_list(residuals)
    if residuals is not None:
        if len(res) != len(samples):
            raise ValueError(f"seam {seam.name!r}: {len(res)} residuals for {len(samples)} calibration samples; "
                             "they must align 1:1")
        out_w = output_width(seam, params)
        for i, (r, s) in enumerate(zip(res, samples)):
            if r.shape != s.shape[:-1] + (out_w,):
                raise ValueError(f"seam {seam.name!r}: residual {i} has shape {r.shape}, expected "
                                 f"{s.shape[:-1] + (out_w,)} (the seam's output)")
    thr = seam.config.gate_cos if gate_cos is None else float(gate_cos)
    if not 0.0 <= thr <= 1.0:  # NaN fails too
        raise ValueError(f"seam {seam.name!r}: gate_cos must be in [0, 1], got {gate_cos}")
    hp = params.hp if isinstance(params, FrozenParams) else params
    bad_dtype = [f"{n}: {hp[n].dtype}" for n in seam.weights if not jnp.issubdtype(hp[n].dtype, jnp.floating)]
    if bad_dtype:
        raise ValueError(f"seam {seam.name!r}: weights must be floating point, got {bad_dtype}")

    amax_fn = jax.jit(functools.partial(amax_points, seam))
    amax = np.stack([np.asarray(amax_fn(params, s)) for s in samples])
    bad_w = [n for n in seam.weights if not bool(jnp.all(jnp.isfinite(hp[n])))]
    if bad_w:
        raise ValueError(f"seam {seam.name!r}: weights {bad_w} contain NaN or inf; nothing to calibrate")
    for i, row in enumerate(amax):
        if not np.all(np.isfinite(row)):
            where = "seam input" if not np.isfinite(row[0]) else "down-projection input"
            raise ValueError(f"seam {seam.name!r}: calibration sample {i} gives a non-finite amax at the {where} "
                             f"({row.tolist()}); calibrate on finite activations")
    reduced = reduce_amax(amax, percentile)
    calibrated = scale_from_amax(jnp.asarray(reduced), E4M3, seam.config.margin)
    used = calibrated if scales is None else jnp.asarray(scales, jnp.float32)
    if used.shape != (seam.points,):
        raise ValueError(f"seam {seam.name!r} needs {seam.points} scale(s), got shape {used.shape}")
    if scales is not None and not bool(jnp.all(jnp.isfinite(used) & (used > 0))):
        raise ValueError(f"seam {seam.name!r}: scales must be finite and positive, got {np.asarray(used).tolist()}")

    @jax.jit
    def measure(params, x, r, scales_):
        y8 = fp8_forward(seam, params, x, scales_)
        yh = high_precision(seam, params, x)
        bare = cosine(y8, yh)
        boundary = bare if r is None else cosine(r.astype(jnp.float32) + y8.astype(jnp.float32),
                                                 r.astype(jnp.float32) + yh.astype(jnp.float32))
        sat_in = value_stats(x, scales_[0], fp8_max(E4M3))[1]
        sat = sat_in
        if seam.kind == "swiglu":
            g = linear(x, params["w_gate"]).astype(jnp.float32)
            u = linear(x, params["w_up"]).astype(jnp.float32)
            sat = jnp.maximum(sat_in, value_stats(jax.nn.silu(g) * u, scales_[1], fp8_max(E4M3))[1])
        return boundary, bare, sat

    cos, bare, sats = [], [], []
    for i, s in enumerate(samples):
        c, b, st = measure(params, s, res[i] if res else None, used)
        cos.append(float(c))
        bare.append(float(b))
        sats.append(float(st))
    worst = min(cos)
    boundary_name = "block boundary (incl. residual)" if res else "bare seam"
    if thr and not worst >= thr:  # NaN fails too
        raise GateRefused(
            f"eae_jax.fp8: seam {seam.name!r} refused: worst cosine {worst:.6f} < {thr} at the {boundary_name} "
            f"on {len(samples)} calibration sample(s) (scales {np.asarray(used).tolist()})"
            + ("" if res else "; pass residuals= to gate at the block boundary"),
            worst,
        )
    cert = Certification(
        seam=seam.name, kind=seam.kind, dims=dims, scales=np.asarray(used).tolist(),
        calibrated_scales=np.asarray(calibrated).tolist(), amax=reduced.tolist(), percentile=float(percentile),
        samples=len(samples), rows=[int(np.prod(s.shape[:-1])) for s in samples], worst_cos=worst,
        cosines=cos, bare_cosines=bare, gate_cos=thr, gate_boundary=boundary_name,
        max_saturation=max(sats), act_scaling=seam.config.act_scaling,
    )
    return BoundSeam(seam, init_state(seam, used, params), cert)
