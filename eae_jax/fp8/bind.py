"""Calibration and the parity gate: `bind` (one seam), `bind_block` (every
layer of a block, each on what the high-precision stack feeds it).

Static e4m3 scales are ``amax / 448`` of real inputs (reduced across samples
at a percentile); the gate compares the fp8 seam with the high-precision
one on every sample and refuses it under ``gate_cos`` (`GateRefused`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.blocks.linear import linear
from eae_jax.blocks.transformer import BlockConfig
from eae_jax.fp8 import block as bl
from eae_jax.fp8 import seams as sl
from eae_jax.fp8 import state as st
from eae_jax.fp8.quant import E4M3, scale_from_amax
from eae_jax.fp8.seams import FrozenParams, Seam, apply, apply_with_ledger, cast_weights, fold_state, fp8_forward, \
    freeze, high_precision, init_state, seam_dims, _split_output
from eae_jax.fp8.state import GateRefused, SeamState


class Certification(NamedTuple):
    """What `bind` measured and promised: scales (bound, calibrated), amax per
    point, the samples, the gate's cosines (block boundary and bare) and
    threshold, the largest saturated fraction.

    >>> "worst_cos" in Certification._fields
    True
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
        """The record as a plain dict."""
        return dict(self._asdict())


def _samples(samples: Any) -> List[jax.Array]:
    """One array or a list of arrays as a list (None: empty)."""
    if samples is None:
        return []
    return [jnp.asarray(s) for s in samples] if isinstance(samples, (list, tuple)) else [jnp.asarray(samples)]


