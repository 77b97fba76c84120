"""eae_jax.fp8.state: recipe, guard and contract validation, value statistics,
the fold rules (counts, detaching, scale updates, clipped counts, each at its
threshold), reports, the monitor, states that donate, and the docstrings'
examples of the fp8 modules."""

import doctest
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax import fp8
from eae_jax import observe as O
from eae_jax.fp8 import state as S

R = len(fp8.REASONS)


@pytest.mark.parametrize("module", ["quant", "state", "seams", "block"])
def test_docstring_examples_run(module):
    mod = __import__(f"eae_jax.fp8.{module}", fromlist=[module])
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize("kw, match", [
    (dict(activation="dynamic"), "unknown activation scaling 'dynamic'"),
    (dict(weight="tensor"), r"unknown weight scaling 'tensor'; expected one of \('channel', 'delayed'\)"),
    (dict(gradient="late"), "unknown gradient scaling"),
    (dict(margin=200.0), "margin must be in"),
    (dict(margin=float("nan")), "margin must be in"),
    (dict(grad_margin=-1.0), "grad_margin must be in"),
])
def test_recipe_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        fp8.Recipe(**kw).check()
    with pytest.raises(ValueError, match=match):
        fp8.ffn_seam(**kw)


@pytest.mark.parametrize("cls, kw, match", [
    (fp8.Guard, dict(saturation_threshold=1.0), "saturation_threshold must be in"),
    (fp8.Guard, dict(gate_cos=-1.0), "gate_cos must be in"),
    (fp8.Guard, dict(detach_after=-1), "detach_after must be"),
    (fp8.Contract, dict(dtypes=("bf17",)), "dtypes: unknown dtype 'bf17'"),
    (fp8.Contract, dict(min_rows=-5), "bad row bounds"),
    (fp8.Contract, dict(min_rows=4, max_rows=2), "bad row bounds"),
    (fp8.Contract, dict(platforms=("gpus",)), r"unknown platform\(s\) \['gpus'\]"),
])
def test_guard_and_contract_are_validated_when_made(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_one_platform_name_is_not_split_into_characters():
    assert fp8.Contract(platforms="gpu").platforms == ("gpu",)
    assert fp8.ffn_seam(platforms="gpu").contract.platforms == ("gpu",)
    with pytest.raises(ValueError, match="unknown seam setting 'platform'"):
        fp8.ffn_seam(platform="gpu")


def test_trace_check_boundaries():
    c = fp8.Contract(dtypes=("bf16",), min_rows=2, max_rows=4)
    x = jnp.ones((4, 8), jnp.bfloat16)
    assert S.trace_check(c, x, 8) is None  # max_rows at equality
    assert S.trace_check(c, x[:2], 8) is None  # min_rows at equality
    assert S.trace_check(c, x[:1], 8)[0] == "rows" and S.trace_check(c, jnp.ones((5, 8), jnp.bfloat16), 8)[0] == "rows"
    assert S.trace_check(c, x.astype(jnp.float16), 8)[0] == "dtype"
    assert S.trace_check(fp8.Contract(platforms=("tpu",)), x, 8)[0] == "device"
    with pytest.raises(fp8.GuardRefused, match="bound for width 9"):
        S.trace_check(c, x, 9)
    with pytest.raises(fp8.GuardRefused, match="not floating"):
        S.trace_check(c, x.astype(jnp.int32), 8)


# ---------------------------------------------------------------------- value statistics
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("scale", [None, 0.01])
@pytest.mark.parametrize("shape", [(64,), (33, 64), (2, 5, 7)])
def test_value_stats_amax_is_nonfinite_for_any_nonfinite_element(bad, scale, shape):
    # XLA's CPU max reduction may drop NaNs; the statistic must not rely on it.
    x = jnp.ones(shape, jnp.bfloat16).reshape(-1).at[int(np.prod(shape)) // 2].set(bad).reshape(shape)
    assert not np.isfinite(float(S.value_stats(x, None if scale is None else jnp.float32(scale))[0]))
    assert float(S.value_stats(jnp.ones(shape, jnp.bfloat16), None)[0]) == 1.0


@pytest.mark.parametrize("shape", [(300,), (37, 96), (3, 11, 40)])
@pytest.mark.parametrize("scale", [None, 0.005])
def test_value_stats_match_float64_reference(shape, scale):
    x = (jax.random.normal(jax.random.PRNGKey(3), shape, jnp.float32) * 2.0).astype(jnp.bfloat16)
    amax, sat = S.value_stats(x, None if scale is None else jnp.float32(scale))
    mag = np.abs(np.asarray(x.astype(jnp.float32), np.float64))
    assert float(amax) == mag.max()
    want = 0.0 if scale is None else float(np.mean(mag > 464.0 * np.float32(scale)))
    assert scale is None or 0.0 < want < 1.0  # both sides of the limit are exercised
    np.testing.assert_allclose(float(sat), want, rtol=1e-6)


def test_saturation_limit_at_equality():
    # An element at exactly 464 * scale rounds to 448 anyway: not saturated; the next float32 above is.
    limit = S.saturation_limit("e4m3")
    assert limit == 464.0 and S.saturation_limit("e5m2") == 61440.0
    x = jnp.array([limit, np.nextafter(np.float32(limit), np.float32(np.inf))], jnp.float32)
    assert float(S.value_stats(x[:1], jnp.float32(1.0))[1]) == 0.0
    assert float(S.value_stats(x, jnp.float32(1.0))[1]) == 0.5


# ---------------------------------------------------------------------- fold
def _seen(state, code=-1, act=None, grad=None, weight=None):
    """Observations of one call, as the cotangents a backward would emit (unset: zeros)."""
    o = state.observed

    def arr(v, like):
        return jnp.zeros(like.shape, jnp.float32) if v is None else jnp.asarray(v, jnp.float32)

    gemm = O.emit(o.gemm, {"grad": arr(grad, state.grad_scales), "weight": arr(weight, state.grad_scales)},
                  jnp.ones(o.gemm.calls.shape))
    return S.Observed(O.emit(o.counts, S._call_counts(jnp.int32(code))), O.emit(o.act, arr(act, state.scales)), gemm)


def _fold(state, cot, recipe=fp8.Recipe(), detach_after=32):
    return S.fold(recipe, detach_after, state, S.observations(state, cot))


def test_counts_consecutive_and_detach_at_its_threshold():
    sat = S.reason_index("saturation")
    st = S.new_state(2, 1)
    for _ in range(2):
        st = _fold(st, _seen(st, sat, act=(3.0, jnp.nan)), detach_after=3)
    assert float(st.ledger.consecutive) == 2 and float(st.ledger.detached) == 0  # one below the threshold
    np.testing.assert_allclose(np.asarray(st.ledger.amax), [3.0, 0.0])  # non-finite amax not recorded
    st = _fold(st, _seen(st, -1, act=(1.0, 2.0)), detach_after=3)
    assert float(st.ledger.consecutive) == 0 and float(st.ledger.last_reason) == sat
    np.testing.assert_allclose(np.asarray(st.ledger.amax), [1.0, 2.0])
    for i in range(3):
        st = _fold(st, _seen(st, sat), detach_after=3)
        assert float(st.ledger.detached) == (i == 2)  # detaches at consecutive == detach_after
    st = _fold(st, _seen(st, -1), detach_after=3)
    assert float(st.ledger.detached) == 1  # for good
    assert (float(st.ledger.calls), float(st.ledger.fp8_calls)) == (7.0, 2.0)
    never = S.new_state(1, 1)
    for _ in range(5):
        never = _fold(never, _seen(never, 0), detach_after=None)
    assert float(never.ledger.detached) == 0 and float(never.ledger.calls) == 5


def test_block_and_step_reasons_never_detach_an_innocent_seam():
    innocent = guilty = S.new_state(1, 1)
    for reason in ("block", "step", "block", "step", "block"):
        innocent = _fold(innocent, _seen(innocent, S.reason_index(reason)), detach_after=3)
        guilty = _fold(guilty, _seen(guilty, S.reason_index("saturation")), detach_after=3)
    assert float(innocent.ledger.consecutive) == 0 and float(innocent.ledger.detached) == 0
    assert float(innocent.ledger.calls) == 5 and float(innocent.ledger.fp8_calls) == 0
    assert float(guilty.ledger.consecutive) == 5 and float(guilty.ledger.detached) == 1


@pytest.mark.parametrize("activation", ["static", "delayed", "row"])
def test_activation_scales_follow_the_observed_amax_only_when_delayed(activation):
    st = S.new_state(2, 1, scales=[0.5, 0.25])
    new = _fold(st, _seen(st, act=(4.48, 0.0)), fp8.Recipe(activation=activation, margin=1.0))
    want = [4.48 * 2 / 448, 0.25] if activation == "delayed" else [0.5, 0.25]  # an unobserved point keeps its scale
    np.testing.assert_allclose(np.asarray(new.scales), want, rtol=1e-6)


@pytest.mark.parametrize("gradient", ["current", "delayed"])
def test_gradient_scales_and_clipped_at_the_range_boundary(gradient):
    st = S.new_state(1, 3)._replace(grad_scales=jnp.array([1e-3, 1e-3, 0.0], jnp.float32))
    top = np.float32(1e-3) * np.float32(57344.0)
    over = np.nextafter(top, np.float32(np.inf))
    new = _fold(st, _seen(st, grad=(top, over, 5.0)), fp8.Recipe(gradient=gradient, grad_margin=2.0))
    # at exactly the range's end nothing saturated; beyond it, and with a never-observed scale, it did
    want_clipped = [0.0, 1.0, 1.0] if gradient == "delayed" else [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(np.asarray(new.grad_clipped), want_clipped)
    np.testing.assert_allclose(np.asarray(new.grad_scales), np.array([top, over, 5.0]) * 4 / 57344, rtol=1e-6)
    unseen = _fold(new, _seen(new, grad=(0.0, 0.0, 0.0)), fp8.Recipe(gradient=gradient))
    np.testing.assert_array_equal(np.asarray(unseen.grad_scales), np.asarray(new.grad_scales))


def test_weight_scales_and_clipped_at_the_rounding_limit():
    st = S.new_state(1, 3, weight_scales=[1.0, 1.0, 0.0])
    limit = np.float32(464.0)
    new = _fold(st, _seen(st, weight=(limit, np.nextafter(limit, np.float32(np.inf)), 3.0)))
    np.testing.assert_array_equal(np.asarray(new.weight_clipped), [0.0, 1.0, 0.0])  # an unstarted scale: no event
    np.testing.assert_allclose(np.asarray(new.weight_scales), np.array([464.0, 464.0, 3.0]) / 448, rtol=1e-6)


def test_step_fallback_moves_fp8_calls_and_drops_gemm_observations():
    st = S.new_state(1, 1)
    seen = S.observations(st, _seen(st, -1, grad=(2.0,), weight=(3.0,)))
    for bad in (False, True):
        out = S._as_step_fallback(seen, jnp.bool_(bad))
        assert float(out["counts"]["fp8_calls"]) == (0.0 if bad else 1.0)
        assert float(out["counts"]["reasons"][S.reason_index("step")]) == (1.0 if bad else 0.0)
        assert out["gemm"]["grad"].tolist() == [0.0 if bad else 2.0]
        assert out["gemm"]["weight"].tolist() == [0.0 if bad else 3.0]
    failing = S.observations(st, _seen(st, S.reason_index("nonfinite")))
    assert float(S.own_fallbacks(failing)) == 1.0 and float(S.own_fallbacks(seen)) == 0.0


def test_observations_of_another_shape_are_refused():
    one, stacked = S.new_state(2, 2), jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), S.new_state(2, 2))
    with pytest.raises(ValueError, match="shaped for another state"):
        S.observations(one, stacked)
    with pytest.raises(ValueError, match="expected a SeamState cotangent"):
        S.observations(one, {"calls": 1})


def test_report_shapes_and_names():
    st = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), S.new_state(1, 1))
    rep = fp8.report(st, "o")
    assert [r["seam"] for r in rep] == ["o[0]", "o[1]"]
    assert rep[0] == {"seam": "o[0]", "calls": 0, "fp8_calls": 0, "fallbacks": 0, "by_reason": {},
                      "last_reason": None, "consecutive": 0, "detached": False, "amax": [0.0], "grad_scales": [0.0],
                      "grad_clipped": [0], "weight_scales": [0.0], "weight_clipped": [0]}
    assert fp8.report(S.new_state(2, 2), "ffn")[0]["seam"] == "ffn"
    with pytest.raises(TypeError, match="needs a SeamState"):
        fp8.report({"calls": 1}, "ffn")
    with pytest.raises(ValueError, match="unknown fallback reason"):
        S.reason_index("cosmic rays")


def test_monitor_warns_once_per_seam_and_reason():
    mon = fp8.LedgerMonitor()
    st = S.new_state(1, 1)
    st = _fold(st, _seen(st, S.reason_index("saturation")), detach_after=1)
    with pytest.warns(fp8.Fp8FallbackWarning) as record:
        mon.observe(fp8.report(st, "ffn"))
    assert sorted("detached itself" in str(w.message) for w in record) == [False, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.observe(fp8.report(st, "ffn"))  # said already


# ---------------------------------------------------------------------- buffers
def test_a_fresh_state_holds_no_aliased_buffers_and_donates():
    st = S.new_state(2, 2, scales=np.ones(2), weight_scales=np.ones(2))
    leaves = jax.tree_util.tree_leaves(st)
    assert len({id(a) for a in leaves}) == len(leaves)
    step = jax.jit(lambda s: _fold(s, _seen(s, -1, act=(1.0, 1.0), grad=(1.0, 1.0), weight=(1.0, 1.0))),
                   donate_argnums=(0,))
    for _ in range(2):
        st = step(st)
    assert float(st.ledger.calls) == 2
