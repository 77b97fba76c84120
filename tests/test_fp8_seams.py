"""eae_jax.fp8.seams: binding (calibrated scales, the gate, the certification),
the seam's numerics and gradients against float64 references of the same
quantized math, every guard path, counts and observations through the
state's handles (jit, grad, checkpoint, vmap, microbatches), gradient and
weight scaling, cast and frozen weights, and refusals."""

import warnings

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import rel_err
from eae_jax import fp8
from eae_jax import observe as O
from eae_jax.blocks import init_attention, init_swiglu, rms_norm, swiglu
from eae_jax.fp8 import quant

D, F, ROWS = 64, 128, 32
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _ffn_params(dtype=jnp.float32):
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), init_swiglu(jax.random.key(0), D, F))


def _samples(n, dtype=jnp.float32, rows=ROWS):
    xs = jax.random.normal(jax.random.key(7), (n, rows, D))
    hs = rms_norm({"scale": jnp.ones((D,))}, xs).astype(dtype)
    return [hs[i] for i in range(n)], [xs[i].astype(dtype) for i in range(n)]


@pytest.fixture(scope="module")
def bf16():
    """bf16 FFN params, three inputs, a seam bound on the first two (no gate)."""
    p = _ffn_params(jnp.bfloat16)
    hs, res = _samples(3, jnp.bfloat16)
    return p, hs, res, fp8.bind(fp8.ffn_seam(), p, hs[:2], gate_cos=0)


def _run(seam, state, p, x):
    y, obs = jax.jit(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x))(state, p, x)
    return np.asarray(y.astype(jnp.float32)), fp8.fold_state(seam, state, obs)


def _reason(state):
    e = fp8.report(state)[0]
    assert e["calls"] == 1 and len(e["by_reason"]) <= 1
    return next(iter(e["by_reason"]), None)


def _hp(p, x):
    return np.asarray(swiglu(p, x).astype(jnp.float32))


# ---------------------------------------------------------------------- numpy reference of the FFN seam
def _q(x, scale, dtype=E4M3):
    fmax = float(ml_dtypes.finfo(dtype).max)
    x32 = np.asarray(x, np.float32) * (np.float32(1.0) / np.asarray(scale, np.float32))
    return np.clip(x32, -fmax, fmax).astype(dtype).astype(np.float64)


def _np_scale(amax, fmax=448.0):
    return np.float32(amax) * np.float32(1.0 / fmax)


def _np_weight(w, per_tensor):
    """(float64 dequantized forward weight, float64 dequantized dgrad weight)."""
    w = np.asarray(w, np.float32)
    if per_tensor:
        s = _np_scale(np.abs(w).max())
        wq = _q(w, s) * np.float64(s)
        return wq, wq
    s_row, s_col = _np_scale(np.abs(w).max(axis=1))[:, None], _np_scale(np.abs(w).max(axis=0))[None, :]
    return _q(w, s_row) * s_row, _q(w, s_col) * s_col


def ffn_reference(p, x, sx, sh, ct, per_tensor):
    """float64 forward and gradients of the fp8 SwiGLU seam with float32
    params and activations: the same quantizations (e4m3 forward, current
    e5m2 gradients, per-channel or per-tensor weights), products in float64."""
    w1 = np.concatenate([np.asarray(p["w_gate"], np.float32), np.asarray(p["w_up"], np.float32)])
    (w1f, w1d), (w2f, w2d) = _np_weight(w1, per_tensor), _np_weight(p["w_down"], per_tensor)
    xq = _q(x, sx) * np.float64(sx)
    a = (xq @ w1f.T).astype(np.float32).astype(np.float64)
    g, u = a[:, :F], a[:, F:]
    sig = 1 / (1 + np.exp(-g))
    hid = (g * sig * u).astype(np.float32)
    hq = _q(hid, sh) * np.float64(sh)
    y = hq @ w2f.T
    ct = np.asarray(ct, np.float32)
    s2 = _np_scale(np.abs(ct).max(), 57344.0)
    g2 = _q(ct, s2, E5M2) * np.float64(s2)
    dw_down = g2.T @ hq
    dhid = (g2 @ w2d).astype(np.float32).astype(np.float64)
    ga = np.concatenate([dhid * u * (sig * (1 + g * (1 - sig))), dhid * g * sig], axis=1).astype(np.float32)
    s1 = _np_scale(np.abs(ga).max(), 57344.0)
    g1 = _q(ga, s1, E5M2) * np.float64(s1)
    dx = g1 @ w1d
    dw1 = g1.T @ xq
    return y, {"x": dx, "w_gate": dw1[:F], "w_up": dw1[F:], "w_down": dw_down}


