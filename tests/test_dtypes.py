"""The dtype policy: names, errors, which tensors run in which precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax.dtypes import (COMPUTE_DTYPE_NAMES, DTypePolicy, dtype_name, finfo_max, is_fp8,
                            parse_compute_dtype)


@pytest.mark.parametrize("name,expected", [
    ("fp32", jnp.float32), ("float32", jnp.float32), (" FP16 ", jnp.float16), ("bf16", jnp.bfloat16),
    ("bfloat16", jnp.bfloat16), ("fp8_e4m3", jnp.float8_e4m3fn), ("float8_e4m3fn", jnp.float8_e4m3fn),
    ("fp8_e5m2", jnp.float8_e5m2), (jnp.bfloat16, jnp.bfloat16), (np.float32, jnp.float32),
    (jnp.dtype(jnp.float16), jnp.float16),
])
def test_names_and_dtype_likes_parse(name, expected):
    assert parse_compute_dtype(name) == jnp.dtype(expected)


@pytest.mark.parametrize("bad", ["fp8", "e4m3", "", "int8", "fp64", 3, None, object()])
def test_unknown_names_list_the_valid_ones(bad):
    with pytest.raises(ValueError, match="valid names are fp32, fp16, bf16, fp8_e4m3, fp8_e5m2"):
        parse_compute_dtype(bad)


@pytest.mark.parametrize("bad", [jnp.int32, np.uint8, bool])
def test_non_floating_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match="not a floating dtype"):
        parse_compute_dtype(bad)


@pytest.mark.parametrize("name", COMPUTE_DTYPE_NAMES)
def test_canonical_names_round_trip(name):
    dtype = parse_compute_dtype(name)
    assert dtype_name(dtype) == name == dtype_name(name)
    assert is_fp8(dtype) == is_fp8(name) == name.startswith("fp8")
    assert finfo_max(name) == finfo_max(dtype) == float(jnp.finfo(dtype).max)


@pytest.mark.parametrize("name,compute,boundary,fp8_format", [
    ("fp32", jnp.float32, None, None),
    ("bf16", jnp.bfloat16, jnp.bfloat16, None),
    ("fp16", jnp.float16, jnp.float16, None),
    ("fp8_e4m3", jnp.bfloat16, jnp.bfloat16, jnp.float8_e4m3fn),
    ("fp8_e5m2", jnp.bfloat16, jnp.bfloat16, jnp.float8_e5m2),
])
def test_policy_from_name(name, compute, boundary, fp8_format):
    pol = DTypePolicy.from_name(name)
    assert pol.param_dtype == jnp.dtype(jnp.float32)
    assert pol.compute_dtype == jnp.dtype(compute)
    assert pol.boundary_dtype == (None if boundary is None else jnp.dtype(boundary))
    assert pol.fp8_format == (None if fp8_format is None else jnp.dtype(fp8_format))


def test_policy_refuses_fp8_params_and_compute():
    with pytest.raises(ValueError, match="param_dtype cannot be an fp8"):
        DTypePolicy(param_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="from_name\\('fp8_e4m3'\\)"):
        DTypePolicy(compute_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="unknown dtype 'f32'"):
        DTypePolicy(boundary_dtype="f32")


def test_cast_params_touches_only_floating_leaves():
    params = {"w": jnp.ones((2, 3)), "step": jnp.int32(4), "nested": (jnp.zeros(2, jnp.float16), None)}
    out = DTypePolicy.from_name("bf16").cast_params(params)
    assert out["w"].dtype == jnp.bfloat16 and out["nested"][0].dtype == jnp.bfloat16
    assert out["step"].dtype == jnp.int32 and out["nested"][1] is None
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.ones((2, 3)))
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)


# Every float of 8 bits or fewer this jax/ml_dtypes has besides the two fp8 formats.
_NARROW_FLOATS = [getattr(jnp, n) for n in (
    "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu",
    "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn") if hasattr(jnp, n)]


def _id(v):
    return v if isinstance(v, str) else np.dtype(v).name


@pytest.mark.parametrize("fmt", ["bf16", "fp32", jnp.float16, "fp8", "e4m3", *_NARROW_FLOATS], ids=_id)
def test_policy_fp8_format_must_be_one_of_the_fp8_formats(fmt):
    with pytest.raises(ValueError, match="fp8_format must be one of fp8_e4m3, fp8_e5m2, float8_e4m3fn, float8_e5m2"):
        DTypePolicy(fp8_format=fmt)
    for ok, want in (("fp8_e4m3", jnp.float8_e4m3fn), ("float8_e5m2", jnp.float8_e5m2), (jnp.float8_e4m3fn, jnp.float8_e4m3fn)):
        assert DTypePolicy(fp8_format=ok).fp8_format == jnp.dtype(want)


@pytest.mark.parametrize("dtype", _NARROW_FLOATS, ids=_id)
def test_every_narrow_float_is_refused_like_float8_e4m3fn(dtype):
    with pytest.raises(ValueError, match=f"compute_dtype cannot be fp8 directly \\(got {jnp.dtype(dtype)}"):
        DTypePolicy(compute_dtype=dtype)
    with pytest.raises(ValueError, match=f"param_dtype cannot be an fp8 format \\(got {jnp.dtype(dtype)}"):
        DTypePolicy(param_dtype=dtype)
    with pytest.raises(ValueError, match="fp8_format must be one of fp8_e4m3, fp8_e5m2"):
        DTypePolicy.from_name(dtype)  # was a policy computing in that dtype


@pytest.mark.parametrize("fn", [is_fp8, dtype_name, finfo_max], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad,match", [(None, "a dtype must be given, got None"), (object(), "unknown dtype")],
                         ids=["None", "object"])
def test_dtype_helpers_refuse_none_and_non_dtypes(fn, bad, match):
    # None used to mean float64 (jnp.dtype(None)); an object gave numpy's raw TypeError.
    with pytest.raises(ValueError, match=f"{fn.__name__}: {match}"):
        fn(bad)
    for field in ("param_dtype", "compute_dtype"):
        with pytest.raises(ValueError, match=f"DTypePolicy {field} must be given"):
            DTypePolicy(**{field: None})


@pytest.mark.parametrize("bad", [jnp.int32, np.uint8, bool, np.complex64], ids=_id)
def test_finfo_max_refuses_non_floating_dtypes(bad):
    with pytest.raises(ValueError, match=f"finfo_max: {np.dtype(bad)} is not a floating dtype"):
        finfo_max(bad)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, jnp.bfloat16, jnp.float8_e4m3fn,
                                   jnp.float8_e5m2, *_NARROW_FLOATS], ids=_id)
def test_finfo_max_matches_ml_dtypes(dtype):
    import ml_dtypes

    assert finfo_max(dtype) == float(ml_dtypes.finfo(np.dtype(dtype)).max)
