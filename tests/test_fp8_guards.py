"""Every guard path: values in the graph, contract at trace time, strict mode."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax import fp8
from eae_jax.blocks import init_swiglu, rms_norm, swiglu
from eae_jax.fp8.guards import value_stats
from eae_jax.fp8.ledger import REASONS

D, F, ROWS = 64, 128, 32


@pytest.fixture(scope="module")
def setup():
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(0), D, F))
    xs = jax.random.normal(jax.random.key(1), (3, ROWS, D))
    hs = rms_norm({"scale": jnp.ones((D,))}, xs).astype(jnp.bfloat16)
    bound = fp8.bind(fp8.ffn_seam(), p, [hs[0], hs[1]], gate_cos=0)
    return p, hs, bound


def _run(seam, state, p, x):
    y, inc = jax.jit(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x))(state, p, x)
    return np.asarray(y.astype(jnp.float32)), inc


def _reason(inc):
    r = np.asarray(inc.reasons)
    assert r.sum() <= 1
    return REASONS[int(r.argmax())] if r.sum() else None


def test_normal_call_runs_fp8(setup):
    p, hs, bound = setup
    y, inc = _run(bound.seam, bound.state, p, hs[2])
    assert float(inc.calls) == 1 and float(inc.fp8_calls) == 1 and _reason(inc) is None
    hp = np.asarray(swiglu(p, hs[2]).astype(jnp.float32))
    assert not np.array_equal(y, hp)  # really the fp8 path
    assert float(fp8.cosine(y, hp)) > 0.99


def test_nan_input_falls_back_for_that_call(setup):
    p, hs, bound = setup
    x = hs[2].at[3, 5].set(jnp.nan)
    y, inc = _run(bound.seam, bound.state, p, x)
    assert float(inc.fp8_calls) == 0 and _reason(inc) == "nonfinite"
    hp = np.asarray(swiglu(p, x).astype(jnp.float32))
    np.testing.assert_array_equal(y, hp)  # exactly the high-precision result (NaN row included)
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()
    # an infinite value counts the same
    _, inc = _run(bound.seam, bound.state, p, hs[2].at[0, 0].set(jnp.inf))
    assert _reason(inc) == "nonfinite"


def test_saturating_input_falls_back(setup):
    p, hs, bound = setup
    x = hs[2] * 50.0  # far beyond the calibrated range
    y, inc = _run(bound.seam, bound.state, p, x)
    assert _reason(inc) == "saturation" and float(inc.fp8_calls) == 0
    np.testing.assert_array_equal(y, np.asarray(swiglu(p, x).astype(jnp.float32)))


def test_saturation_below_threshold_stays_fp8(setup):
    p, hs, bound = setup
    x = hs[2].at[0, 0].set(1e3)  # one element in 2048 saturates: under the 1e-3 threshold? 1/2048 < 1e-3
    _, inc = _run(bound.seam, bound.state, p, x)
    assert _reason(inc) is None and float(inc.fp8_calls) == 1
    strict_thr = bound.seam.replace(saturation_threshold=0.0)
    _, inc = _run(strict_thr, bound.state, p, x)
    assert _reason(inc) == "saturation"


def test_hidden_saturation_falls_back(setup):
    p, hs, bound = setup
    state = bound.state._replace(scales=bound.state.scales.at[1].set(bound.state.scales[1] / 100))
    y, inc = _run(bound.seam, state, p, hs[2])
    assert _reason(inc) == "hidden_saturation"
    np.testing.assert_array_equal(y, np.asarray(swiglu(p, hs[2]).astype(jnp.float32)))
    _, inc = _run(bound.seam.replace(check_hidden=False), state, p, hs[2])
    assert _reason(inc) is None


def test_row_scaling_cannot_saturate_but_still_catches_nan(setup):
    p, hs, bound = setup
    seam = fp8.ffn_seam(act_scaling="row")
    y, inc = _run(seam, bound.state, p, hs[2] * 50.0)
    assert _reason(inc) is None
    assert float(fp8.cosine(y, swiglu(p, hs[2] * 50.0))) > 0.99
    _, inc = _run(seam, bound.state, p, hs[2].at[1, 1].set(jnp.nan))
    assert _reason(inc) == "nonfinite"


def test_detached_flag_takes_high_precision(setup):
    p, hs, bound = setup
    state = bound.state._replace(ledger=bound.state.ledger._replace(detached=jnp.ones(())))
    y, inc = _run(bound.seam, state, p, hs[2])
    assert _reason(inc) == "detached"
    np.testing.assert_array_equal(y, np.asarray(swiglu(p, hs[2]).astype(jnp.float32)))


def test_wrong_width_raises_at_trace_time(setup):
    p, hs, bound = setup
    with pytest.raises(fp8.GuardRefused, match="bound for width 64"):
        jax.jit(lambda x: bound(bound.state, p, x)).lower(jnp.ones((ROWS, D + 16), jnp.bfloat16))
    with pytest.raises(fp8.GuardRefused, match="not floating"):
        bound(bound.state, p, jnp.ones((ROWS, D), jnp.int32))


@pytest.mark.parametrize("change,x_dtype,reason", [
    ({"dtypes": ("bf16",)}, jnp.float16, "dtype"),
    ({"max_rows": 16}, jnp.bfloat16, "rows"),
    ({"min_rows": 64}, jnp.bfloat16, "rows"),
    ({"platforms": ("tpu",)}, jnp.bfloat16, "device"),
])
def test_trace_time_contract_falls_back_counted_and_warns_once(setup, change, x_dtype, reason):
    p, hs, bound = setup
    seam = bound.seam.replace(**change)
    monitor = fp8.LedgerMonitor()
    x = hs[2].astype(x_dtype)
    fn = jax.jit(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x, monitor))
    with pytest.warns(fp8.Fp8FallbackWarning, match=reason):
        y, inc = fn(bound.state, p, x)
    assert _reason(inc) == reason and float(inc.calls) == 1 and float(inc.fp8_calls) == 0
    np.testing.assert_array_equal(np.asarray(y), np.asarray(swiglu(p, x).astype(x_dtype)))
    # the trace-time fallback is in the graph: every call of the compiled step counts it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not again on re-trace
        _, inc = jax.jit(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x, monitor))(bound.state, p, x)
    assert _reason(inc) == reason


def test_strict_mode_raises_instead_of_falling_back(setup):
    p, hs, bound = setup
    strict = bound.seam.replace(strict=True)
    fn = jax.jit(lambda s, p, x: fp8.apply_with_ledger(strict, s, p, x)[0])
    fn(bound.state, p, hs[2]).block_until_ready()  # fine input: no error
    with pytest.raises(Exception, match="strict mode: nonfinite"):
        fn(bound.state, p, hs[2].at[0, 0].set(jnp.nan)).block_until_ready()
    with pytest.raises(Exception, match="strict mode: saturation"):
        fn(bound.state, p, hs[2] * 50.0).block_until_ready()
    # trace-time problems raise at trace time
    with pytest.raises(fp8.GuardRefused, match="strict"):
        fp8.apply(strict.replace(dtypes=("bf16",)), bound.state, p, hs[2].astype(jnp.float16))


def test_no_value_checks_means_no_cond(setup):
    p, hs, bound = setup
    seam = bound.seam.replace(check_values=False)
    jaxpr = str(jax.make_jaxpr(lambda s, p, x: fp8.apply(seam, s, p, x))(bound.state, p, hs[2]))
    assert "cond[" not in jaxpr
    guarded = str(jax.make_jaxpr(lambda s, p, x: fp8.apply(bound.seam, s, p, x))(bound.state, p, hs[2]))
    assert guarded.count("cond[") == 1  # one branch point per call
    _, inc = _run(seam, bound.state, p, hs[2] * 50.0)
    assert _reason(inc) is None  # unchecked: ran fp8 (clipped)


def test_guarded_gradients_are_autodiff_of_the_branch_that_ran(setup):
    """The guarded seam keeps its decision for the backward (seams.decide_once):
    its gradients are those of the unguarded fp8 seam when nothing failed, and
    of the high-precision seam when the call fell back."""
    p, hs, bound = setup
    ct = jax.random.normal(jax.random.key(4), (ROWS, D))

    def grads(fn):
        return jax.jit(jax.grad(lambda p_, x_: jnp.sum(fn(p_, x_).astype(jnp.float32) * ct), argnums=(0, 1)))(
            p, hs[2])

    def guarded(state):
        return lambda p_, x_: fp8.apply(bound.seam, state, p_, x_)

    fp8_only = grads(lambda p_, x_: fp8.fp8_forward(bound.seam, p_, x_, bound.state.scales))
    for a, b in zip(jax.tree_util.tree_leaves(grads(guarded(bound.state))), jax.tree_util.tree_leaves(fp8_only)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    detached = bound.state._replace(ledger=bound.state.ledger._replace(detached=jnp.ones(())))
    hp_only = grads(lambda p_, x_: fp8.high_precision(bound.seam, p_, x_))
    for a, b in zip(jax.tree_util.tree_leaves(grads(guarded(detached))), jax.tree_util.tree_leaves(hp_only)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_trace_time_fallback_gradients_are_the_high_precision_seams(setup):
    # A trace-time fallback decides nothing at run time: no cond, and the
    # gradients are autodiff of the high-precision seam.
    p, hs, bound = setup
    seam = bound.seam.replace(max_rows=16)
    ct = jax.random.normal(jax.random.key(4), (ROWS, D))

    def grads(fn):
        return jax.jit(jax.grad(lambda p_, x_: jnp.sum(fn(p_, x_).astype(jnp.float32) * ct), argnums=(0, 1)))(
            p, hs[2])

    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x_: jnp.sum(fp8.apply(seam, bound.state, p, x_))))(hs[2]))
    got = grads(lambda p_, x_: fp8.apply(seam, bound.state, p_, x_))
    assert "cond[" not in jaxpr
    want = grads(lambda p_, x_: fp8.high_precision(seam, p_, x_))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_frozen_weights_fall_back_and_differentiate_like_live_ones(setup):
    # Frozen (inference) weights take the same guarded path: a NaN input falls
    # back to the high-precision seam, counted, and the input gradient is the
    # branch that ran (the fp8 one for a good input, the high-precision one
    # for a failed call; frozen weights get zero cotangents).
    p, hs, bound = setup
    frozen = bound.freeze(p)
    bad = hs[2] * 50.0
    y, inc = _run(bound.seam, bound.state, frozen, bad)
    assert _reason(inc) == "saturation"
    np.testing.assert_array_equal(y, np.asarray(swiglu(p, bad).astype(jnp.float32)))
    ct = jax.random.normal(jax.random.key(4), (ROWS, D))

    def dx(params, x):
        return jax.jit(jax.grad(lambda x_: jnp.sum(fp8.apply(bound.seam, bound.state, params, x_)
                                                   .astype(jnp.float32) * ct)))(x)

    hp = jax.grad(lambda x_: jnp.sum(fp8.high_precision(bound.seam, p, x_).astype(jnp.float32) * ct))(bad)
    np.testing.assert_array_equal(np.asarray(dx(frozen, bad).astype(jnp.float32)),
                                  np.asarray(hp.astype(jnp.float32)))
    unguarded = jax.jit(jax.grad(lambda x_: jnp.sum(fp8.fp8_forward(bound.seam, frozen, x_, bound.state.scales)
                                                    .astype(jnp.float32) * ct)))(hs[2])
    np.testing.assert_array_equal(np.asarray(dx(frozen, hs[2]).astype(jnp.float32)),
                                  np.asarray(unguarded.astype(jnp.float32)))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("scale", [None, 0.01])
@pytest.mark.parametrize("shape", [(64,), (33, 64), (2, 5, 7)])
def test_value_stats_amax_is_nonfinite_for_any_nonfinite_element(bad, scale, shape):
    # XLA's CPU max reduction may drop NaNs; the statistic must not rely on it.
    x = jnp.ones(shape, jnp.bfloat16)
    x = x.reshape(-1).at[x.size // 2].set(bad).reshape(shape)
    amax, sat = value_stats(x, None if scale is None else jnp.float32(scale), 448.0)
    assert not np.isfinite(float(amax))
    clean_amax, _ = value_stats(jnp.ones(shape, jnp.bfloat16), None, 448.0)
    assert float(clean_amax) == 1.0


@pytest.mark.parametrize("shape", [(300,), (37, 96), (3, 11, 40)])
@pytest.mark.parametrize("scale", [None, 0.005])
def test_value_stats_match_float64_reference(shape, scale):
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), shape, jnp.float32) * 2.0)
    x = jnp.asarray(x).astype(jnp.bfloat16)
    amax, sat = value_stats(x, None if scale is None else jnp.float32(scale), 448.0)
    mag = np.abs(np.asarray(x.astype(jnp.float32), np.float64))
    assert float(amax) == mag.max()
    want = 0.0 if scale is None else float(np.mean(mag > 464.0 * scale))
    assert scale is None or 0.0 < want < 1.0  # the case exercises both sides of the limit
    np.testing.assert_allclose(float(sat), want, rtol=1e-6)