@pytest.mark.parametrize("weight", ["channel", "delayed"])
def test_ffn_seam_forward_and_gradients_match_float64_reference(weight):
    """The seam's output and every gradient against the float64 reference of
    the same quantized math; fp8 math (not the exact product) on both sides."""
    p = _ffn_params()
    hs, _ = _samples(1)
    x = hs[0]
    seam = fp8.ffn_seam(weight=weight, check_values=False)
    sx, sh = np.float32(0.9 * float(jnp.max(jnp.abs(x))) / 448), np.float32(0.02)
    state = fp8.init_state(seam, [sx, sh], p)
    ct = jax.random.normal(jax.random.key(5), (ROWS, D)) * 1e-2

    def loss(p_, x_):
        return jnp.sum(fp8.apply(seam, state, p_, x_) * ct)

    y = jax.jit(lambda p_, x_: fp8.apply(seam, state, p_, x_))(p, x)
    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)
    ref_y, ref = ffn_reference(p, x, sx, sh, ct, per_tensor=weight == "delayed")
    assert rel_err(y, ref_y) < 1e-5
    got = {"x": gx, **gp}
    exact = jax.grad(lambda p_, x_: jnp.sum(swiglu(p_, x_) * ct), argnums=(0, 1))(p, x)
    exact = {"x": exact[1], **exact[0]}
    for name, want in ref.items():
        # an element near an e5m2 rounding boundary may round the other way
        # after float32 sums in another order: 1e-3 against fp8's ~3e-2
        assert rel_err(got[name], want) < 1e-3, name
        assert rel_err(want, exact[name]) > 1e-2, name


def test_dense_seam_gradients_match_float64_reference():
    p = init_attention(jax.random.key(3), D, 4, 2)
    p = {k: p[k] for k in ("wq", "wk", "wv")}
    hs, _ = _samples(1)
    seam = fp8.qkv_seam(check_values=False)
    state = fp8.init_state(seam, [0.01])
    ct = jax.random.normal(jax.random.key(6), (ROWS, 2 * D)) * 1e-2
    loss = lambda p_, x_: jnp.sum(jnp.concatenate(fp8.apply(seam, state, p_, x_), axis=-1) * ct)
    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, hs[0])
    w = np.concatenate([np.asarray(p[n], np.float32) for n in ("wq", "wk", "wv")])
    _, w_d = _np_weight(w, False)
    s_g = _np_scale(np.abs(np.asarray(ct)).max(), 57344.0)
    gq = _q(ct, s_g, E5M2) * np.float64(s_g)
    assert rel_err(gx, gq @ w_d) < 1e-5
    dw = gq.T @ (_q(hs[0], np.float32(0.01)) * np.float64(np.float32(0.01)))
    assert rel_err(jnp.concatenate([gp["wq"], gp["wk"], gp["wv"]]), dw) < 1e-5


# ---------------------------------------------------------------------- binding
@pytest.mark.parametrize("percentile", [100.0, 50.0, 99.9])
def test_scales_are_percentile_of_sample_amax_over_448(percentile):
    p = _ffn_params()
    hs, _ = _samples(5)
    bound = fp8.bind(fp8.ffn_seam(), p, hs, percentile=percentile, gate_cos=0)

    def points(h):
        h = np.asarray(h, np.float64)
        g, u = h @ np.asarray(p["w_gate"], np.float64).T, h @ np.asarray(p["w_up"], np.float64).T
        return np.abs(h).max(), np.abs(g / (1 + np.exp(-g)) * u).max()

    amax = np.array([points(h) for h in hs])  # (samples, points), float64 reference
    expect = np.percentile(amax, percentile, axis=0) / 448.0
    np.testing.assert_allclose(bound.certification.scales, expect, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(bound.state.scales), expect, rtol=2e-5)
    if percentile == 100.0:
        np.testing.assert_allclose(bound.certification.amax, amax.max(axis=0), rtol=2e-5)


@pytest.mark.parametrize("weight", ["channel", "delayed"])
def test_gate_passes_and_certifies(bf16, weight):
    p, hs, res, _ = bf16
    bound = fp8.bind(fp8.ffn_seam(weight=weight), p, hs, residuals=res)
    cert = bound.certification
    assert (cert.seam, cert.kind, cert.dims) == ("ffn", "swiglu", {"D": D, "F": F})
    assert cert.samples == 3 and cert.rows == [ROWS] * 3 and cert.percentile == 99.9
    assert cert.gate_boundary.startswith("block boundary")
    assert cert.worst_cos == min(cert.cosines) >= 0.999
    # the residual boundary is gentler than the bare seam output, which is still a decent fp8 result
    assert all(b < c for b, c in zip(cert.bare_cosines, cert.cosines)) and min(cert.bare_cosines) > 0.99
    assert cert.max_saturation < 1e-3
    assert set(cert.as_dict()) >= {"dims", "scales", "worst_cos", "samples", "percentile"}
    # the weights' per-tensor scales start from the weights
    want = [max(np.abs(np.asarray(p[n], np.float64)).max() for n in ("w_gate", "w_up")),
            np.abs(np.asarray(p["w_down"], np.float64)).max()]
    np.testing.assert_allclose(np.asarray(bound.state.weight_scales), np.array(want) / 448, rtol=1e-6)


def test_gate_at_its_threshold_and_deliberately_broken_scales(bf16):
    p, hs, res, _ = bf16
    good = fp8.bind(fp8.ffn_seam(), p, hs, residuals=res)
    worst = good.certification.worst_cos
    fp8.bind(fp8.ffn_seam(), p, hs, residuals=res, gate_cos=worst)  # at equality: passes
    with pytest.raises(fp8.GateRefused, match="worst cosine"):
        fp8.bind(fp8.ffn_seam(), p, hs, residuals=res, gate_cos=float(np.nextafter(worst, 2.0)))
    with pytest.raises(fp8.GateRefused) as info:  # most inputs saturate at +-448
        fp8.bind(fp8.ffn_seam(), p, hs, residuals=res, scales=np.asarray(good.state.scales) / 200.0)
    assert info.value.worst < 0.999
    with pytest.raises(fp8.GateRefused):  # an absurdly large scale flushes everything to zero
        fp8.bind(fp8.ffn_seam(), p, hs, scales=np.asarray(good.state.scales) * 1e6)
    # bf16 SwiGLU through four fp8 roundings sits near cos 0.998 at the bare output
    with pytest.raises(fp8.GateRefused, match="bare seam"):
        fp8.bind(fp8.ffn_seam(), p, hs, gate_cos=0.9995)
    fp8.bind(fp8.ffn_seam(), p, hs, residuals=res, gate_cos=0.9995)


