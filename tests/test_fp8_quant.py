"""eae_jax.fp8.quant: scales, quantization, `fp8_linear` forward and backward
against float64 references of the same quantized math, its weight sources
(live per channel, live delayed per tensor, cast, frozen), observations, and
that the graph really multiplies fp8 operands."""

import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import needs_gpu, rel_err
from eae_jax import fp8
from eae_jax import observe as O
from eae_jax.fp8 import quant
from jaxpr_walk import all_eqns, ancestors, reads

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _rand(key, shape, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


# ---------------------------------------------------------------------- numpy references
def _np_scale(amax, fmax=448.0):
    return np.float32(amax) * np.float32(1.0 / fmax)


def _q(x, scale, dtype=E4M3):
    """float64 values of numpy's fp8 cast of ``clip(x * (1 / scale))`` (the library's quantization)."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    x32 = np.asarray(x, np.float32) * (np.float32(1.0) / np.asarray(scale, np.float32))
    return np.clip(x32, -fmax, fmax).astype(dtype).astype(np.float64)


def _blocks_np(w):
    return [np.asarray(b, np.float32) for b in (w if isinstance(w, tuple) else (w,))]


def ref_forward(x, w, xs, weight_scale=None):
    """float64 ``x @ w.T`` of the same quantization: per-channel weight scales
    (or the given per-tensor one), float32 GEMM output (no bf16 nudging)."""
    wt = np.concatenate(_blocks_np(w))
    if weight_scale is None:
        ws = _np_scale(np.abs(wt).max(axis=1))
        wq = _q(wt, ws[:, None]) * ws[:, None]
    else:
        wq = _q(wt, weight_scale) * np.float64(weight_scale)
    xs = np.asarray(xs, np.float32)
    return (_q(x, xs) * xs) @ wq.T


def ref_backward(g, x, w, xs, weight_scale=None, grad_scale=None):
    """float64 ``(dx, [dw per block])`` of the fp8 backward: one e5m2 gradient
    (current or given scale); dgrad against w quantized per input channel
    (or the per-tensor forward bytes); wgrad against the e4m3 activations, a
    per-row x scale folded into the gradient."""
    blocks = _blocks_np(w)
    wt, g = np.concatenate(blocks), np.asarray(g, np.float32)
    xs = np.asarray(xs, np.float32)
    gmax = np.abs(g).max()
    s_g = _np_scale(gmax, 57344.0) if grad_scale is None else np.float32(grad_scale)
    gq = _q(g, s_g, E5M2) * np.float64(s_g)
    if weight_scale is None:
        s_col = _np_scale(np.abs(wt).max(axis=0))
        w_d = _q(wt, s_col[None, :]) * s_col[None, :]
    else:
        w_d = _q(wt, weight_scale) * np.float64(weight_scale)
    dx = gq @ w_d
    xq = _q(x, xs)
    if xs.ndim == 0:
        dw = gq.T @ (xq * np.float64(xs))
    else:
        s2 = _np_scale(np.float32(gmax) * xs.max(), 57344.0) if grad_scale is None else np.float32(grad_scale) * xs.max()
        dw = (_q(g * xs, s2, E5M2) * np.float64(s2)).T @ xq
    cuts = np.cumsum([b.shape[0] for b in blocks])[:-1]
    return dx, np.split(dw, cuts, axis=0)


# ---------------------------------------------------------------------- scales and quantization
def test_fp8_max_and_format_names():
    assert fp8.fp8_max(jnp.float8_e4m3fn) == fp8.fp8_max("e4m3") == fp8.fp8_max("fp8_e4m3") == 448.0
    assert fp8.fp8_max(jnp.float8_e5m2) == fp8.fp8_max("fp8_e5m2") == 57344.0
    assert fp8.quantize(jnp.ones((2,)), 1.0, "fp8_e5m2").dtype == jnp.float8_e5m2
    for bad in (jnp.bfloat16, "bf16"):
        with pytest.raises(ValueError, match="is not an fp8 format"):
            fp8.fp8_max(bad)


def test_scale_from_amax():
    s = np.asarray(fp8.scale_from_amax(jnp.array([448.0, 4.48, 0.0, jnp.nan, jnp.inf])))
    np.testing.assert_allclose(s[:2], [1.0, 0.01], rtol=1e-6)
    np.testing.assert_array_equal(s[2:], [1.0, 1.0, 1.0])  # nothing to scale / nothing trustworthy
    np.testing.assert_allclose(fp8.scale_from_amax(jnp.array(448.0), margin=1.0), 2.0)
    np.testing.assert_allclose(fp8.scale_from_amax(jnp.array(57344.0), "e5m2"), 1.0)
    # The float32 factor of the convention: equal to numpy's, bit for bit.
    amax = np.float32(3.3)
    assert float(fp8.scale_from_amax(amax, margin=2)) == amax * np.float32(4.0 / 448.0)


@pytest.mark.parametrize("amax", [1e-36, 1e-38, 3e-39])
def test_tiny_amax_gives_a_finite_positive_scale(amax):
    scale = float(fp8.scale_from_amax(jnp.float32(amax)))
    assert 0.0 < scale < np.inf and np.isfinite(1.0 / scale)


@pytest.mark.parametrize("dtype,ml", [(jnp.float8_e4m3fn, E4M3), (jnp.float8_e5m2, E5M2)])
def test_quantize_matches_numpy_cast_and_saturates(dtype, ml):
    x = np.array([0.0, 1.0, -3.3, 1e-3, 500.0, -1e6, np.nan], np.float32)
    q = np.asarray(fp8.quantize(jnp.asarray(x), np.float32(0.5), dtype).astype(jnp.float32))
    fmax = float(ml_dtypes.finfo(ml).max)
    np.testing.assert_array_equal(q, np.clip(x / np.float32(0.5), -fmax, fmax).astype(ml).astype(np.float32))
    assert q[4] == (448.0 if fmax == 448.0 else 1024.0)  # 1000 saturates in e4m3, rounds to 1024 in e5m2
    assert q[5] == -fmax and np.isnan(q[6])  # saturated, not NaN; NaN stays NaN
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(fp8.quantize(jnp.asarray(x[:5]), 0.5, dtype), 0.5)),
                                  q[:5] * 0.5)


# ---------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 2e-6), (jnp.bfloat16, 8e-3)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_linear_forward_matches_float64_reference(dtype, rtol, per_row, per_tensor):
    x = _rand(0, (24, 48), 2.0, dtype)
    # output channels 15 binades apart: a per-tensor scale pushes the small
    # ones into e4m3's subnormals, a per-channel one does not
    w = (_rand(1, (40, 48), 0.1) * jnp.geomspace(1e-4, 3.0, 40)[:, None]).astype(dtype)
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else fp8.scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))))
    ws = fp8.scale_from_amax(quant.weight_amax(w))
    y = fp8.fp8_linear(x, fp8.LiveWeight((w,), ws) if per_tensor else w, xs)
    assert y.dtype == dtype and y.shape == (24, 40)
    # bf16 outputs quantize x at output_scale's nudged scale (per-tensor scales only)
    xs_used = quant.output_scale(xs, ws, dtype)[1] if per_tensor else xs
    ref = ref_forward(x, w, xs_used, np.float32(ws) if per_tensor else None)
    other = ref_forward(x, w, xs_used, None if per_tensor else np.float32(ws))
    col_max = np.abs(ref).max(axis=0, keepdims=True)  # tolerance per output channel
    assert (np.abs(other - ref) / col_max).max() > 10 * rtol  # the two scalings are distinguishable
    assert (np.abs(np.asarray(y, np.float64) - ref) / col_max).max() <= 2 * rtol
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T  # an fp8 approximation, not the product
    assert 1e-3 < rel_err(y, exact) < 0.08


@pytest.mark.parametrize("rows", [(40,), (16, 24), (8, 16, 16)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_weight_blocks_are_their_concatenation_bit_for_bit(rows, per_row, per_tensor):
    # Row blocks (gate and up; q, k and v) equal their concatenation exactly:
    # every scale is per row of the weight, per column over all blocks, or one.
    x = _rand(0, (24, 48), 2.0, jnp.bfloat16)
    blocks = tuple(_rand(10 + i, (n, 48), 0.1 * (i + 1), jnp.bfloat16) for i, n in enumerate(rows))
    whole = jnp.concatenate(blocks, axis=0)
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.02)
    ws = fp8.scale_from_amax(quant.weight_amax(blocks)) if per_tensor else None
    g = _rand(3, (24, sum(rows)), 1e-2, jnp.bfloat16)
    y_b, vjp_b = jax.vjp(lambda a, ws_: fp8.fp8_linear(a, fp8.LiveWeight(ws_, ws), xs), x, blocks)
    y_w, vjp_w = jax.vjp(lambda a, w_: fp8.fp8_linear(a, fp8.LiveWeight((w_,), ws), xs), x, whole)
    chex.assert_trees_all_equal(y_b, y_w)
    (dx_b, dws_b), (dx_w, dw_w) = vjp_b(g), vjp_w(g)
    chex.assert_trees_all_equal(dx_b, dx_w)
    assert isinstance(dws_b, tuple) and [d.shape for d in dws_b] == [b.shape for b in blocks]
    chex.assert_trees_all_equal(jnp.concatenate(dws_b), dw_w)
    if per_tensor:
        return  # one scale spans the blocks: they are joined as the quantizing pass's operand
    jaxpr = jax.make_jaxpr(lambda x_, ws_: jax.vjp(lambda a, b: fp8.fp8_linear(a, b, xs), x_, ws_)[1](g))(x, blocks)
    concats = {tuple(e.outvars[0].aval.shape) + (str(e.outvars[0].aval.dtype),)
               for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "concatenate"}
    assert (sum(rows), 48, "bfloat16") not in concats and (48, sum(rows), "bfloat16") not in concats
    if len(rows) > 1:  # the fp8 bytes are what is joined (forward and dgrad layouts)
        assert {(sum(rows), 48, "float8_e4m3fn"), (48, sum(rows), "float8_e4m3fn")} <= concats


# ---------------------------------------------------------------------- backward
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("delayed", [False, True])
def test_fp8_linear_backward_matches_float64_reference(per_row, per_tensor, delayed):
    """dx and the blocks' dw against float64 products of the same fp8 codes;
    the observer's cotangent holds the gradient amax (and a per-tensor live
    weight's amax); x_scale and the scales get zero cotangents."""
    x, g = _rand(0, (32, 48), 1.5), _rand(2, (32, 24), 1e-3)
    blocks = (_rand(1, (16, 48), 0.2), _rand(4, (8, 48), 0.05) * jnp.linspace(0.1, 2.0, 48)[None, :])
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.01)
    ws = fp8.scale_from_amax(quant.weight_amax(blocks)) if per_tensor else None
    gmax = float(jnp.max(jnp.abs(g)))
    gs = np.float32(gmax / 2 / 57344.0) if delayed else None  # delayed: half the range, the top saturates
    h = fp8.linear_observer()

    def f(x_, b_, xs_, h_):
        return fp8.fp8_linear(x_, fp8.LiveWeight(b_, ws), xs_, grad_scale=gs, observer=h_)

    dx, dws, dxs, dh = jax.vjp(f, x, blocks, xs, h)[1](g)
    ref_dx, ref_dw = ref_backward(g, x, blocks, xs, None if ws is None else np.float32(ws), gs)
    exact_dx = np.asarray(g, np.float64) @ np.concatenate(_blocks_np(blocks))
    assert rel_err(dx, ref_dx) < 1e-5 < 1e-2 < rel_err(ref_dx, exact_dx)  # the same math, and fp8 math
    for got, want in zip(dws, ref_dw):
        assert rel_err(got, want) < 1e-5
    assert not np.any(np.asarray(dxs))
    seen, calls = O.receive(h, dh)
    assert float(calls) == 1.0
    np.testing.assert_allclose(float(seen["grad"]), gmax, rtol=1e-7)
    assert float(seen["weight"]) == (float(quant.weight_amax(blocks)) if per_tensor else 0.0)


