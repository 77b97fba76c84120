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