def test_dense_seam_fuses_projections_and_splits():
    p = init_attention(jax.random.key(3), D, 4, 2)
    hs, _ = _samples(2)
    bound = fp8.bind(fp8.qkv_seam(), p, hs)
    assert bound.certification.dims == {"K": D, "N": (D, D // 2, D // 2)}
    q, k, v = bound(bound.state, p, hs[0])
    assert q.shape == (ROWS, D) and k.shape == (ROWS, D // 2) and v.shape == (ROWS, D // 2)
    for got, w in zip((q, k, v), ("wq", "wk", "wv")):
        assert float(fp8.cosine(got, hs[0] @ p[w].T)) > 0.999
    o = fp8.bind(fp8.out_proj_seam(), p, hs, residuals=hs)
    assert o(o.state, p, hs[0]).shape == (ROWS, D)


def test_bind_rejects_bad_inputs():
    p = _ffn_params()
    hs, res = _samples(2)
    for kwargs, match in [(dict(calibration_inputs=[]), "at least one"),
                          (dict(calibration_inputs=hs, residuals=res[:1]), "align 1:1"),
                          (dict(calibration_inputs=[jnp.ones((4, D + 1))]), "expected float"),
                          (dict(calibration_inputs=hs, percentile=0), "percentile"),
                          (dict(calibration_inputs=[jnp.zeros((0, D))]), "has no rows"),
                          (dict(calibration_inputs=[hs[0], jnp.zeros((4, D))]),
                           "calibration sample 1 gives a zero amax at the seam input"),
                          (dict(calibration_inputs=hs, gate_cos=-1.0), "gate_cos must be in"),
                          (dict(calibration_inputs=hs, scales=jnp.array([0.0, 1.0])), "finite and positive"),
                          (dict(calibration_inputs=hs, scales=jnp.array([jnp.nan, 1.0])), "finite and positive")]:
        with pytest.raises(ValueError, match=match):
            fp8.bind(fp8.ffn_seam(), p, **kwargs)
    with pytest.raises(ValueError, match="lack"):
        fp8.bind(fp8.ffn_seam(), {"w_gate": p["w_gate"]}, hs)
    with pytest.raises(ValueError, match="do not fit together"):
        fp8.bind(fp8.ffn_seam(), {**p, "w_down": p["w_gate"]}, hs)
    with pytest.raises(ValueError, match="seam's output"):
        fp8.bind(fp8.qkv_seam(), init_attention(jax.random.key(0), D, 4, 2), hs, residuals=res)
    with pytest.raises(ValueError, match="weights must be floating point"):
        fp8.bind(fp8.ffn_seam(), dict(p, w_up=p["w_up"].astype(jnp.int32)), hs, gate_cos=0)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_bind_names_nonfinite_samples_and_weights(bad):
    p = _ffn_params()
    hs, _ = _samples(3)
    with pytest.raises(ValueError, match="calibration sample 2 gives a non-finite amax at the seam input"):
        fp8.bind(fp8.ffn_seam(), p, [hs[0], hs[1], hs[2].at[4, 7].set(bad)])
    with pytest.raises(ValueError, match=r"weights \['w_up'\] contain NaN or inf"):
        fp8.bind(fp8.ffn_seam(), {**p, "w_up": p["w_up"].at[0, 0].set(bad)}, hs)


@pytest.mark.parametrize("kind", ["ffn", "qkv"])
def test_float16_seam_forward_and_gradients_are_finite_and_close(kind):
    """fp16 activations: the fp8 GEMMs accumulate unscaled codes (e4m3 products
    up to 448**2 each), beyond a float16 accumulator; forward and gradients
    must match the float32 run of the same seam."""
    if kind == "ffn":
        seam, p32 = fp8.ffn_seam(), _ffn_params()
    else:
        seam, p32 = fp8.qkv_seam(), init_attention(jax.random.key(0), D, 4, 2)
        p32 = {k: v for k, v in p32.items() if k in seam.weights}
    hs, _ = _samples(1)
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), p32)
    scales = fp8.bind(seam, p32, hs, gate_cos=0).state.scales
    loss = lambda p, x: jnp.sum(fp8.fp8_forward(seam, p, x, scales).astype(jnp.float32) ** 2)
    y16, y32 = fp8.fp8_forward(seam, p16, hs[0].astype(jnp.float16), scales), fp8.fp8_forward(seam, p32, hs[0], scales)
    assert y16.dtype == jnp.float16 and np.isfinite(np.asarray(y16, np.float32)).all()
    assert float(fp8.cosine(y16, y32)) > 0.999
    g16 = jax.grad(loss, argnums=(0, 1))(p16, hs[0].astype(jnp.float16))
    g32 = jax.grad(loss, argnums=(0, 1))(p32, hs[0])
    for a, b in zip(jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32)):
        assert np.isfinite(np.asarray(a, np.float32)).all() and float(fp8.cosine(a, b)) > 0.99