def test_delayed_grad_scale_equal_to_current_gives_identical_gradients():
    x, w, g = _rand(0, (32, 48), 1.5), _rand(1, (16, 48), 0.2), _rand(2, (32, 16), 1e-3)
    xs = jnp.float32(0.01)
    current = jax.vjp(lambda a, b: fp8.fp8_linear(a, b, xs), x, w)[1](g)
    gs = fp8.scale_from_amax(jnp.max(jnp.abs(g)), "e5m2")
    delayed = jax.vjp(lambda a, b: fp8.fp8_linear(a, b, xs, grad_scale=gs), x, w)[1](g)
    chex.assert_trees_all_equal(current, delayed)


def test_frozen_weight_backward_folds_its_channel_scale_into_the_gradient():
    x, w, g = _rand(0, (32, 48), 1.5), _rand(1, (16, 48), 0.2), _rand(2, (32, 16), 1e-3)
    xs = jnp.float32(0.01)
    frozen = fp8.quantize_weight(w)
    dx, dfrozen = jax.vjp(lambda a, f: fp8.fp8_linear(a, f, xs), x, frozen)[1](g)
    ws = np.asarray(frozen.scale)
    s1 = _np_scale(np.abs(np.asarray(g)).max() * ws.max(), 57344.0)
    g1 = _q(np.asarray(g) * ws[None, :], s1, E5M2)
    ref = (g1 @ np.asarray(frozen.q.astype(jnp.float32), np.float64)) * np.float64(s1)
    assert rel_err(dx, ref) < 1e-5
    assert not np.any(np.asarray(dfrozen.q, np.float32)) and not np.any(np.asarray(dfrozen.scale))
    # delayed: the given scale times the largest folded factor
    gs = np.float32(np.abs(np.asarray(g)).max() / 3 / 57344.0)  # a third of the range: the top saturates
    dx_d = jax.vjp(lambda a: fp8.fp8_linear(a, frozen, xs, grad_scale=gs), x)[1](g)[0]
    s2 = gs * np.float32(ws.max())
    ref_d = (_q(np.asarray(g) * ws[None, :], s2, E5M2) @ np.asarray(frozen.q.astype(jnp.float32), np.float64)) * s2
    assert rel_err(dx_d, ref_d) < 1e-5 and rel_err(ref_d, ref) > 1e-2
    # the frozen forward is the live per-channel one
    chex.assert_trees_all_equal(fp8.fp8_linear(x, frozen, xs), fp8.fp8_linear(x, w, xs))


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("rows", [(24,), (16, 8)])
def test_cast_weight_equals_the_live_delayed_weight(per_row, rows):
    """Output, dx, dw and the observations of cast bytes equal the live delayed
    call's, at a scale below the weight's amax (saturating) too; the bytes,
    scale and amax get zero cotangents."""
    x = _rand(0, (32, 48), 1.0, jnp.bfloat16)
    blocks = tuple(_rand(1 + i, (r, 48), 0.05 * (i + 1), jnp.bfloat16) for i, r in enumerate(rows))
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.01)
    scale = fp8.scale_from_amax(quant.weight_amax(blocks)) * 0.75
    cast = fp8.cast_weight(blocks, scale)
    assert cast.q.dtype == jnp.float8_e4m3fn and cast.q.shape == (sum(rows), 48)
    np.testing.assert_allclose(float(cast.amax), max(np.abs(np.asarray(b, np.float64)).max() for b in blocks),
                               rtol=1e-6)
    g = _rand(9, (32, sum(rows)), 1.0, jnp.bfloat16)
    h = fp8.linear_observer()
    y_l, vjp_l = jax.vjp(lambda b, h_: fp8.fp8_linear(x, fp8.LiveWeight(b, scale), xs, observer=h_), blocks, h)
    y_c, vjp_c = jax.vjp(lambda c, h_: fp8.fp8_linear(x, c, xs, observer=h_), cast, h)
    chex.assert_trees_all_equal(y_c, y_l)
    (db_l, dh_l), (dc, dh_c) = vjp_l(g), vjp_c(g)
    chex.assert_trees_all_equal(dc.blocks, db_l)
    chex.assert_trees_all_equal(O.receive(h, dh_c), O.receive(h, dh_l))
    assert not np.any(np.asarray(dc.q, np.float32)) and float(dc.amax) == 0.0 and float(dc.scale) == 0.0


