"""The carry codec: exact round trips, and robustness to what may happen to a cotangent."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax import carry as carry_lib


def example_tree():
    return {
        "i32": jnp.array([0, 1, 5, -1, -7, 2**31 - 1, -(2**31)], jnp.int32),
        "u32": jnp.array([0, 1, 2**32 - 1, 123456789], jnp.uint32),
        "i8": jnp.array([-128, -1, 0, 127], jnp.int8),
        "flag": jnp.array([True, False]),
        "key": jax.random.split(jax.random.key(42), 3),
        "f32": jnp.array([1.5, -2.25, 1e-30], jnp.float32),
        "bf16": jnp.array([3.0, -0.5], jnp.bfloat16),
    }


def assert_tree_equal(a, b):
    """Same structure, dtypes (key implementations included) and bits."""
    def data(tree):
        return jax.tree_util.tree_map(
            lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)

    chex.assert_trees_all_equal_structs(a, b)
    assert jax.tree_util.tree_map(lambda x: x.dtype, a) == jax.tree_util.tree_map(lambda x: x.dtype, b)
    chex.assert_trees_all_equal_shapes_and_dtypes(data(a), data(b))
    chex.assert_trees_all_equal(data(a), data(b))


def test_round_trip_is_exact_for_every_leaf_kind():
    tree = example_tree()
    enc = carry_lib.encode(tree)
    assert all(jnp.issubdtype(l.dtype, jnp.floating) for l in enc.leaves)
    assert_tree_equal(jax.jit(carry_lib.decode)(enc), tree)


@pytest.mark.parametrize("transform", [
    lambda l: l + jnp.zeros_like(l),                       # a zero cotangent added by autodiff
    lambda l: (l + l + l + l) / 4,                          # averaging identical replicas
    lambda l: l * jnp.ones_like(l),
])
def test_integer_and_key_leaves_survive_cotangent_arithmetic(transform):
    tree = example_tree()
    enc = carry_lib.encode(tree)
    moved = jax.jit(lambda c: jax.tree_util.tree_map(transform, c))(enc)
    assert_tree_equal(carry_lib.decode(moved), tree)


def test_small_integers_are_not_subnormal():
    enc = carry_lib.encode({"n": jnp.array([1, 5, 100], jnp.int32)})
    words = np.asarray(enc.leaves[0])
    tiny = np.finfo(np.float32).tiny
    assert np.all((words == 0) | (np.abs(words) >= tiny))


def test_bad_leaves_and_mismatched_gradients_are_refused():
    with pytest.raises(TypeError, match=r"cannot carry the state leaf \[.x.\]"):
        carry_lib.encode({"x": np.array(["a"])})
    a = carry_lib.encode({"x": jnp.zeros(3)})
    b = carry_lib.encode({"y": jnp.zeros(3)})
    with pytest.raises(ValueError, match="does not belong to this carry"):
        carry_lib.decode_update(a, b)
    with pytest.raises(TypeError, match="expected the AdjointCarry cotangent"):
        carry_lib.decode_update(a, {"x": jnp.zeros(3)})