# ---------------------------------------------------------------------- guards
def test_normal_call_runs_fp8(bf16):
    p, hs, _, bound = bf16
    y, st = _run(bound.seam, bound.state, p, hs[2])
    assert _reason(st) is None and fp8.report(st)[0]["fp8_calls"] == 1
    assert not np.array_equal(y, _hp(p, hs[2])) and float(fp8.cosine(y, _hp(p, hs[2]))) > 0.99


def test_nonfinite_input_falls_back_for_that_call(bf16):
    p, hs, _, bound = bf16
    x = hs[2].at[3, 5].set(jnp.nan)
    y, st = _run(bound.seam, bound.state, p, x)
    assert _reason(st) == "nonfinite"
    np.testing.assert_array_equal(y, _hp(p, x))  # exactly the high-precision result (NaN row included)
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()
    assert _reason(_run(bound.seam, bound.state, p, hs[2].at[0, 0].set(jnp.inf))[1]) == "nonfinite"


def test_saturating_input_falls_back(bf16):
    p, hs, _, bound = bf16
    x = hs[2] * 50.0  # far beyond the calibrated range
    y, st = _run(bound.seam, bound.state, p, x)
    assert _reason(st) == "saturation"
    np.testing.assert_array_equal(y, _hp(p, x))


def test_saturation_threshold_at_equality(bf16):
    # 2 of ROWS * D = 2048 elements saturate: a fraction of exactly 2**-10.
    p, hs, _, bound = bf16
    x = hs[2].at[0, 0].set(1e3).at[1, 1].set(-1e3)
    assert _reason(_run(bound.seam, bound.state, p, x)[1]) is None  # default 1e-3 > 2**-10
    assert _reason(_run(bound.seam.replace(saturation_threshold=2.0 ** -10), bound.state, p, x)[1]) is None
    assert _reason(_run(bound.seam.replace(saturation_threshold=2.0 ** -11), bound.state, p, x)[1]) == "saturation"


def test_hidden_saturation_falls_back(bf16):
    p, hs, _, bound = bf16
    state = bound.state._replace(scales=bound.state.scales.at[1].set(bound.state.scales[1] / 100))
    y, st = _run(bound.seam, state, p, hs[2])
    assert _reason(st) == "hidden_saturation"
    np.testing.assert_array_equal(y, _hp(p, hs[2]))
    assert _reason(_run(bound.seam.replace(check_hidden=False), state, p, hs[2])[1]) is None


def test_row_scaling_cannot_saturate_but_still_catches_nan(bf16):
    p, hs, _, bound = bf16
    seam = fp8.ffn_seam(activation="row")
    y, st = _run(seam, bound.state, p, hs[2] * 50.0)
    assert _reason(st) is None and float(fp8.cosine(y, _hp(p, hs[2] * 50.0))) > 0.99
    assert _reason(_run(seam, bound.state, p, hs[2].at[1, 1].set(jnp.nan))[1]) == "nonfinite"


def test_detached_flag_takes_high_precision(bf16):
    p, hs, _, bound = bf16
    state = bound.state._replace(ledger=bound.state.ledger._replace(detached=jnp.ones(())))
    y, st = _run(bound.seam, state, p, hs[2])
    assert _reason(st) == "detached"
    np.testing.assert_array_equal(y, _hp(p, hs[2]))


def test_wrong_width_or_dtype_raises_at_trace_time(bf16):
    p, hs, _, bound = bf16
    with pytest.raises(fp8.GuardRefused, match="bound for width 64"):
        jax.jit(lambda x: bound(bound.state, p, x)).lower(jnp.ones((ROWS, D + 16), jnp.bfloat16))
    with pytest.raises(fp8.GuardRefused, match="not floating"):
        bound(bound.state, p, jnp.ones((ROWS, D), jnp.int32))


@pytest.mark.parametrize("change,x_dtype,reason", [
    ({"dtypes": ("bf16",)}, jnp.float16, "dtype"),
    ({"max_rows": 16}, jnp.bfloat16, "rows"),
    ({"platforms": ("tpu",)}, jnp.bfloat16, "device"),
])
def test_trace_time_contract_falls_back_counted_and_warns_once(bf16, change, x_dtype, reason):
    p, hs, _, bound = bf16
    seam, monitor, x = bound.seam.replace(**change), fp8.LedgerMonitor(), hs[2].astype(x_dtype)
    fn = lambda: jax.jit(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x, monitor))(bound.state, p, x)
    with pytest.warns(fp8.Fp8FallbackWarning, match=reason):
        y, obs = fn()
    assert _reason(fp8.fold_state(seam, bound.state, obs)) == reason
    np.testing.assert_array_equal(np.asarray(y), np.asarray(swiglu(p, x).astype(x_dtype)))
    with warnings.catch_warnings():  # the fallback is in the graph; said once, not again on re-trace
        warnings.simplefilter("error")
        assert _reason(fp8.fold_state(seam, bound.state, fn()[1])) == reason