def test_delayed_weight_quantization_does_not_wait_for_a_weight_reduction():
    """No e4m3 weight in the forward depends on a reduce_max over the weight
    with a given (delayed) per-tensor scale; with per-channel scales it does."""
    x, w = _rand(0, (16, 32)), _rand(1, (8, 32), 0.1)

    def waits(scale):
        jaxpr = jax.make_jaxpr(lambda w_: jax.vjp(
            lambda v: fp8.fp8_linear(x, fp8.LiveWeight((v,), scale), jnp.float32(0.01)), w_)[0])(w).jaxpr
        wq = [v for e in jaxpr.eqns for v in e.outvars if v.aval.dtype == jnp.float8_e4m3fn and v.aval.shape == w.shape]
        assert wq, "no e4m3 weight in the forward"
        return any(e.primitive.name == "reduce_max" and reads(jaxpr, e, jaxpr.invars[0]) for e in ancestors(jaxpr, *wq))

    assert waits(None) and not waits(jnp.float32(1e-3))


@pytest.mark.parametrize("delayed", [False, True])
def test_delayed_gradient_quantization_does_not_wait_for_the_gradient_amax(delayed):
    x, w, g = _rand(0, (16, 32)), _rand(1, (8, 32), 0.1), _rand(2, (16, 8))

    def bwd(x_, w_, g_):
        f = lambda a, b: fp8.fp8_linear(a, b, jnp.float32(0.01), grad_scale=jnp.float32(1e-4) if delayed else None,
                                        observer=fp8.linear_observer())
        return jax.vjp(f, x_, w_)[1](g_)

    jaxpr = jax.make_jaxpr(bwd)(x, w, g).jaxpr
    e5m2 = [v for e in jaxpr.eqns for v in e.outvars if v.aval.dtype == jnp.float8_e5m2]
    assert e5m2, "no e5m2 gradient in the backward"
    for v in e5m2:
        waits = [e for e in ancestors(jaxpr, v) if e.primitive.name == "reduce_max" and reads(jaxpr, e, jaxpr.invars[2])]
        assert bool(waits) == (not delayed)