def _reduce_amax(amax: Any, percentile: float) -> np.ndarray:
    """Per-sample amax ``(samples, ...)`` reduced across samples at ``percentile``."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    return np.percentile(np.asarray(amax, np.float64), percentile, axis=0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class BoundSeam:
    """A seam bound to calibrated scales: ``seam``, its initial ``state``,
    ``certification`` and a host-side `LedgerMonitor`.

    >>> from eae_jax.fp8 import out_proj_seam
    >>> b = bind(out_proj_seam(), {"wo": jnp.eye(2)}, jnp.ones((2, 2)), gate_cos=0)
    >>> b.report(b.fold(b.state, b.apply_with_ledger(b.state, {"wo": jnp.eye(2)}, jnp.ones((1, 2)))[1]))[0]["calls"]
    1
    """

    seam: Seam
    state: SeamState
    certification: Certification
    monitor: st.LedgerMonitor = dataclasses.field(default_factory=st.LedgerMonitor, compare=False)

    def __call__(self, state: SeamState, params: Any, x: jax.Array):
        """`apply` with this seam."""
        return apply(self.seam, state, params, x, self.monitor)

    def apply_with_ledger(self, state: SeamState, params: Any, x: jax.Array):
        """`apply_with_ledger` with this seam."""
        return apply_with_ledger(self.seam, state, params, x, self.monitor)

    def fp8(self, params: Any, x: jax.Array, state: Optional[SeamState] = None):
        """The unguarded fp8 computation (`fp8_forward`) with the bound or given state."""
        s = state or self.state
        return _split_output(self.seam, params, fp8_forward(self.seam, params, x, s.scales,
                                                           s.weight_scales if self.seam.recipe.weight == "delayed"
                                                           else None, s.cast))

    def cast_weights(self, state: SeamState, params: Any) -> SeamState:
        """`cast_weights` with this seam."""
        return cast_weights(self.seam, state, params)

    def freeze(self, params: dict) -> FrozenParams:
        """`freeze` with this seam."""
        return freeze(self.seam, params)

    def fold(self, state: SeamState, cot: Any, notify: bool = True) -> SeamState:
        """`fold_state`, then (``notify``) one host callback to the monitor."""
        new = fold_state(self.seam, state, cot)
        if notify:
            self.monitor.notify({self.seam.name: new})
        return new

    def report(self, state: SeamState) -> List[Dict[str, Any]]:
        """`eae_jax.fp8.state.report` of ``state``."""
        return st.report(state, self.seam.name)


def _check_calibration(amax: np.ndarray, describe) -> None:
    """Refuse calibration amaxes ``(..., points)`` that give no scale: non-finite
    (NaN/inf in a sample) or zero (an all-zero sample); ``describe(index)``
    names where (ValueError)."""
    for idx in zip(*np.nonzero(~(np.isfinite(amax) & (amax > 0)))):
        what = "a non-finite" if not np.isfinite(amax[idx]) else "a zero"
        point = ("seam input", "down-projection input")[idx[-1]]
        raise ValueError(f"{describe(idx[:-1])} gives {what} amax at the {point} ({amax[idx[:-1]].tolist()}); "
                         "calibration needs non-empty, non-zero, finite samples")


def bind(seam: Seam, params: Any, calibration_inputs: Any, residuals: Any = None, *, percentile: float = 99.9,
         gate_cos: Optional[float] = None, scales: Any = None) -> BoundSeam:
    """Calibrate, build and gate an fp8 seam on ``calibration_inputs`` (one array
    or a list ``(..., K)``: what the seam sees). ``residuals`` (1:1 with them):
    the residual stream the output is added to, the gate then measures the
    block boundary ``residual + seam(x)`` (else the harsher bare output).
    ``percentile``: the reduction across samples (100: max); ``gate_cos``:
    the threshold (default the guard's; 0: none); ``scales``: overrides.
    Raises ValueError for samples or params it cannot use (none, empty, a zero
    or non-finite amax, widths or residuals that do not fit, non-finite
    weights) and `GateRefused` when the worst cosine is under the threshold.

    >>> from eae_jax.fp8 import out_proj_seam
    >>> bind(out_proj_seam(), {"wo": jnp.eye(4)}, jnp.arange(1.0, 9.0).reshape(2, 4)).certification.worst_cos > 0.999
    True
    """
    dims, (width, out_w) = seam_dims(seam, params), sl._widths(seam, params)
    samples, res = _samples(calibration_inputs), _samples(residuals)
    if not samples:
        raise ValueError(f"seam {seam.name!r}: bind needs at least one calibration sample")
    for i, s in enumerate(samples):
        if s.ndim < 1 or s.shape[-1] != width or not jnp.issubdtype(s.dtype, jnp.floating):
            raise ValueError(f"seam {seam.name!r}: calibration sample {i} has shape {s.shape} and dtype {s.dtype}; "
                             f"expected float (..., {width})")
        if s.size == 0:
            raise ValueError(f"seam {seam.name!r}: calibration sample {i} of shape {s.shape} has no rows; "
                             "calibration needs non-empty, non-zero samples")
    if residuals is not None and (len(res) != len(samples) or any(
            r.shape != s.shape[:-1] + (out_w,) for r, s in zip(res, samples))):
        raise ValueError(f"seam {seam.name!r}: residuals must align 1:1 with the samples, each shaped like the "
                         f"seam's output (..., {out_w}); got {[r.shape for r in res]}")
    thr = seam.guard.gate_cos if gate_cos is None else float(gate_cos)
    if not 0.0 <= thr <= 1.0:  # NaN fails too
        raise ValueError(f"seam {seam.name!r}: gate_cos must be in [0, 1], got {gate_cos}")
    hp = sl._hp_params(params)
    bad = [f"{n}: {hp[n].dtype}" for n in seam.weights if not jnp.issubdtype(hp[n].dtype, jnp.floating)]
    if bad:
        raise ValueError(f"seam {seam.name!r}: weights must be floating point, got {bad}")
    bad = [n for n in seam.weights if not bool(jnp.all(jnp.isfinite(hp[n])))]
    if bad:
        raise ValueError(f"seam {seam.name!r}: weights {bad} contain NaN or inf; nothing to calibrate")
    amax_fn = jax.jit(functools.partial(sl.amax_points, seam))
    amax = np.stack([np.asarray(amax_fn(params, s)) for s in samples])
    _check_calibration(amax, lambda i: f"seam {seam.name!r}: calibration sample {i[0]}")
    reduced = _reduce_amax(amax, percentile)
    calibrated = scale_from_amax(jnp.asarray(reduced), E4M3, seam.recipe.margin)
    used = calibrated if scales is None else jnp.asarray(scales, jnp.float32)
    if used.shape != (seam.points,):
        raise ValueError(f"seam {seam.name!r} needs {seam.points} scale(s), got shape {used.shape}")
    if not bool(jnp.all(jnp.isfinite(used) & (used > 0))):
        raise ValueError(f"seam {seam.name!r}: scales must be finite and positive, got {np.asarray(used).tolist()}")

    @jax.jit
    def measure(params, x, r, scales_):
        y8, yh = fp8_forward(seam, params, x, scales_), high_precision(seam, params, x)
        bare = sl.cosine(y8, yh)
        boundary = bare if r is None else sl.cosine(r.astype(jnp.float32) + y8.astype(jnp.float32),
                                                 r.astype(jnp.float32) + yh.astype(jnp.float32))
        sat = st.value_stats(x, scales_[0])[1]
        if seam.kind == "swiglu":
            g, u = (linear(x, sl._hp_params(params)[n]).astype(jnp.float32) for n in ("w_gate", "w_up"))
            sat = jnp.maximum(sat, st.value_stats(jax.nn.silu(g) * u, scales_[1])[1])
        return boundary, bare, sat

    got = [[float(v) for v in measure(params, s, res[i] if res else None, used)] for i, s in enumerate(samples)]
    cos, bare, sats = (list(c) for c in zip(*got))
    boundary_name = "block boundary (incl. residual)" if res else "bare seam"
    if thr and not min(cos) >= thr:  # NaN fails too
        raise GateRefused(f"eae_jax.fp8: seam {seam.name!r} refused: worst cosine {min(cos):.6f} < {thr} at the "
                          f"{boundary_name} on {len(samples)} calibration sample(s) (scales "
                          f"{np.asarray(used).tolist()})" + ("" if res else "; pass residuals= to gate at the block "
                                                                            "boundary"), min(cos))
    cert = Certification(seam.name, seam.kind, dims, np.asarray(used).tolist(), np.asarray(calibrated).tolist(),
                         reduced.tolist(), float(percentile), len(samples),
                         [int(np.prod(s.shape[:-1])) for s in samples], min(cos), cos, bare, thr, boundary_name,
                         max(sats), seam.recipe.activation)
    return BoundSeam(seam, init_state(seam, np.asarray(used), params), cert)


def _resolve_seams(seams) -> Dict[str, sl.Seam]:
    """`bind_block`'s ``seams``: None (all), names, or a name -> `Seam` dict."""
    names = bl.SEAM_NAMES if seams is None else [seams] if isinstance(seams, str) else list(seams)
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"seams must be seam names or a dict name -> Seam, got {seams!r}")
    if not isinstance(seams, Mapping):
        return bl.block_seams(names)
    bl.block_seams(names)  # names them if unknown
    bad = [n for n, v in seams.items() if not isinstance(v, sl.Seam)]
    if bad:
        raise ValueError(f"seams {bad} are not Seam objects (make them with block_seams / ffn_seam ...)")
    return dict(seams)