def test_strict_mode_raises_instead_of_falling_back(bf16):
    p, hs, _, bound = bf16
    strict = bound.seam.replace(strict=True)
    fn = jax.jit(lambda s, p, x: fp8.apply_with_ledger(strict, s, p, x)[0])
    fn(bound.state, p, hs[2]).block_until_ready()  # a fine input: no error
    with pytest.raises(Exception, match="strict mode: nonfinite"):
        fn(bound.state, p, hs[2].at[0, 0].set(jnp.nan)).block_until_ready()
    with pytest.raises(Exception, match="strict mode: saturation"):
        fn(bound.state, p, hs[2] * 50.0).block_until_ready()
    with pytest.raises(fp8.GuardRefused, match="strict"):  # trace-time problems raise at trace time
        fp8.apply(strict.replace(dtypes=("bf16",)), bound.state, p, hs[2].astype(jnp.float16))


def test_no_value_checks_means_no_cond(bf16):
    p, hs, _, bound = bf16
    seam = bound.seam.replace(check_values=False)
    assert "cond[" not in str(jax.make_jaxpr(lambda s, p, x: fp8.apply(seam, s, p, x))(bound.state, p, hs[2]))
    guarded = str(jax.make_jaxpr(lambda s, p, x: fp8.apply(bound.seam, s, p, x))(bound.state, p, hs[2]))
    assert guarded.count("cond[") == 1  # one branch point per call
    assert _reason(_run(seam, bound.state, p, hs[2] * 50.0)[1]) is None  # unchecked: ran fp8 (clipped)


def _grads(fn, p, x):
    ct = jax.random.normal(jax.random.key(4), (ROWS, D))
    return jax.jit(jax.grad(lambda p_, x_: jnp.sum(fn(p_, x_).astype(jnp.float32) * ct), argnums=(0, 1)))(p, x)


def test_guarded_gradients_are_autodiff_of_the_branch_that_ran(bf16):
    p, hs, _, bound = bf16
    fp8_only = _grads(lambda p_, x_: fp8.fp8_forward(bound.seam, p_, x_, bound.state.scales), p, hs[2])
    chex.assert_trees_all_equal(_grads(lambda p_, x_: bound(bound.state, p_, x_), p, hs[2]), fp8_only)
    detached = bound.state._replace(ledger=bound.state.ledger._replace(detached=jnp.ones(())))
    hp_only = _grads(lambda p_, x_: fp8.high_precision(bound.seam, p_, x_), p, hs[2])
    chex.assert_trees_all_equal(_grads(lambda p_, x_: bound(detached, p_, x_), p, hs[2]), hp_only)
    # a trace-time fallback decides nothing at run time: no cond, high-precision gradients
    seam = bound.seam.replace(max_rows=16)
    assert "cond[" not in str(jax.make_jaxpr(jax.grad(lambda x_: jnp.sum(fp8.apply(seam, bound.state, p, x_))))(hs[2]))
    chex.assert_trees_all_equal(_grads(lambda p_, x_: fp8.apply(seam, bound.state, p_, x_), p, hs[2]), hp_only)


def test_frozen_weights_give_the_live_result_fall_back_and_differentiate(bf16):
    p, hs, _, bound = bf16
    frozen = bound.freeze(p)
    np.testing.assert_array_equal(np.asarray(bound(bound.state, frozen, hs[2])), np.asarray(bound(bound.state, p, hs[2])))
    bad = hs[2] * 50.0
    y, st = _run(bound.seam, bound.state, frozen, bad)
    assert _reason(st) == "saturation"
    np.testing.assert_array_equal(y, _hp(p, bad))
    dx = lambda params, x: _grads(lambda p_, x_: bound(bound.state, params, x_), p, x)[1]
    hp = _grads(lambda p_, x_: fp8.high_precision(bound.seam, p_, x_), p, bad)[1]
    chex.assert_trees_all_equal(dx(frozen, bad), hp)
    unguarded = _grads(lambda p_, x_: fp8.fp8_forward(bound.seam, frozen, x_, bound.state.scales), p, hs[2])[1]
    chex.assert_trees_all_equal(dx(frozen, hs[2]), unguarded)


# ---------------------------------------------------------------------- counts and observations
def _obs(bound, p, x, state=None):
    return jax.jit(jax.grad(lambda s: jnp.sum(bound(s, p, x).astype(jnp.float32))))(
        bound.state if state is None else state)


def test_counts_via_cotangent_under_jit_grad(bf16):
    p, hs, _, bound = bf16
    step = jax.jit(lambda p, s, x: jax.grad(lambda s_: jnp.sum(bound(s_, p, x).astype(jnp.float32) ** 2))(s))
    state = bound.state
    for i in range(4):
        state = fp8.fold_state(bound.seam, state, step(p, state, hs[1] * 50.0 if i == 2 else hs[1]))
    e = bound.report(state)[0]
    assert (e["calls"], e["fp8_calls"], e["fallbacks"]) == (4, 3, 1)
    assert e["by_reason"] == {"saturation": 1} and e["last_reason"] == "saturation"
    assert e["consecutive"] == 0 and not e["detached"]


def test_checkpoint_recomputation_does_not_double_count(bf16):
    p, hs, _, bound = bf16
    remat = jax.checkpoint(lambda p, s, x: bound(s, p, x))
    g = jax.jit(jax.grad(lambda p, s, x: jnp.sum(remat(p, s, x).astype(jnp.float32)), argnums=1))(p, bound.state, hs[1])
    e = bound.report(fp8.fold_state(bound.seam, bound.state, g))[0]
    assert (e["calls"], e["fp8_calls"]) == (1, 1)
    assert float(jnp.sum(g.scales ** 2)) == 0.0  # scales are not trained