def test_tiny_and_unobserved_gradient_scales_stay_finite():
    """amax/57344 flushed to 0 (1/scale = inf made zeros NaN); a delayed scale
    of 0 (never observed) saturates instead of dividing by zero."""
    x, w = _rand(0, (16, 32)), _rand(1, (24, 32), 0.1)
    xs = fp8.scale_from_amax(jnp.max(jnp.abs(x)))
    for gs in (None, jnp.float32(0.0)):
        dx, dw = jax.vjp(lambda a, b: fp8.fp8_linear(a, b, xs, grad_scale=gs), x, w)[1](
            jnp.full((16, 24), 1e-36 if gs is None else 1.0, jnp.float32))
        assert bool(jnp.all(jnp.isfinite(dx))) and bool(jnp.all(jnp.isfinite(dw)))


@pytest.mark.parametrize("fast_accum,n_highest", [((True, True), 0), ((True, False), 2), ((False, False), 3)])
def test_fast_accum_flags_set_the_dot_precision(fast_accum, n_highest):
    x, w = _rand(0, (8, 32), 1.0, jnp.bfloat16), _rand(1, (16, 32), 0.3, jnp.bfloat16)
    loss = lambda x, w: jnp.sum(fp8.fp8_linear(x, w, jnp.float32(0.01), fast_accum=fast_accum).astype(jnp.float32))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = [ln for ln in text.splitlines() if "dot_general" in ln and "f8E" in ln]
    assert len(dots) == 3 and sum("HIGHEST" in ln for ln in dots) == n_highest


