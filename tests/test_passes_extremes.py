"""Built-in adjoint passes at extreme magnitudes (tiny, huge, non-finite,
low precision) and with arguments out of range, against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import passes as P


def _ctx():
    return P.PassContext(jnp.int32(0), jnp.int32(0), jnp.int32(0), 3)


def _apply(pass_, g, calls=1):
    state = pass_.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0))
    for _ in range(calls):
        out, state = jax.jit(pass_.update)(g, state, _ctx())
    return out, state


# ----------------------------------------------------------------------------- quantizers
@pytest.mark.parametrize("amax", [1e-36, 3e-37, 4e-36])
def test_int8_fake_quant_keeps_tiny_adjoints_finite(amax):
    # Tiny (normal) adjoints came out NaN: the scale amax/127 is subnormal,
    # flushed to 0, then 0/0. Quantization is equivariant under power-of-two
    # scaling: the tiny adjoint must quantize exactly like itself times 2**80.
    g = jnp.array([amax, -amax / 3, amax / 7, 0.0], jnp.float32)
    out, _ = _apply(P.int8_fake_quant(), g)
    big, _ = _apply(P.int8_fake_quant(), g * 2.0 ** 80)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(big, np.float64) * 2.0 ** -80)


@pytest.mark.parametrize("amax", [1e-36, 3e-37])
def test_int8_fake_quant_tiny_adjoint_is_boosted_exactly(amax):
    # The tiny path scales by an exact power of two: on 256 random entries any other
    # factor (or its rounded inverse) moves some results by an ulp.
    g = jax.random.normal(jax.random.key(5), (256,), jnp.float32)
    g = g * (amax / jnp.max(jnp.abs(g)))
    out, _ = _apply(P.int8_fake_quant(), g)
    big, _ = _apply(P.int8_fake_quant(), g * 2.0 ** 80)
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(big, np.float64) * 2.0 ** -80)
    assert np.count_nonzero(np.asarray(out)) > 128  # most entries survive quantization


@pytest.mark.parametrize("fmt, scaling", [("e4m3", "current"), ("e5m2", "current"), ("e4m3", "delayed")])
@pytest.mark.parametrize("amax", [1e-36, 3e-37, 4e-36])
def test_fp8_quant_keeps_tiny_adjoints_finite(fmt, scaling, amax):
    # fp8_max/amax overflowed to an infinite inverse scale (or a scale that is
    # subnormal, flushed to 0): NaN or zero adjoints. The scale is now kept
    # at or above 2**-126; reference: numpy's fp8 cast (ml_dtypes) with it.
    import ml_dtypes

    g = jnp.array([amax, -amax / 3, amax / 7, 0.0], jnp.float32)
    out, state = _apply(P.fp8_quant(fmt, scaling), g, calls=2)
    scale = 2.0 ** -126
    fp8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    ref = np.asarray(g, np.float64) * (1.0 / scale)
    ref = ref.astype(np.float32).astype(fp8).astype(np.float64) * scale
    assert bool(jnp.all(jnp.isfinite(out))) and float(state.scale) == scale
    np.testing.assert_array_equal(np.asarray(out, np.float64), ref)
    assert abs(float(out[0]) - amax) <= amax / 4


@pytest.mark.parametrize("amax", [None, 3e38], ids=["normal", "above-half-float32-max"])
def test_int8_fake_quant_ordinary_adjoint_still_matches_numpy(amax):
    # 3e38: a power-of-two boost of the tiny-adjoint path (x2 or more) would overflow it to inf.
    g = jax.random.normal(jax.random.key(3), (64,), jnp.float32)
    if amax is not None:
        g = g * (amax / jnp.max(jnp.abs(g)))
    out, state = _apply(P.int8_fake_quant(), g)
    t = np.asarray(g, np.float32)
    scale = np.float32(np.max(np.abs(t)) / np.float32(127.0))
    ref = (np.clip(np.round(t / scale), -127, 127) * scale).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out), ref)
    assert float(state.scale) == float(scale)


# ----------------------------------------------------------------------------- clip
@pytest.mark.parametrize("g", [[3e19, 4e19, 0.0], [3e30, -4e30], [2e18] * 1000])
@pytest.mark.parametrize("max_norm", [1.0, 0.5])
def test_clip_by_norm_clips_huge_finite_adjoints_instead_of_zeroing(g, max_norm):
    # The float32 sum of squares overflowed to inf, the factor became 0 and
    # the adjoint was zeroed instead of clipped.
    g = jnp.asarray(g, jnp.float32)
    out, state = _apply(P.clip_by_norm(max_norm), g)
    ref = np.asarray(g, np.float64)
    norm = np.linalg.norm(ref)
    np.testing.assert_allclose(float(state.norm), norm, rtol=1e-5)
    assert bool(state.clipped)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref * (max_norm / norm), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_clip_by_norm_low_precision_factor_does_not_underflow(dtype):
    # max_norm / norm = 1e-9 underflowed to 0 when cast to float16 first, so
    # the adjoint was zeroed instead of scaled to the bound.
    g = jnp.full((1000,), 3e4, dtype)
    max_norm = 1e-3
    out, state = _apply(P.clip_by_norm(max_norm), g)
    assert bool(state.clipped) and out.dtype == jnp.dtype(dtype)
    ref = np.asarray(g, np.float64) * (max_norm / np.linalg.norm(np.asarray(g, np.float64)))
    tol = {jnp.float16: 1e-3, jnp.bfloat16: 8e-3}[dtype]  # one rounding, plus fp16 subnormal spacing
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(out, np.float64)), max_norm, rtol=tol)


# ----------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("g", [[3e19, -4e19, 0.0], [3e37] * 64, [1e20, 1.0, -2.0, 5e19]])
def test_statistics_of_huge_finite_adjoints_stay_finite(g):
    # The float32 sum of squares overflowed: a finite adjoint reported an
    # infinite norm and std.
    g = jnp.asarray(g, jnp.float32)
    _, state = _apply(P.statistics(), g)
    ref = np.asarray(g, np.float64)
    assert not bool(state.has_inf) and not bool(state.has_nan)
    np.testing.assert_allclose(float(state.norm), np.linalg.norm(ref), rtol=1e-5)
    np.testing.assert_allclose(float(state.std), np.std(ref), rtol=1e-5)
    np.testing.assert_allclose(float(state.mean), np.mean(ref), rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert float(state.max) == float(ref.max()) and float(state.min) == float(ref.min())


def test_statistics_counts_adjoints_of_up_to_int32_max_entries():
    """numel is an int32: 2**31-1 entries (the bound itself) are accepted, 2**31 refused at init."""
    p = P.statistics()
    state = p.init(jax.ShapeDtypeStruct((2**31 - 1,), jnp.float32), None)  # a spec: nothing is allocated
    assert int(state.numel) == 0
    with pytest.raises(ValueError) as err:
        p.init(jax.ShapeDtypeStruct((2**16, 2**15), jnp.bfloat16), None)
    assert str(err.value) == "statistics: adjoint of shape (65536, 32768) has more than 2**31-1 entries"


def test_statistics_of_nonfinite_adjoints_keep_their_flags():
    # The overflow path is for finite adjoints only: an inf stays reported as inf.
    _, state = _apply(P.statistics(), jnp.asarray([1.0, jnp.inf, 2.0], jnp.float32))
    assert bool(state.has_inf) and np.isinf(float(state.norm))


# ----------------------------------------------------------------------------- combinator arguments
def _block(w, x):
    return x + jnp.tanh(x @ w["w"]) * w["s"]


@pytest.mark.parametrize("layers", [[4], [-5], [0, 7]])
def test_at_layers_out_of_range_raises_instead_of_wrapping(layers):
    # Indices were taken modulo L+1: boundary 4 of a 4-boundary stack ran at 0.
    stack = eae_jax.reconstruct(_block, passes=P.at_layers(P.decay(0.5), layers))
    params = {"w": jnp.ones((3, 4, 4)) * 0.1, "s": jnp.linspace(0.5, 1.5, 3)}
    with pytest.raises(ValueError, match="out of range"):
        jax.grad(lambda p: jnp.sum(stack(p, jnp.ones((2, 4)))))(params)


@pytest.mark.parametrize("layers", [0, "0", [0.5], [True]])
def test_at_layers_rejects_non_int_layers(layers):
    with pytest.raises(TypeError, match="at_layers"):
        P.at_layers(P.decay(0.5), layers)


@pytest.mark.parametrize("n", [1.5, "2", True])
def test_every_n_steps_rejects_non_int_n(n):
    with pytest.raises(TypeError, match="every_n_steps"):
        P.every_n_steps(P.decay(0.5), n)