def test_one_state_used_twice_counts_twice(bf16):
    p, hs, _, bound = bf16
    loss = lambda p, s, x: jnp.sum(bound(s, p, x).astype(jnp.float32)) + jnp.sum(bound(s, p, x * 50.0).astype(
        jnp.float32))
    e = bound.report(fp8.fold_state(bound.seam, bound.state, jax.jit(jax.grad(loss, argnums=1))(p, bound.state,
                                                                                                 hs[1])))[0]
    assert (e["calls"], e["fp8_calls"], e["by_reason"]) == (2, 1, {"saturation": 1})
    assert e["consecutive"] == 0  # a step mixing fp8 and fallback resets the run (conservative)


def test_vmapped_calls_count_every_call(bf16):
    p, hs, _, bound = bf16
    g = jax.jit(jax.grad(lambda s: jnp.sum(jax.vmap(lambda x: bound(s, p, x))(jnp.stack(hs)).astype(jnp.float32))))(
        bound.state)
    e = bound.report(bound.fold(bound.state, g, notify=False))[0]
    assert e["calls"] == e["fp8_calls"] == 3 and e["fallbacks"] == 0


def test_forward_variant_observations(bf16):
    p, hs, _, bound = bf16
    fn, state = jax.jit(bound.apply_with_ledger), bound.state
    for x in (hs[0], hs[1].at[0, 0].set(jnp.nan), hs[1]):
        state = fp8.fold_state(bound.seam, state, fn(state, p, x)[1])
    e = bound.report(state)[0]
    assert (e["calls"], e["fallbacks"], e["by_reason"]) == (3, 1, {"nonfinite": 1}) and e["amax"][0] > 0
    assert e["grad_scales"] == [0.0, 0.0]  # gradient amax comes from a backward only


def test_microbatch_observations_combine_max_amax_and_added_counts(bf16):
    """observe.combine of two differentiations sharing a state (microbatches):
    counts add up, every amax takes the maximum (a sum overstated the train
    command's delayed scales 3-4x)."""
    p, hs, _, bound = bf16
    bound = fp8.BoundSeam(bound.seam.replace(activation="delayed"), bound.state, bound.certification)
    a, b = _obs(bound, p, hs[0] * 0.25), _obs(bound, p, hs[0] * 0.5)  # both inside the calibrated range
    combined = bound.state._replace(observed=fp8.Observed(*map(O.combine, a.observed, b.observed)))
    seen = [fp8.state.observations(bound.state, c) for c in (a, b, combined)]
    assert float(seen[2]["counts"]["calls"]) == 2.0 and float(seen[2]["counts"]["fp8_calls"]) == 2.0
    want = np.maximum(seen[0]["act"], seen[1]["act"])
    np.testing.assert_array_equal(seen[2]["act"], want)
    np.testing.assert_allclose(want[0], float(jnp.max(jnp.abs(hs[0] * 0.5))), rtol=1e-6)  # the larger input's
    np.testing.assert_array_equal(seen[2]["gemm"]["grad"], np.maximum(seen[0]["gemm"]["grad"],
                                                                      seen[1]["gemm"]["grad"]))
    np.testing.assert_allclose(np.asarray(bound.fold(bound.state, combined, notify=False).scales), want / 448.0,
                               rtol=1e-6)


def test_a_state_of_another_shape_is_refused_by_name(bf16):
    p, hs, _, bound = bf16
    with pytest.raises(ValueError, match=r"state.scales has shape \(3,\), expected \(2,\)"):
        bound(bound.state._replace(scales=jnp.ones((3,))), p, hs[2])
    with pytest.raises(ValueError, match="stacked state with leading axes"):
        bound(jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), bound.state), p, hs[2])
    with pytest.raises(ValueError, match="expected its SeamState"):
        bound({"scales": 1}, p, hs[2])


# ---------------------------------------------------------------------- gradient scaling
@pytest.fixture(scope="module")
def f32():
    p = _ffn_params()
    xs = jax.random.normal(jax.random.key(7), (96, D))
    h = rms_norm({"scale": jnp.ones((D,))}, xs)
    bound = fp8.bind(fp8.ffn_seam(), p, [h], residuals=[xs])
    return p, h, jax.random.normal(jax.random.key(3), (96, D)) * 1e-3, bound


def _seam_grads(seam, state, p, h, ct):
    return jax.jit(jax.grad(lambda p_, h_, s_: jnp.sum(fp8.apply(seam, s_, p_, h_) * ct), argnums=(0, 1, 2)))(p, h,
                                                                                                              state)


def test_backward_observes_gradient_amax_and_fold_turns_it_into_scales(f32):
    p, h, ct, bound = f32
    gstate = _seam_grads(bound.seam, bound.state, p, h, ct)[2]
    obs = np.asarray(fp8.state.observations(bound.state, gstate)["gemm"]["grad"])
    hh = np.asarray(h, np.float64)
    g, u = hh @ np.asarray(p["w_gate"], np.float64).T, hh @ np.asarray(p["w_up"], np.float64).T
    dhid = np.asarray(ct, np.float64) @ np.asarray(p["w_down"], np.float64)
    sig = 1 / (1 + np.exp(-g))
    ref = [np.abs(np.concatenate([dhid * u * sig * (1 + g * (1 - sig)), dhid * g * sig], 1)).max(), np.abs(ct).max()]
    # The down GEMM's output gradient is ct itself: exact. The gate|up one
    # comes out of the fp8 dgrad of the down projection (e5m2 x e4m3).
    np.testing.assert_allclose(obs[1], ref[1], rtol=1e-6)
    np.testing.assert_allclose(obs[0], ref[0], rtol=0.15)
    new = bound.fold(bound.state, gstate, notify=False)
    np.testing.assert_allclose(np.asarray(new.grad_scales), obs * 4.0 / 57344.0, rtol=1e-6)  # margin 2 binades
    rep = bound.report(new)[0]
    assert rep["grad_scales"] == [float(v) for v in np.asarray(new.grad_scales)] and rep["grad_clipped"] == [0, 0]


