"""fp8 edge cases found by probing inputs the other tests do not pick.

Each test guards one bug that was fixed in eae_jax/fp8: microbatch
observations whose activation amax was summed, vmapped calls counted as
one, tiny amaxes giving a zero scale (NaN gradients), a never-observed
delayed gradient scale (NaN gradients), a platform string split into
characters, config and bind arguments accepted until the first call,
report() of a seam state, and states of the wrong shape.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax import fp8
from eae_jax.blocks import init_swiglu, rms_norm

D, F, ROWS = 32, 64, 16


@pytest.fixture(scope="module")
def setup():
    p = init_swiglu(jax.random.key(0), D, F)
    xs = jax.random.normal(jax.random.key(1), (3, ROWS, D))
    hs = rms_norm({"scale": jnp.ones((D,))}, xs)
    return p, hs


def _bind(p, hs, **config):
    return fp8.bind(fp8.ffn_seam(**config), p, [hs[0], hs[1]], gate_cos=0)


def _obs(bound, p, x):
    return jax.grad(lambda s: jnp.sum(bound(s, p, x)))(bound.state)


def test_combined_microbatch_observations_take_the_max_amax(setup):
    """The train command summed the ledger's amax over microbatches: its
    delayed activation scales came out 3-4x too large."""
    p, hs = setup
    bound = _bind(p, hs, act_scaling="delayed")
    small, big = hs[0] * 0.25, hs[0] * 0.5  # both inside the calibrated range: fp8 calls
    a, b = _obs(bound, p, small), _obs(bound, p, big)
    combined = fp8.combine_observations(a, b)
    assert float(combined.ledger.calls) == 2.0 and float(combined.ledger.fp8_calls) == 2.0
    want = np.maximum(np.asarray(a.ledger.amax), np.asarray(b.ledger.amax))
    np.testing.assert_array_equal(np.asarray(combined.ledger.amax), want)
    # the input point is exactly the larger input's amax (the hidden one is the fp8 path's)
    np.testing.assert_allclose(want[0], float(jnp.max(jnp.abs(big))), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(combined.grad_scales),
                                  np.maximum(np.asarray(a.grad_scales), np.asarray(b.grad_scales)))
    folded = bound.fold(bound.state, combined, notify=False)
    np.testing.assert_allclose(np.asarray(folded.scales), want / 448.0, rtol=1e-6)


def test_vmapped_calls_count_every_call(setup):
    """calls came from a constant, not batched: 4 mapped calls read as 1 call
    with 4 fp8 calls and -3 fallbacks."""
    p, hs = setup
    bound = _bind(p, hs)
    g = jax.grad(lambda s: jnp.sum(jax.vmap(lambda x: bound(s, p, x))(hs)))(bound.state)
    entry = fp8.report(bound.fold(bound.state, g, notify=False))[0]
    assert entry["calls"] == entry["fp8_calls"] == 3 and entry["fallbacks"] == 0


@pytest.mark.parametrize("amax", [1e-36, 1e-38, 3e-39])
def test_tiny_amax_gives_a_finite_positive_scale(amax):
    scale = float(fp8.scale_from_amax(jnp.float32(amax)))
    assert 0.0 < scale < np.inf and np.isfinite(1.0 / scale)


def test_tiny_gradients_stay_finite():
    """amax/57344 flushed to 0: 1/scale = inf made zeros NaN in dx and dw."""
    x = jax.random.normal(jax.random.key(0), (16, D))
    w = jax.random.normal(jax.random.key(1), (24, D)) * 0.1
    _, vjp = jax.vjp(lambda x_, w_: fp8.fp8_linear(x_, w_, fp8.scale_from_amax(jnp.max(jnp.abs(x_)))), x, w)
    dx, dw = vjp(jnp.full((16, 24), 1e-36, jnp.float32))
    assert bool(jnp.all(jnp.isfinite(dx))) and bool(jnp.all(jnp.isfinite(dw)))


def test_never_observed_delayed_grad_scale_is_finite_and_counted(setup):
    """A zero delayed gradient scale (no step observed yet) made NaN
    gradients, silently; now they are finite and the step is counted as
    clipped."""
    p, hs = setup
    bound = _bind(p, hs, grad_scaling="delayed")
    assert not bool(jnp.any(bound.state.grad_scales > 0))
    gs, gx = jax.grad(lambda s, x: jnp.sum(bound(s, p, x)), argnums=(0, 1))(bound.state, hs[2])
    assert bool(jnp.all(jnp.isfinite(gx)))
    folded = bound.fold(bound.state, gs, notify=False)
    np.testing.assert_array_equal(np.asarray(folded.grad_clipped), [1.0, 1.0])
    assert bool(jnp.all(folded.grad_scales > 0))


@pytest.mark.parametrize("cls", [fp8.SeamConfig, lambda **kw: fp8.Contract(width=8, **kw)])
def test_one_platform_name_is_not_split_into_characters(cls):
    assert cls(platforms="gpu").platforms == ("gpu",)
    with pytest.raises(ValueError, match=r"unknown platform\(s\) \['gpus'\]"):
        cls(platforms=("gpus",))


@pytest.mark.parametrize("kw, match", [
    (dict(margin=200.0), "margin must be in"),
    (dict(margin=float("nan")), "margin must be in"),
    (dict(dtypes=("bf17",)), "dtypes: unknown dtype 'bf17'"),
    (dict(min_rows=-5), "bad row bounds"),
    (dict(min_rows=4, max_rows=2), "bad row bounds"),
])
def test_seam_config_is_validated_when_made(kw, match):
    with pytest.raises(ValueError, match=match):
        fp8.SeamConfig(**kw)


@pytest.mark.parametrize("name, dtype", [("fp8_e4m3", jnp.float8_e4m3fn), ("fp8_e5m2", jnp.float8_e5m2)])
def test_quant_helpers_take_the_library_fp8_names(name, dtype):
    assert fp8.fp8_max(name) == float(jnp.finfo(dtype).max)
    assert fp8.quantize(jnp.ones((2,)), 1.0, name).dtype == jnp.dtype(dtype)
    with pytest.raises(ValueError, match="is not an fp8 format"):
        fp8.fp8_max("bf16")


@pytest.mark.parametrize("x, match", [
    (jnp.ones((4, D), jnp.int32), "float32/bfloat16/float16 activations"),
    (jnp.ones((0, D), jnp.float32), "no rows"),
])
def test_fp8_linear_refuses_what_it_cannot_quantize(x, match):
    with pytest.raises(ValueError, match=match):
        fp8.fp8_linear(x, jnp.ones((8, D)), 1.0)


def test_fp8_linear_refuses_integer_weights():
    with pytest.raises(ValueError, match="live weight must be"):
        fp8.fp8_linear(jnp.ones((4, D)), jnp.ones((8, D), jnp.int32), 1.0)


@pytest.mark.parametrize("kw, match", [
    (dict(gate_cos=-1.0), "gate_cos must be in"),
    (dict(scales=jnp.array([0.0, 1.0])), "scales must be finite and positive"),
    (dict(scales=jnp.array([jnp.nan, 1.0])), "scales must be finite and positive"),
])
def test_bind_refuses_bad_overrides(setup, kw, match):
    p, hs = setup
    with pytest.raises(ValueError, match=match):
        fp8.bind(fp8.ffn_seam(), p, [hs[0]], **kw)


def test_bind_refuses_empty_samples_and_integer_weights(setup):
    p, hs = setup
    with pytest.raises(ValueError, match="has no rows"):
        fp8.bind(fp8.ffn_seam(), p, [jnp.zeros((0, D))])
    bad = dict(p, w_up=p["w_up"].astype(jnp.int32))
    with pytest.raises(ValueError, match="weights must be floating point"):
        fp8.bind(fp8.ffn_seam(), bad, [hs[0]], gate_cos=0)


def test_report_takes_a_seam_state(setup):
    p, hs = setup
    bound = _bind(p, hs)
    state = bound.fold(bound.state, _obs(bound, p, hs[2]), notify=False)
    assert fp8.report(state, "ffn") == fp8.state_report(state, "ffn")
    assert fp8.report(state.ledger, "ffn")[0]["calls"] == 1
    with pytest.raises(TypeError, match="needs a Ledger or a seam state"):
        fp8.report({"calls": 1}, "ffn")


def test_a_state_of_another_shape_is_refused_by_name(setup):
    p, hs = setup
    bound = _bind(p, hs)
    with pytest.raises(ValueError, match=r"state.scales has shape \(3,\), expected \(2,\)"):
        bound(bound.state._replace(scales=jnp.ones((3,))), p, hs[2])
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), bound.state)
    with pytest.raises(ValueError, match="stacked state with leading axes"):
        bound(stacked, p, hs[2])