@pytest.mark.parametrize("per_tensor,user", [
    (True, ("mul", jnp.bfloat16)),  # the bf16-exact output scale, multiplied in bf16
    (False, ("convert_element_type", jnp.float32)),  # per-channel scales: a float32 multiply
])
def test_forward_gemm_output_scaling_form(per_tensor, user):
    x = _rand(0, (16, 32), 1.0, jnp.bfloat16)
    w = _rand(1, (24, 32), 0.1, jnp.bfloat16)
    src = fp8.LiveWeight((w,), jnp.float32(0.1 / 448) if per_tensor else None)
    eqns = list(all_eqns(jax.make_jaxpr(lambda x: fp8.fp8_linear(x, src, jnp.float32(0.01)))(x).jaxpr))
    (dot,) = [e for e in eqns if e.primitive.name == "dot_general"]
    users = [e for e in eqns if any(v is dot.outvars[0] for v in e.invars)]
    assert len(users) == 1 and (users[0].primitive.name, users[0].outvars[0].aval.dtype) == user


@pytest.mark.parametrize("weight_dtype,per_row,user", [
    (jnp.bfloat16, False, ("mul", jnp.bfloat16)),
    (jnp.float32, False, ("mul", jnp.float32)),  # a float32 GEMM output, multiplied in float32
    (jnp.bfloat16, True, ("convert_element_type", jnp.float32)),  # the folded per-row scale is not bf16-exact
])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_wgrad_output_is_scaled_in_bf16(per_tensor, weight_dtype, per_row, user):
    """With a per-tensor activation scale each wgrad GEMM's bf16 output is
    multiplied by a bf16 scalar (the form XLA folds into the GEMM); one GEMM per block."""
    x = _rand(0, (16, 32), 1.0, jnp.bfloat16)
    x_scale = jnp.linspace(0.005, 0.02, 16, dtype=jnp.float32)[:, None] if per_row else jnp.float32(0.01)
    blocks = (_rand(1, (24, 32), 0.1, weight_dtype), _rand(2, (8, 32), 0.1, weight_dtype))
    ws = jnp.float32(0.1 / 448) if per_tensor else None
    loss = lambda b: jnp.sum(fp8.fp8_linear(x, fp8.LiveWeight(b, ws), x_scale, grad_scale=jnp.float32(1e-4))
                             .astype(jnp.float32))
    assert [g.shape for g in jax.grad(loss)(blocks)] == [(24, 32), (8, 32)]
    eqns = list(all_eqns(jax.make_jaxpr(jax.grad(loss))(blocks).jaxpr))
    wgrads = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape in ((24, 32), (8, 32))]
    assert len(wgrads) == 2
    for e in wgrads:
        users = [u for u in eqns if any(v is e.outvars[0] for v in u.invars)]
        assert len(users) == 1 and (users[0].primitive.name, users[0].outvars[0].aval.dtype) == user