def test_delayed_gradient_scaling_tracks_current_and_counts_saturation(f32):
    p, h, ct, bound = f32
    gp_cur, gh_cur, gstate = _seam_grads(bound.seam, bound.state, p, h, ct)
    state = bound.fold(bound.state, gstate, notify=False)
    delayed = bound.seam.replace(gradient="delayed")
    gp_del, gh_del, gstate2 = _seam_grads(delayed, state, p, h, ct)
    exact = jax.grad(lambda p_, h_: jnp.sum(fp8.high_precision(bound.seam, p_, h_) * ct), argnums=(0, 1))(p, h)
    for got, cur, ref in zip(*(jax.tree_util.tree_leaves(t) for t in ((gp_del, gh_del), (gp_cur, gh_cur), exact))):
        # two binades of headroom cost delayed scaling little against current
        assert rel_err(got, ref) < rel_err(cur, ref) + 5e-3 and rel_err(cur, ref) < 0.1
    np.testing.assert_array_equal(np.asarray(fp8.fold_state(delayed, state, gstate2).grad_clipped), [0.0, 0.0])
    # The gradient grows 100x (> 2 binades) after the scales were set: saturated and counted.
    after = fp8.fold_state(delayed, state, _seam_grads(delayed, state, p, h, ct * 100.0)[2])
    np.testing.assert_array_equal(np.asarray(after.grad_clipped), [1.0, 1.0])
    # The down GEMM is in range the next step; the gate|up gradient comes out of
    # the down GEMM's (saturated) dgrad, so its first observation was low and
    # it settles one step later.
    after2 = fp8.fold_state(delayed, after, _seam_grads(delayed, after, p, h, ct * 100.0)[2])
    np.testing.assert_array_equal(np.asarray(after2.grad_clipped), [2.0, 1.0])
    after3 = fp8.fold_state(delayed, after2, _seam_grads(delayed, after2, p, h, ct * 100.0)[2])
    np.testing.assert_array_equal(np.asarray(after3.grad_clipped), [2.0, 1.0])
    cur = fp8.fold_state(bound.seam, state, _seam_grads(bound.seam, state, p, h, ct * 100.0)[2])
    np.testing.assert_array_equal(np.asarray(cur.grad_clipped), [0.0, 0.0])  # no event under current scaling


def test_never_observed_delayed_grad_scale_is_finite_and_counted(f32):
    p, h, ct, bound = f32
    seam = bound.seam.replace(gradient="delayed")
    _, gh, gs = _seam_grads(seam, bound.state, p, h, ct)
    assert bool(jnp.all(jnp.isfinite(gh)))
    folded = fp8.fold_state(seam, bound.state, gs)
    np.testing.assert_array_equal(np.asarray(folded.grad_clipped), [1.0, 1.0])
    assert bool(jnp.all(folded.grad_scales > 0))


# ---------------------------------------------------------------------- weight scaling, cast and frozen weights
def test_delayed_weights_follow_the_weights_and_count_a_weight_that_outgrew_its_scale(f32):
    p, h, ct, _ = f32
    seam = fp8.ffn_seam(weight="delayed")
    state0 = fp8.init_state(seam, [0.01, 0.01], p)
    amax = lambda q: np.array([max(np.abs(np.asarray(q[n], np.float64)).max() for n in ("w_gate", "w_up")),
                               np.abs(np.asarray(q["w_down"], np.float64)).max()])
    observe = lambda st, params: _seam_grads(seam, st, params, h, ct)[2]
    shrunk = jax.tree_util.tree_map(lambda w: w * 0.75, p)  # a training step moved the weights
    state = fp8.fold_state(seam, state0, observe(state0, shrunk))
    np.testing.assert_allclose(np.asarray(state.weight_scales), amax(shrunk) / 448, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.weight_clipped), [0.0, 0.0])
    # grown by 2%: the largest values round to 448 anyway (up to 464): nothing clipped
    hair = fp8.fold_state(seam, state, observe(state, jax.tree_util.tree_map(lambda w: w * 1.02, shrunk)))
    np.testing.assert_array_equal(np.asarray(hair.weight_clipped), [0.0, 0.0])
    grown = jax.tree_util.tree_map(lambda w: w * 1.5, shrunk)  # saturates with the old scale: counted per GEMM
    state2 = fp8.fold_state(seam, state, observe(state, grown))
    np.testing.assert_array_equal(np.asarray(state2.weight_clipped), [1.0, 1.0])
    np.testing.assert_allclose(np.asarray(state2.weight_scales), amax(shrunk) * 1.5 / 448, rtol=1e-6)
    # a forward-only fold leaves the weight scales alone
    _, inc = fp8.apply_with_ledger(seam, state2, grown, h)
    np.testing.assert_array_equal(np.asarray(fp8.fold_state(seam, state2, inc).weight_scales),
                                  np.asarray(state2.weight_scales))
    with pytest.raises(ValueError, match="weight='delayed': its state starts from the weights"):
        fp8.init_state(seam, [0.01, 0.01])


