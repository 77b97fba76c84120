"""Binding: calibrated scales, the parity gate, the certification record."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax import fp8
from eae_jax.blocks import init_attention, init_swiglu, rms_norm

D, F, ROWS = 64, 128, 96


def _ffn_params(dtype=jnp.float32):
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), init_swiglu(jax.random.key(0), D, F))


def _samples(n, dtype=jnp.float32, scale=1.0):
    xs = jax.random.normal(jax.random.key(7), (n, ROWS, D)) * scale
    resid = xs.astype(dtype)
    hs = rms_norm({"scale": jnp.ones((D,))}, xs).astype(dtype)
    return [hs[i] for i in range(n)], [resid[i] for i in range(n)]


def _np_amax_points(p, h):
    h = np.asarray(h, np.float64)
    g = h @ np.asarray(p["w_gate"], np.float64).T
    u = h @ np.asarray(p["w_up"], np.float64).T
    hidden = g / (1 + np.exp(-g)) * u
    return np.abs(h).max(), np.abs(hidden).max()


@pytest.mark.parametrize("percentile", [100.0, 50.0, 99.9])
def test_scales_are_percentile_of_sample_amax_over_448(percentile):
    p = _ffn_params()
    hs, _ = _samples(5)
    bound = fp8.bind(fp8.ffn_seam(), p, hs, percentile=percentile, gate_cos=0)
    amax = np.array([_np_amax_points(p, h) for h in hs])  # (samples, points), float64 reference
    expect = np.percentile(amax, percentile, axis=0) / 448.0
    np.testing.assert_allclose(bound.certification.scales, expect, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(bound.state.scales), expect, rtol=2e-5)
    if percentile == 100.0:
        np.testing.assert_allclose(bound.certification.amax, amax.max(axis=0), rtol=2e-5)


@pytest.mark.parametrize("weight_scaling", ["channel", "tensor"])
def test_gate_passes_and_certifies(weight_scaling):
    p = _ffn_params(jnp.bfloat16)
    hs, res = _samples(3, jnp.bfloat16)
    bound = fp8.bind(fp8.ffn_seam(weight_scaling=weight_scaling), p, hs, residuals=res)
    cert = bound.certification
    assert cert.seam == "ffn" and cert.kind == "swiglu"
    assert cert.dims == {"D": D, "F": F}
    assert cert.samples == 3 and cert.rows == [ROWS] * 3 and cert.percentile == 99.9
    assert cert.gate_boundary.startswith("block boundary")
    assert cert.worst_cos == min(cert.cosines) >= 0.999
    # the residual boundary is gentler than the bare seam output, which is still a decent fp8 result
    assert all(b < c for b, c in zip(cert.bare_cosines, cert.cosines))
    assert min(cert.bare_cosines) > 0.99
    assert cert.max_saturation < 1e-3
    assert set(cert.as_dict()) >= {"dims", "scales", "worst_cos", "samples", "percentile"}


def test_gate_refuses_deliberately_broken_scales():
    p = _ffn_params(jnp.bfloat16)
    hs, res = _samples(2, jnp.bfloat16)
    good = fp8.bind(fp8.ffn_seam(), p, hs, residuals=res)
    broken = np.asarray(good.state.scales) / 200.0  # most inputs now saturate at +-448
    with pytest.raises(fp8.GateRefused, match="worst cosine") as info:
        fp8.bind(fp8.ffn_seam(), p, hs, residuals=res, scales=broken)
    assert info.value.worst < 0.999
    # an absurdly large scale flushes everything to zero: refused as well
    with pytest.raises(fp8.GateRefused):
        fp8.bind(fp8.ffn_seam(), p, hs, scales=np.asarray(good.state.scales) * 1e6)


def test_bare_gate_is_stricter_than_boundary_gate():
    p = _ffn_params(jnp.bfloat16)
    hs, res = _samples(2, jnp.bfloat16)
    # bf16 SwiGLU through four fp8 roundings sits near cos 0.998 at the bare output
    with pytest.raises(fp8.GateRefused, match="bare seam"):
        fp8.bind(fp8.ffn_seam(), p, hs, gate_cos=0.9995)
    fp8.bind(fp8.ffn_seam(), p, hs, residuals=res, gate_cos=0.9995)


def test_dense_seam_fuses_projections_and_splits():
    p = init_attention(jax.random.key(3), D, 4, 2)
    hs, _ = _samples(2)
    seam = fp8.qkv_seam()
    bound = fp8.bind(seam, p, hs)
    assert bound.certification.dims == {"K": D, "N": (D, D // 2, D // 2)}
    q, k, v = bound(bound.state, p, hs[0])
    assert q.shape == (ROWS, D) and k.shape == (ROWS, D // 2) and v.shape == (ROWS, D // 2)
    for got, w in zip((q, k, v), ("wq", "wk", "wv")):
        ref = hs[0] @ p[w].T
        assert float(fp8.cosine(got, ref)) > 0.999
    o = fp8.bind(fp8.out_proj_seam(), p, hs, residuals=hs)
    y = o(o.state, p, hs[0])
    assert y.shape == (ROWS, D)


def test_frozen_weights_give_the_live_result():
    p = _ffn_params(jnp.bfloat16)
    hs, _ = _samples(1, jnp.bfloat16)
    bound = fp8.bind(fp8.ffn_seam(), p, hs, gate_cos=0)
    frozen = bound.freeze(p)
    np.testing.assert_array_equal(np.asarray(bound(bound.state, frozen, hs[0])),
                                  np.asarray(bound(bound.state, p, hs[0])))


@pytest.mark.parametrize("weight_scaling", ["channel", "tensor"])
def test_fp8_numerics_match_float32_reference_of_same_quantization(weight_scaling):
    """The whole FFN seam against a numpy float64 re-implementation of the
    same quantization steps (static scales, per-channel or per-tensor weight
    scales)."""
    p = _ffn_params()
    hs, _ = _samples(1)
    h = hs[0]
    bound = fp8.bind(fp8.ffn_seam(weight_scaling=weight_scaling), p, hs, gate_cos=0)
    y = np.asarray(bound.fp8(p, h))
    sx, sh = [np.float32(s) for s in bound.certification.scales]

    def q(a, s):
        return np.asarray(fp8.quantize(jnp.asarray(a, jnp.float32), jnp.asarray(s, jnp.float32)).astype(jnp.float32),
                          np.float64)

    def wq(w):
        if weight_scaling == "tensor":
            ws = np.full((w.shape[0],), np.asarray(fp8.scale_from_amax(jnp.max(jnp.abs(w)))))
        else:
            ws = np.asarray(fp8.scale_from_amax(jnp.max(jnp.abs(w), axis=1)))
        return q(w, ws[:, None]), ws.astype(np.float64)

    w1 = np.concatenate([np.asarray(p["w_gate"]), np.asarray(p["w_up"])], 0)
    w1q, w1s = wq(jnp.asarray(w1))
    a = (q(h, sx) @ w1q.T) * float(sx) * w1s[None, :]
    a = a.astype(np.float32).astype(np.float64)
    g, u = a[:, :F], a[:, F:]
    hid = (g / (1 + np.exp(-g)) * u).astype(np.float32)
    w2q, w2s = wq(p["w_down"])
    ref = (q(hid, sh) @ w2q.T) * float(sh) * w2s[None, :]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_bind_rejects_bad_inputs():
    p = _ffn_params()
    hs, res = _samples(2)
    with pytest.raises(ValueError, match="at least one"):
        fp8.bind(fp8.ffn_seam(), p, [])
    with pytest.raises(ValueError, match="align 1:1"):
        fp8.bind(fp8.ffn_seam(), p, hs, residuals=res[:1])
    with pytest.raises(ValueError, match="expected float"):
        fp8.bind(fp8.ffn_seam(), p, [jnp.ones((4, D + 1))])
    with pytest.raises(ValueError, match="lack"):
        fp8.bind(fp8.ffn_seam(), {"w_gate": p["w_gate"]}, hs)
    with pytest.raises(ValueError, match="do not fit together"):
        fp8.bind(fp8.ffn_seam(), {**p, "w_down": p["w_gate"]}, hs)
    with pytest.raises(ValueError, match="percentile"):
        fp8.bind(fp8.ffn_seam(), p, hs, percentile=0)
    with pytest.raises(ValueError, match="seam's output"):
        fp8.bind(fp8.qkv_seam(), init_attention(jax.random.key(0), D, 4, 2), hs, residuals=res)
    with pytest.raises(ValueError, match="act_scaling"):
        fp8.SeamConfig(act_scaling="dynamic")


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
    """fp16 activations: the fp8 GEMMs accumulate unscaled codes (e4m3
    products up to 448**2 each), which would overflow a float16 accumulator;
    forward and gradients must match the float32 run of the same seam."""
    if kind == "ffn":
        seam, p32 = fp8.ffn_seam(), _ffn_params()
    else:
        seam, p32 = fp8.qkv_seam(), init_attention(jax.random.key(0), D, 4, 2)
        p32 = {k: v for k, v in p32.items() if k in seam.weights}
    hs, _ = _samples(1)
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), p32)
    bound = fp8.bind(seam, p32, hs, gate_cos=0)

    def loss(p, x):
        return jnp.sum(fp8.fp8_forward(seam, p, x, bound.state.scales).astype(jnp.float32) ** 2)

    y16 = fp8.fp8_forward(seam, p16, hs[0].astype(jnp.float16), bound.state.scales)
    y32 = fp8.fp8_forward(seam, p32, hs[0], bound.state.scales)
    assert y16.dtype == jnp.float16 and np.isfinite(np.asarray(y16, np.float32)).all()
    assert float(fp8.cosine(y16, y32)) > 0.999
    g16 = jax.grad(loss, argnums=(0, 1))(p16, hs[0].astype(jnp.float16))
    g32 = jax.grad(loss, argnums=(0, 1))(p32, hs[0])
    for a, b in zip(jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32)):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert float(fp8.cosine(a, b)) > 0.99