def test_output_scale_is_bf16_exact_and_never_shrinks_the_range():
    rng = np.random.default_rng(0)
    xs = np.exp(rng.uniform(-12, 4, 400)).astype(np.float32)
    ws = np.exp(rng.uniform(-14, 2, 400)).astype(np.float32)
    xs[:3], ws[:3] = [2.0 ** -5, 0.25, 1.0], [2.0 ** -9, 3.0, 0.0078125]  # already exact products
    for x_s, w_s in zip(xs, ws):
        c, xq_s = (np.float64(v) for v in quant.output_scale(jnp.float32(x_s), jnp.float32(w_s), jnp.bfloat16))
        exact = np.float64(np.float32(x_s) * np.float32(w_s))
        assert np.float32(c) == np.float32(ml_dtypes.bfloat16(c))  # bf16-representable
        assert exact <= c <= exact * (1 + 2.0 ** -7) and x_s <= xq_s <= x_s * (1 + 2.0 ** -7)
        np.testing.assert_allclose(xq_s * w_s, c, rtol=1e-6)
        if c == exact:  # at equality nothing moves: the same quantization as before
            assert xq_s == x_s
    rows = jnp.full((4, 1), 0.3, jnp.float32)  # per-row scales and non-bf16 outputs are left alone
    c, used = quant.output_scale(rows, jnp.float32(0.7), jnp.bfloat16)
    np.testing.assert_array_equal(used, rows)
    np.testing.assert_allclose(c, rows * np.float32(0.7))
    c, used = quant.output_scale(jnp.float32(0.3), jnp.float32(0.7), jnp.float32)
    assert float(used) == np.float32(0.3) and float(c) == float(jnp.float32(0.3) * jnp.float32(0.7))


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("call, match", [
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), jnp.ones((3, 9)), 1.0), "do not fit weight"),
    (lambda: fp8.fp8_linear(jnp.ones((2, 4, 8)), jnp.ones((3, 8)), 1.0), "2-D activations"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), jnp.ones((3, 8)), jnp.ones((3,))), "x_scale"),
    (lambda: fp8.fp8_matmul(jnp.ones((4, 8)), jnp.ones((3, 8)), jnp.float32), "fp8 operands"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 8)), 1.0), "float32/bfloat16/float16 activ"),
    (lambda: fp8.fp8_linear(jnp.ones((0, 8)), jnp.ones((8, 8)), 1.0), "no rows"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), jnp.ones((8, 8), jnp.int32), 1.0), "live weight must be"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), (jnp.ones((3, 8)), jnp.ones((3, 9))), 1.0), "do not fit weight"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), (jnp.ones((3, 8)), jnp.ones((3, 8), jnp.bfloat16)), 1.0), "one dtype"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), (), 1.0), "one or more"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), jnp.ones((3, 8)), 1.0, grad_scale=jnp.ones((2,))),
     "grad_scale must be a float32 scalar"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), fp8.LiveWeight((jnp.ones((3, 8)),), jnp.ones((2,))), 1.0),
     r"per-tensor weight scale must be a float32 scalar, got shape \(2,\)"),
    (lambda: fp8.fp8_linear(jnp.ones((4, 8)), jnp.ones((3, 8)), 1.0, observer=O.handle({"n": jnp.zeros(())})),
     "observer must be one linear_observer"),
])
def test_fp8_linear_refuses_what_it_cannot_run(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_cast_bytes_are_refused():
    x, w = _rand(0, (4, 8)), _rand(1, (6, 8))
    cast = fp8.cast_weight(w, jnp.float32(0.01))
    for bad in (cast._replace(q=cast.q[:5]), cast._replace(q=cast.q.astype(jnp.float8_e5m2)),
                cast._replace(amax=jnp.ones((2,)))):
        with pytest.raises(ValueError, match="cast bytes must be float8_e4m3fn of shape"):
            fp8.fp8_linear(x, bad, 1.0)
    with pytest.raises(ValueError, match="must be a scalar"):
        fp8.cast_weight(w, jnp.ones((2,)))


# ---------------------------------------------------------------------- the graph
def _dot_operand_types(text):
    """(lhs, rhs) element types of every stablehlo.dot_general in lowered text."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            out.append(tuple(re.findall(r"tensor<[0-9x]*x?([a-zA-Z0-9]+)>", line.split(":")[-1])[:2]))
    return out


@pytest.mark.parametrize("source", ["channel", "delayed", "cast", "frozen"])
def test_graph_multiplies_fp8_operands_forward_and_backward(source):
    """Every dot_general has fp8 operands, forward and backward (e5m2 x e4m3):
    never quantize -> dequantize -> bf16 dots."""
    x, blocks = _rand(1, (32, 64), 1.0, jnp.bfloat16), (_rand(2, (48, 64), 0.1, jnp.bfloat16),
                                                         _rand(3, (16, 64), 0.1, jnp.bfloat16))
    scale = jnp.float32(0.3 / 448)
    w = {"channel": fp8.LiveWeight(blocks), "delayed": fp8.LiveWeight(blocks, scale),
         "cast": fp8.cast_weight(blocks, scale), "frozen": fp8.quantize_weight(blocks)}[source]
    loss = lambda w_, x_: jnp.sum(fp8.fp8_linear(x_, w_, jnp.float32(0.01)).astype(jnp.float32))
    both = _dot_operand_types(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(w, x).as_text())
    wgrads = [] if source == "frozen" else [("f8E5M2", "f8E4M3FN")] * 2  # one per block
    assert sorted(both) == sorted([("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN")] + wgrads), both


@pytest.mark.parametrize("weight", [pytest.param(w, marks=needs_gpu) for w in ("channel", "delayed")])
def test_compiled_hlo_has_cublaslt_fp8_gemm(weight):
    dev = jax.devices()[0]
    if float(getattr(dev, "compute_capability", "0") or 0) < 8.9:
        pytest.skip("GPU without fp8 GEMMs")
    from eae_jax.blocks import init_swiglu

    # The 1B-like FFN shape: at small shapes XLA may keep a GEMM in bf16.
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(0), 2048, 5632))
    x = _rand(1, (8192, 2048), 1.0, jnp.bfloat16)
    seam = fp8.ffn_seam(weight=weight)
    state = fp8.init_state(seam, [0.01, 0.01], p)
    fwd = jax.jit(lambda p, x: fp8.apply(seam, state, p, x)).lower(p, x).compile().as_text()
    loss = lambda p, x: jnp.sum(fp8.apply(seam, state, p, x).astype(jnp.float32) * 0.5)
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(p, x).compile().as_text()
    assert fwd.count("__cublas$lt$matmul$f8") >= 2 and both.count("__cublas$lt$matmul$f8") >= 6