def _cast_case(kind):
    if kind == "ffn":
        return fp8.ffn_seam(weight="delayed"), _ffn_params(jnp.bfloat16)
    keys = jax.random.split(jax.random.key(0), 3)
    return fp8.qkv_seam(weight="delayed"), {n: (jax.random.normal(k, (r, D)) * 0.1).astype(jnp.bfloat16)
                                            for k, (n, r) in zip(keys, (("wq", 64), ("wk", 32), ("wv", 32)))}


@pytest.mark.parametrize("kind", ["ffn", "qkv"])
def test_seam_with_cast_weights_equals_the_uncast_seam_and_fold_drops_the_bytes(kind):
    seam, params = _cast_case(kind)
    x = jax.random.normal(jax.random.key(5), (2, 16, D)).astype(jnp.bfloat16)
    bound = fp8.bind(seam, params, [x], gate_cos=0)
    state, cast = bound.state, bound.cast_weights(bound.state, params)
    assert [q.shape for q in cast.cast.q] == ([(256, 64), (64, 128)] if kind == "ffn" else [(128, 64)])
    first = [params[n] for n in seam.weights[:2 if kind == "ffn" else 3]]
    want = fp8.quantize(jnp.concatenate(first), state.weight_scales[0])  # the bytes at the state's scales
    chex.assert_trees_all_equal(cast.cast.q[0], want)

    def loss(s, p, x_):
        y = fp8.apply(seam, s, p, x_)
        return jnp.sum((y if kind == "ffn" else jnp.concatenate(y, axis=-1)).astype(jnp.float32) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    (l0, (gs0, gp0, gx0)), (l1, (gs1, gp1, gx1)) = grad(state, params, x), grad(cast, params, x)
    assert float(l0) == float(l1)
    chex.assert_trees_all_equal((gp0, gx0), (gp1, gx1))
    folded0, folded1 = fp8.fold_state(seam, state, gs0), fp8.fold_state(seam, cast, gs1)
    assert folded1.cast is None
    chex.assert_trees_all_equal(folded0, folded1)
    chex.assert_trees_all_equal(bound.fp8(params, x, state), bound.fp8(params, x, cast))


def test_cast_weights_refuses_what_it_cannot_cast():
    seam, params = _cast_case("ffn")
    x = jax.random.normal(jax.random.key(5), (32, D)).astype(jnp.bfloat16)
    state = fp8.bind(seam, params, [x], gate_cos=0).state
    channel = seam.replace(weight="channel")
    with pytest.raises(ValueError, match="needs weight='delayed'"):
        fp8.cast_weights(channel, fp8.init_state(channel), params)
    with pytest.raises(ValueError, match="frozen params"):
        fp8.cast_weights(seam, state, fp8.freeze(seam, params))
    with pytest.raises(ValueError, match="one layer's state"):
        fp8.cast_weights(seam, jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), state), params)
    # bytes cast from other weights (a narrower FFN) do not fit these params
    small = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(1), D, 96))
    foreign = fp8.cast_weights(seam, fp8.init_state(seam, params=small), small)
    with pytest.raises(ValueError, match="do not fit its weights"):
        fp8.apply(seam, state._replace(cast=foreign.cast), params, x)
    cast = fp8.cast_weights(seam, state, params)
    with pytest.raises(ValueError, match="without the weight_scales they were cast at"):
        fp8.fp8_forward(seam, params, x, state.scales, cast=cast.cast)
    with pytest.raises(ValueError, match="need weight='delayed'"):
        fp8.apply(channel, cast, params, x)


# ---------------------------------------------------------------------- buffers
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # cast bytes: fold drops them
@pytest.mark.parametrize("activation,weight,gradient,cast", [
    ("static", "channel", "current", False), ("delayed", "delayed", "delayed", False),
    ("row", "delayed", "current", True), ("delayed", "channel", "delayed", False)])
def test_seam_state_donates_in_every_mode(activation, weight, gradient, cast):
    """No leaf of a state aliases another: a step jitted with the state under
    donate_argnums runs (a shared zero array could not be donated twice)."""
    p = _ffn_params(jnp.bfloat16)
    hs, _ = _samples(1, jnp.bfloat16)
    seam = fp8.ffn_seam(activation=activation, weight=weight, gradient=gradient)
    state = fp8.bind(seam, p, hs, gate_cos=0).state
    state = state._replace(grad_scales=jnp.array([1e-6, 1e-6], jnp.float32))

    @jax.jit
    def prep(s):
        return fp8.cast_weights(seam, s, p) if cast else s

    def step(s, p, x):
        g = jax.grad(lambda s_: jnp.sum(fp8.apply(seam, s_, p, x).astype(jnp.float32)))(s)
        return fp8.fold_state(seam, s, g)

    step = jax.jit(step, donate_argnums=(0,))
    for s in (state, fp8.init_state(seam, [0.01, 0.01], p)):
        leaves = jax.tree_util.tree_leaves(s)
        assert len({id(a) for a in leaves}) == len(leaves)
        s = step(prep(s), p, hs[0])
        s = step(prep(s), p, hs[0])
        assert fp8.report(s)[0]["calls"] == 2
