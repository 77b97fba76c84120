"""`eae_jax.passes._util`: the argument checks and float32 reductions every
built-in pass uses, by direct calls against plain numpy (the passes
through them: tests/test_passes*.py).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eae_jax.passes._util import (abs_max, divide_exact, flat_f32, norm_f32, require_float_spec, require_int,
                                  require_number, round_trip, sum_f32)


class _ShapeOnly:
    shape = (2,)


class _DtypeOnly:
    dtype = np.dtype(np.float32)

    def __repr__(self):
        return "DtypeOnly"


def _raises(exc, fn):
    with pytest.raises(exc) as err:
        fn()
    return str(err.value)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
def test_require_float_spec_accepts_float_specs(dtype):
    assert require_float_spec("p", jax.ShapeDtypeStruct((2, 0), dtype)) is None


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, jnp.uint8])
def test_require_float_spec_names_a_non_float_dtype(dtype):
    msg = _raises(TypeError, lambda: require_float_spec("clip", jax.ShapeDtypeStruct((2,), dtype)))
    assert msg == f"clip: adjoints are floating arrays; got dtype {np.dtype(dtype)}"


@pytest.mark.parametrize("spec", [_ShapeOnly(), _DtypeOnly(), 3.0])
def test_require_float_spec_names_what_is_not_a_spec(spec):
    msg = _raises(TypeError, lambda: require_float_spec("decay", spec))
    assert msg == f"decay: init expects a jax.ShapeDtypeStruct of the adjoint, got {spec!r}"


@pytest.mark.parametrize("value", [2, 2.5, np.float32(0.25), np.int64(-3), float("inf"), float("-inf")])
def test_require_number_returns_a_python_float(value):
    got = require_number("p", "x", value)
    assert type(got) is float and got == float(value)


@pytest.mark.parametrize("value", [True, False, "1", None, jnp.float32(1.0), np.array([1.0]), 1j])
def test_require_number_refuses_what_is_not_a_real_number(value):
    msg = _raises(TypeError, lambda: require_number("clip", "max_norm", value))
    assert msg == f"clip: max_norm must be a Python number, got {value!r}"


def test_require_number_refuses_nan():
    assert _raises(ValueError, lambda: require_number("clip", "max_norm", float("nan"))) == \
        "clip: max_norm must not be NaN"


@pytest.mark.parametrize("value, low_open, ok", [(-0.5, False, False), (0.0, False, True), (0.0, True, False),
                                                 (1e-300, True, True)])
def test_require_number_low_bound_met_exactly(value, low_open, ok):
    def call():
        return require_number("p", "x", value, low=0.0, low_open=low_open, high=1.0)

    if ok:
        assert call() == value
    else:
        assert _raises(ValueError, call) == f"p: x must be {'>' if low_open else '>='} 0.0, got {value}"


@pytest.mark.parametrize("value, high_open, ok", [(1.5, False, False), (1.0, False, True), (1.0, True, False),
                                                  (1.0 - 2**-53, True, True)])
def test_require_number_high_bound_met_exactly(value, high_open, ok):
    def call():
        return require_number("p", "x", value, low=0.0, high=1.0, high_open=high_open)

    if ok:
        assert call() == value
    else:
        assert _raises(ValueError, call) == f"p: x must be {'<' if high_open else '<='} 1.0, got {value}"


def test_require_number_open_ends_apply_only_with_their_bound():
    # low_open/high_open without a bound, and one open end not the other.
    assert require_number("p", "x", 0.0, low_open=True, high_open=True) == 0.0
    assert require_number("p", "x", 0.0, low=0.0, high=0.0, high_open=False) == 0.0
    assert require_number("p", "x", -1.0, high=0.0, low_open=True) == -1.0
    assert require_number("p", "x", 1.0, low=0.0, high_open=True) == 1.0
    # Both ends closed by default: a bound met exactly is accepted.
    assert require_number("p", "x", 1.0, high=1.0) == 1.0
    assert require_number("p", "x", 0.0, low=0.0) == 0.0


@pytest.mark.parametrize("value, low", [(0, 0), (3, 1), (np.int64(5), 5), (-2, -2)])
def test_require_int_returns_a_python_int_at_or_above_low(value, low):
    got = require_int("p", "n", value, low=low)
    assert type(got) is int and got == int(value)


@pytest.mark.parametrize("value, low", [(-1, None), (0, 1), (np.int32(4), 5)])
def test_require_int_names_a_value_below_low(value, low):
    kw = {} if low is None else {"low": low}
    msg = _raises(ValueError, lambda: require_int("every_n_steps", "n", value, **kw))
    assert msg == f"every_n_steps: n must be >= {0 if low is None else low}, got {value}"


@pytest.mark.parametrize("value", [True, 2.0, "2", None, np.float64(2.0)])
def test_require_int_refuses_what_is_not_an_int(value):
    msg = _raises(TypeError, lambda: require_int("every_n_steps", "n", value, low=1))
    assert msg == f"every_n_steps: n must be a Python int, got {value!r}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("values", [[-2.0], [1.0, -3.0, 2.5], [-0.0, 0.0]])
def test_abs_max_is_the_largest_magnitude_in_the_dtype(values, dtype):
    t = jnp.asarray(values, dtype)
    got = abs_max(t)
    assert got.shape == () and got.dtype == dtype
    assert float(got) == float(np.max(np.abs(np.asarray(values))))


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0, 2)])
def test_abs_max_of_an_empty_adjoint_is_zero(shape):
    got = abs_max(jnp.zeros(shape, jnp.bfloat16))
    assert got.shape == () and got.dtype == jnp.bfloat16 and float(got) == 0.0


@pytest.mark.parametrize("fn", [lambda f, t: f(t), lambda f, t: jax.jit(f)(t)], ids=["eager", "jit"])
def test_flat_f32_is_the_entries_in_order_as_float32(fn):
    t = jnp.asarray(np.arange(24).reshape(2, 3, 4) * 0.37 - 4, jnp.bfloat16)
    got = fn(flat_f32, t)
    assert got.shape == (24,) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(t).astype(np.float32).reshape(-1))


def test_flat_f32_is_float32_under_x64_too():
    with jax.enable_x64(True):
        got = flat_f32(jnp.asarray([[1.0 + 2**-40, 2.0]], jnp.float64))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.array([1.0, 2.0], np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_sum_and_norm_are_float32_reductions_of_every_entry(dtype):
    rng = np.random.default_rng(3)
    g = np.asarray(jnp.asarray(rng.standard_normal((3, 5, 7)) * 40, dtype))  # its square sum is past float16's max
    exact = g.astype(np.float64)
    for fn in (lambda f, t: f(t), lambda f, t: jax.jit(f)(t)):
        s, n = fn(sum_f32, jnp.asarray(g)), fn(norm_f32, jnp.asarray(g))
        assert s.dtype == n.dtype == jnp.float32 and s.shape == n.shape == ()
        np.testing.assert_allclose(float(s), exact.sum(), rtol=0, atol=1e-6 * np.abs(exact).sum())
        np.testing.assert_allclose(float(n), np.sqrt((exact ** 2).sum()), rtol=1e-6)


@pytest.mark.parametrize("fn", [lambda *a: round_trip(*a), jax.jit(round_trip, static_argnums=(1, 2))],
                         ids=["eager", "jit"])
def test_round_trip_rounds_to_the_narrow_dtype_and_returns_back(fn):
    x = jnp.asarray([1.0 + 2**-12, 1.0 + 2**-9, 70000.0, -3.0e-8], jnp.float32)
    got = fn(x, jnp.float16, jnp.bfloat16)
    with np.errstate(over="ignore"):  # 70000 is past float16's max: inf
        want = np.asarray(x).astype(np.float16).astype(ml_dtypes.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
    got32 = fn(x, jnp.bfloat16, jnp.float32)
    assert got32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got32), np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("b", [3.0, 0.1, 7])
def test_divide_exact_is_ieee_division_under_jit(b):
    # a * (1 / b) differs from a / b in about a fifth of the entries.
    a = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    for fn in (divide_exact, jax.jit(divide_exact)):
        got = fn(jnp.asarray(a), b)
        assert got.dtype == jnp.float32 and got.shape == a.shape
        np.testing.assert_array_equal(np.asarray(got), a / np.float32(b))


def test_divide_exact_keeps_the_dividends_dtype():
    a = jnp.asarray([1.0, 3.0, -5.0], jnp.bfloat16)
    got = jax.jit(divide_exact)(a, jnp.float32(3.0))
    assert got.dtype == jnp.bfloat16
    want = np.asarray(a).astype(np.float32) / np.float32(ml_dtypes.bfloat16(3.0))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.astype(ml_dtypes.bfloat16).view(np.uint16))
