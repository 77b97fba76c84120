"""`eae_jax.reconstruct.state`: the key a stack's init takes, the carry it
makes and the checks a carry passes before the backward, by direct calls
(no stack is compiled). Through a stack: tests/test_reconstruct.py.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax import carry as carry_lib
from eae_jax.passes import AdjointTransformation
from eae_jax.reconstruct.state import as_prng_key, check_carry, init_carry

HINT = "make the carry with this stack's init() from params and x of the shapes the stack is called with"
NOT_A_KEY = "init: key must be a jax.random.key, a uint32[2] jax.random.PRNGKey or an int seed; got "


def _key_data(key):
    return np.asarray(jax.random.key_data(key))


# A pass whose state records the key and the adjoint spec it was made with.
RECORDING = AdjointTransformation(
    lambda spec, key: {"key": jax.random.key_data(key), "zeros": jnp.zeros(spec.shape, spec.dtype)},
    lambda g, s, ctx: (g, s), name="recording")


@pytest.mark.parametrize("seed, want", [(None, 0), (0, 0), (5, 5), (np.int32(5), 5), (np.uint64(2**40), 2**40)])
def test_as_prng_key_reads_none_and_int_seeds_as_typed_keys(seed, want):
    got = as_prng_key(seed)
    assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key) and got.shape == ()
    np.testing.assert_array_equal(_key_data(got), _key_data(jax.random.key(want)))


@pytest.mark.parametrize("key", [jax.random.key(3), jax.random.PRNGKey(3), np.array([0, 3], np.uint32)],
                         ids=["typed", "raw", "raw-numpy"])
def test_as_prng_key_passes_a_key_through_unchanged(key):
    assert as_prng_key(key) is key


@pytest.mark.parametrize("key, got", [
    (True, "bool True"),
    (1.5, "float 1.5"),
    ("0", "str '0'"),
    (np.bool_(True), "bool of dtype bool and shape ()"),
    (np.zeros(3, np.uint32), "ndarray of dtype uint32 and shape (3,)"),
    (np.zeros(2, np.int32), "ndarray of dtype int32 and shape (2,)"),
    (np.zeros((1, 2), np.uint32), "ndarray of dtype uint32 and shape (1, 2)"),
])
def test_as_prng_key_names_what_is_not_a_key(key, got):
    with pytest.raises(TypeError) as err:
        as_prng_key(key)
    assert str(err.value) == NOT_A_KEY + got


class _KeyDtypeOnly:
    dtype = jax.random.key(0).dtype

    def __repr__(self):
        return "KeyDtypeOnly()"


@pytest.mark.parametrize("key, got", [
    (jnp.uint32, "_ScalarMeta <class 'jax.numpy.uint32'>"),
    (np.uint32, "type <class 'numpy.uint32'>"),
    (_KeyDtypeOnly(), "_KeyDtypeOnly KeyDtypeOnly()"),
], ids=["jnp-type", "numpy-type", "key-dtype-no-shape"])
def test_as_prng_key_names_a_dtype_holder_that_is_no_array(key, got):
    # A dtype given for the key (key=jnp.uint32) failed with numpy's "Cannot
    # interpret ... as a data type" or an AttributeError on its shape.
    with pytest.raises(TypeError) as err:
        as_prng_key(key)
    assert str(err.value) == NOT_A_KEY + got


@pytest.mark.parametrize("shape", [(2,), (1,)])
def test_as_prng_key_refuses_a_key_array(shape):
    keys = jax.random.split(jax.random.key(0), shape[0])
    with pytest.raises(TypeError) as err:
        as_prng_key(keys)
    assert str(err.value) == f"init: key must be a single PRNG key, got a key array of shape {shape}"


def test_init_carry_gives_each_float_boundary_its_own_split_key():
    # Segments: scanned (2 blocks, float), unscanned (int input), unscanned
    # (bfloat16), scanned (2 blocks, int), then the float16 top boundary.
    f32, i32 = jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)
    bf16, f16 = jax.ShapeDtypeStruct((3,), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.float16)
    specs = [f32, f32, i32, bf16, i32, i32, f16]
    key = jax.random.key(11)
    got = carry_lib.decode(init_carry(RECORDING, [True, False, False, True], [2, 1, 1, 2], specs, key))

    kd = np.asarray(jax.random.key_data(jax.random.split(key, 7)))
    want = {
        "step": np.int32(0),
        "state": {
            "segments": [{"key": kd[0:2], "zeros": np.zeros((2, 2, 3), np.float32)}, None,
                         {"key": kd[3], "zeros": np.zeros((3,), jnp.bfloat16)}, None],
            "top": {"key": kd[6], "zeros": np.zeros((4,), np.float16)},
        },
        "stats": {"adjoint_norm": np.zeros(7, np.float32), "adjoint_norm_after_passes": np.zeros(7, np.float32)},
    }
    chex.assert_trees_all_equal_structs(got, want)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, jax.tree_util.tree_map(jnp.asarray, want))
    chex.assert_trees_all_equal(got, want)


def test_init_carry_statistics_are_float32_under_x64_too():
    # The norms written into them are float32 (norm_f32) whatever the dtypes.
    with jax.enable_x64(True):
        spec = jax.ShapeDtypeStruct((2,), jnp.float64)
        got = carry_lib.decode(init_carry(RECORDING, [True], [2], [spec] * 3, jax.random.key(0)))
    assert got["step"].dtype == jnp.int32
    assert got["stats"]["adjoint_norm"].dtype == got["stats"]["adjoint_norm_after_passes"].dtype == jnp.float32


def test_init_carry_of_an_int_top_has_no_top_state():
    specs = [jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)]
    got = carry_lib.decode(init_carry(RECORDING, [False], [1], specs, jax.random.key(0)))
    assert got["state"]["top"] is None and got["state"]["segments"][0]["zeros"].shape == (2,)


def _carry(scanned, depths, shape=(2,), dtype=jnp.float32):
    spec = jax.ShapeDtypeStruct(shape, dtype)
    return init_carry(RECORDING, scanned, depths, [spec] * (sum(depths) + 1), jax.random.key(0))


def _message(fn):
    with pytest.raises(ValueError) as err:
        fn()
    return str(err.value)


def test_check_carry_accepts_the_carry_made_for_the_call():
    carry = _carry([True, False, True], [2, 1, 0])
    expected = lambda: _carry([True, False, True], [2, 1, 0])  # noqa: E731
    assert check_carry(carry, ["a", "b", "c"], [True, False, True], [2, 1, 0], 4, expected) is None
    assert check_carry(carry, ["a", "b", "c"], [True, False, True], [2, 1, 0], 4) is None


@pytest.mark.parametrize("tree", [
    {"x": jnp.ones(2)},                                                          # no stats
    {"stats": jnp.ones(2), "state": {"segments": []}},                           # stats not a dict
    {"stats": {"adjoint_norm": jnp.float32(0)}, "state": {"segments": []}},      # no boundary axis
    {"stats": {"adjoint_norm": jnp.zeros(3)}},                                   # no state
], ids=["no-stats", "stats-array", "scalar-norms", "no-state"])
def test_check_carry_names_a_carry_not_made_by_init(tree):
    msg = _message(lambda: check_carry(carry_lib.encode(tree), ["a"], [True], [2], 3))
    assert msg == f"the carry was not made by Reconstructed.init ({HINT})"


@pytest.mark.parametrize("names, depths, num", [(["a"], [5], 6), (["a", "b"], [1, 1], 3), (["a", "b"], [2, 0], 3)],
                         ids=["boundaries", "segments-and-boundaries", "segments"])
def test_check_carry_names_another_stack_shape(names, depths, num):
    carry = _carry([True], [2])  # 3 boundaries in 1 segment
    msg = _message(lambda: check_carry(carry, names, [True] * len(names), depths, num))
    assert msg == (f"the carry was made for a stack with 3 boundaries in 1 segments; this call has {num} "
                   f"boundaries in {len(names)} segments (depths {depths}); {HINT}")


def test_check_carry_names_a_scanned_segment_of_another_depth():
    carry = _carry([True, True], [2, 1])  # 4 boundaries
    msg = _message(lambda: check_carry(carry, ["a", "b"], [True, True], [1, 2], 4))
    assert msg == f"the carry's pass state for segment 'a' covers [2] blocks, this call has 1; {HINT}"
    # Unscanned segments hold one state whatever its shape: not read here.
    check_carry(carry, ["a", "b"], [False, False], [1, 2], 4)


def test_check_carry_names_every_depth_a_scanned_state_covers():
    # A hand-made state with a scalar leaf (no depth axis) and a leaf of depth 3.
    tree = {"step": jnp.int32(0), "state": {"segments": [{"s": jnp.float32(0), "v": jnp.zeros((3, 2))}], "top": None},
            "stats": {"adjoint_norm": jnp.zeros(4), "adjoint_norm_after_passes": jnp.zeros(4)}}
    msg = _message(lambda: check_carry(carry_lib.encode(tree), ["seg"], [True], [3], 4))
    assert msg == f"the carry's pass state for segment 'seg' covers [3, None] blocks, this call has 3; {HINT}"


def test_check_carry_compares_the_pass_state_with_what_init_makes():
    carry = _carry([True], [2])
    other_structure = lambda: _carry([False, False], [1, 1])  # noqa: E731
    msg = _message(lambda: check_carry(carry, ["a"], [True], [2], 3, other_structure))
    assert msg == ("the carry's pass state has another structure than this stack's passes make for this call; "
                   + HINT)
    for shape, dtype, path, want in [((3,), jnp.float32, "['segments'][0]['zeros']", "float32[2, 3]"),
                                     ((2,), jnp.bfloat16, "['segments'][0]['zeros']", "bfloat16[2, 2]")]:
        msg = _message(lambda: check_carry(carry, ["a"], [True], [2], 3, lambda: _carry([True], [2], shape, dtype)))
        assert msg == (f"the carry's pass state {path} is float32[2, 2], this call's passes need {want} (params, x "
                       f"or side of other shapes or dtypes than the carry was made for); {HINT}"), msg
    # The top state is compared too, after the segments'.
    tree = carry_lib.decode(carry)
    tree["state"]["top"]["zeros"] = jnp.zeros((2,), jnp.float16)
    msg = _message(lambda: check_carry(carry_lib.encode(tree), ["a"], [True], [2], 3, lambda: carry))
    assert re.match(r"the carry's pass state \['top'\]\['zeros'\] is float16\[2\], this call's passes need "
                    r"float32\[2\]", msg)