def bind_block(cfg: BlockConfig, params: Any, calibration_inputs: Any,
               seams: Union[None, str, Sequence[str], Dict[str, sl.Seam]] = None, *, percentile: float = 99.9,
               gate_cos: Optional[float] = None, scales: Optional[Dict[str, Any]] = None,
               fallback: str = "block") -> bl.BoundBlock:
    """Calibrate and gate fp8 seams for every layer of a block (``params``: one
    block's or a stack's). ``calibration_inputs``: first-block inputs
    ``(batch, seq, dim)``; ``seams``: from `block_seams` or names (default
    all three); ``percentile`` and ``gate_cos`` as `bind`; ``scales``: per
    seam name ``(depth, points)`` or ``(points,)``; ``fallback``: ``'block'``
    or ``'step'``. ValueError for inputs it cannot calibrate on (empty, a zero
    or non-finite amax at some seam and layer); `GateRefused` lists every
    seam and layer under the gate.

    >>> from eae_jax.blocks import BlockConfig, init_stack
    >>> cfg = BlockConfig(dim=16, num_heads=2, num_kv_heads=1, ffn_hidden_dim=32)
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 16))
    >>> bound = bind_block(cfg, init_stack(jax.random.key(1), cfg, 2), [x], "o", gate_cos=0)
    >>> bound.state["o"].scales.shape
    (2, 1)
    """
    bl._check_fallback(fallback)
    if gate_cos is not None and not 0.0 <= gate_cos <= 1.0:  # NaN fails too
        raise ValueError(f"gate_cos must be in [0, 1], got {gate_cos}")
    seams = _resolve_seams(seams)
    depth = bl._depth_of(cfg, params)
    stacked = bl._as_stacked(cfg, params)
    depth = depth or 1
    samples = _samples(calibration_inputs)
    if not samples:
        raise ValueError("bind_block needs at least one calibration input")
    for i, s in enumerate(samples):
        if s.ndim != 3 or s.shape[-1] != cfg.dim:
            raise ValueError(f"calibration input {i} has shape {s.shape}; expected (batch, seq, {cfg.dim})")
        if s.size == 0:
            raise ValueError(f"calibration input {i} of shape {s.shape} is empty; calibration needs non-empty, "
                             "non-zero samples")
    samples = [s.astype(cfg.compute_dtype) if cfg.compute_dtype is not None else s for s in samples]
    names = list(seams)

    def hp_block(p, x, runner):
        return bl._inner_block(cfg, runner)(bl._cast(cfg, p), x)

    @jax.jit
    def pass_amax(stacked, x):
        def body(h, p):
            amax = {}

            def runner(name, sub, hh):
                if name in seams:
                    amax[name] = sl.amax_points(seams[name], sub, hh)
                return bl._hp(name, sub, hh)

            return hp_block(p, h, runner), dict(amax)

        return jax.lax.scan(body, x, stacked)[1]

    per_sample = [jax.tree_util.tree_map(np.asarray, pass_amax(stacked, s)) for s in samples]
    for n in names:
        _check_calibration(np.stack([a[n] for a in per_sample]),
                             lambda i, n=n: f"seam {n!r} at layer {i[1]}: calibration input {i[0]}")
    reduced = {n: _reduce_amax(np.stack([a[n] for a in per_sample]), percentile) for n in names}
    calibrated = {n: np.asarray(scale_from_amax(jnp.asarray(reduced[n]), E4M3, seams[n].recipe.margin))
                  for n in names}
    used = dict(calibrated)
    for n, s in (scales or {}).items():
        if n not in seams:
            raise ValueError(f"scales given for unknown seam {n!r}; seams are {names}")
        used[n] = np.array(np.broadcast_to(np.asarray(s, np.float32), (depth, seams[n].points)))

    def raw_runner(sc, fp8_names):
        def runner(name, sub, h):
            if name in fp8_names:
                return sl._split_output(seams[name], sub, sl.fp8_forward(seams[name], sub, h, sc[name]))
            return bl._hp(name, sub, h)
        return runner

    @jax.jit
    def pass_gate(stacked, x, used):
        def body(h, xs):
            p, sc = xs
            bare = {}

            def tap(name, sub, hh):
                if name in seams:
                    bare[name] = sl.cosine(sl.fp8_forward(seams[name], sub, hh, sc[name]),
                                           sl.high_precision(seams[name], sub, hh))
                return bl._hp(name, sub, hh)

            y_hp = hp_block(p, h, tap)
            boundary = {n: sl.cosine(hp_block(p, h, raw_runner(sc, (n,))), y_hp) for n in names}
            return y_hp, (boundary, dict(bare), sl.cosine(hp_block(p, h, raw_runner(sc, tuple(names))), y_hp))

        return jax.lax.scan(body, x, (stacked, used))[1]

    gates = [jax.tree_util.tree_map(np.asarray, pass_gate(stacked, s, {n: jnp.asarray(v) for n, v in used.items()}))
             for s in samples]
    boundary = {n: np.stack([g[0][n] for g in gates]).min(axis=0) for n in names}
    bare = {n: np.stack([g[1][n] for g in gates]).min(axis=0) for n in names}
    all_fp8 = np.stack([g[2] for g in gates]).min(axis=0)
    thr = {n: seams[n].guard.gate_cos if gate_cos is None else float(gate_cos) for n in names}
    failures = [(n, i, c) for n in names for i, c in enumerate(boundary[n].tolist()) if thr[n] and not c >= thr[n]]
    if failures:
        raise GateRefused(f"eae_jax.fp8: block seams refused at the block boundary (incl. residual) on {len(samples)} "
                          "calibration sample(s): " + ", ".join(f"{n} at layer {i}: {c:.6f} < {thr[n]}"
                                                                for n, i, c in failures),
                          min(f[2] for f in failures))
    cert = {n: {"seam": n, "kind": seams[n].kind, "depth": depth,
                "dims": sl.seam_dims(seams[n], jax.tree_util.tree_map(lambda a: a[0], stacked[bl._PARAMS_OF[n]])),
                "scales": used[n].tolist(), "calibrated_scales": calibrated[n].tolist(),
                "amax": reduced[n].tolist(), "percentile": float(percentile), "samples": len(samples),
                "rows": [int(np.prod(s.shape[:-1])) for s in samples], "worst_cos": float(boundary[n].min()),
                "worst_cos_per_layer": boundary[n].tolist(), "bare_cos_per_layer": bare[n].tolist(),
                "all_fp8_block_cos_per_layer": all_fp8.tolist(), "gate_cos": thr[n],
                "gate_boundary": "block boundary (incl. residual)", "act_scaling": seams[n].recipe.activation}
            for n in names}
    state = {n: bl._layer_states(seams[n], depth, used[n], stacked[bl._PARAMS_OF[n]]) for n in names}
    return bl.BoundBlock(cfg, seams, state, cert, fallback=fallback)
