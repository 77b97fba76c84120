"""`eae_jax.observe`: observations out of a backward pass, and how uses combine."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax import carry as carry_lib
from eae_jax import observe as O


def _use(x, h, seen):
    return jnp.sum(O.observe(x, h, seen) ** 2)


@pytest.mark.parametrize("uses", [1, 2, 3])
def test_sum_handle_totals_every_use_exactly(uses):
    h = O.handle({"n": jnp.zeros(()), "v": jnp.zeros((2,))}, reduce="sum")
    seen = [{"n": jnp.float32(k + 1), "v": jnp.arange(2.0) * (k + 1)} for k in range(uses)]

    def loss(x, h):
        return sum(_use(x, h, s) for s in seen)

    g = jax.jit(jax.grad(loss, argnums=1))(jnp.ones(3), h)
    got, calls = O.receive(h, g)
    assert float(calls) == uses
    np.testing.assert_array_equal(got["n"], sum(range(1, uses + 1)))
    np.testing.assert_array_equal(got["v"], np.arange(2.0) * sum(range(1, uses + 1)))


def test_max_handle_is_exact_once_and_an_upper_bound_when_shared():
    h = O.handle({"m": jnp.zeros(())}, reduce="max")
    once = jax.grad(lambda x, h: _use(x, h, {"m": jnp.float32(3)}), argnums=1)(1.0, h)
    assert float(O.receive(h, once)[0]["m"]) == 3.0
    twice = jax.grad(lambda x, h: _use(x, h, {"m": jnp.float32(3)}) + _use(x, h, {"m": jnp.float32(5)}),
                     argnums=1)(1.0, h)
    got, calls = O.receive(h, twice)
    assert float(calls) == 2.0
    assert float(got["m"]) == 8.0  # the sum of the maxima: >= max, <= calls * max
    assert 5.0 <= float(got["m"]) <= float(calls) * 5.0


def test_combine_takes_exact_max_and_sum_across_separate_differentiations():
    for reduce, want in (("max", 5.0), ("sum", 7.0)):
        h = O.handle({"m": jnp.zeros(())}, reduce=reduce)
        a = jax.grad(lambda x, h: _use(x, h, {"m": jnp.float32(2)}), argnums=1)(1.0, h)
        b = jax.grad(lambda x, h: _use(x, h, {"m": jnp.float32(5)}), argnums=1)(1.0, h)
        got, calls = O.receive(h, O.combine(a, b))
        assert (float(got["m"]), float(calls)) == (want, 2.0)


def test_combine_refuses_replace_cotangents_and_foreign_handles():
    r = carry_lib.encode({"s": jnp.zeros(())})
    with pytest.raises(ValueError, match="replace"):
        O.combine(r, r)
    a = O.handle({"m": jnp.zeros(())}, reduce="max")
    b = O.handle({"m": jnp.zeros(())}, reduce="sum")
    with pytest.raises(ValueError, match="does not belong"):
        O.combine(a, b)
    with pytest.raises(TypeError, match="cotangent"):
        O.receive(a, {"m": jnp.zeros(())})


def test_non_finite_observations_count_as_nothing():
    h = O.handle({"m": jnp.zeros((3,))}, reduce="max")
    seen = {"m": jnp.array([jnp.nan, jnp.inf, 2.0])}
    g = jax.grad(lambda x, h: _use(x, h, seen), argnums=1)(1.0, h)
    np.testing.assert_array_equal(O.receive(h, g)[0]["m"], [0.0, 0.0, 2.0])


def test_replace_handle_takes_the_emitted_state_only_from_exactly_one_use():
    old = {"step": jnp.int32(4), "key": jax.random.key(1), "f": jnp.float32(1.5)}
    new = {"step": jnp.int32(5), "key": jax.random.key(2), "f": jnp.float32(-2.0)}
    h = O.handle(old, reduce="replace")

    @jax.custom_vjp
    def f(x, h):
        return x

    f.defvjp(lambda x, h: (x, h), lambda h, g: (g, O.emit(h, new)))
    once = jax.grad(lambda x, h: f(x, h), argnums=1)(1.0, h)
    twice = jax.grad(lambda x, h: f(x, h) + f(x, h), argnums=1)(1.0, h)
    got, calls = O.receive(h, once)
    assert float(calls) == 1.0
    assert int(got["step"]) == 5 and float(got["f"]) == -2.0
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(new["key"]))
    kept, calls = O.receive(h, twice)
    assert float(calls) == 2.0
    assert int(kept["step"]) == 4 and float(kept["f"]) == 1.5


def test_a_checkpointed_forward_runs_twice_but_observes_once():
    h = O.handle({"n": jnp.zeros(())}, reduce="sum")
    body = jax.checkpoint(lambda x, h: jnp.sin(O.observe(x, h, {"n": jnp.float32(1)})))
    g = jax.grad(lambda x, h: jnp.sum(body(x, h)), argnums=1)(jnp.ones(4), h)
    assert float(O.receive(h, g)[0]["n"]) == 1.0


def test_stacked_handles_scanned_over_depth_are_one_use_each():
    depth = 4
    h = jax.vmap(lambda _: O.handle({"m": jnp.zeros(())}, reduce="max"))(jnp.arange(depth))
    assert h.calls.shape == (depth,)

    def loss(x, h):
        def body(c, hi_i):
            hi, i = hi_i
            return O.observe(c * 1.5, hi, {"m": i.astype(jnp.float32) * 10}), None
        y, _ = jax.lax.scan(body, x, (h, jnp.arange(depth)))
        return jnp.sum(y)

    g = jax.jit(jax.grad(loss, argnums=1))(jnp.ones(2), h)
    got, calls = O.receive(h, g)
    np.testing.assert_array_equal(calls, np.ones(depth))
    np.testing.assert_array_equal(got["m"], np.arange(depth) * 10.0)


def test_emit_refuses_a_changed_structure_dtype_or_shape():
    h = O.handle({"s": jnp.int32(0), "f": jnp.zeros((2,))}, reduce="replace")
    with pytest.raises(ValueError, match="structure changed"):
        O.emit(h, {"s": jnp.int32(0)})
    with pytest.raises(ValueError, match=r"\['s'\] changed dtype from int32 to float32"):
        O.emit(h, {"s": jnp.float32(0), "f": jnp.zeros((2,))})
    with pytest.raises(ValueError, match=r"\['f'\] changed shape"):
        O.emit(h, {"s": jnp.int32(0), "f": jnp.zeros((3,))})


def test_sum_and_max_handles_refuse_non_float_and_unknown_reduce():
    with pytest.raises(TypeError, match="floating observations only"):
        O.handle({"n": jnp.int32(0)}, reduce="sum")
    with pytest.raises(ValueError, match="reduce must be one of"):
        O.handle({"n": jnp.zeros(())}, reduce="mean")


def test_aliased_template_leaves_are_copied_so_the_handle_can_be_donated():
    zero = jnp.zeros((4,))
    for reduce in O.REDUCES:
        h = O.handle({"a": zero, "b": zero, "c": zero}, reduce=reduce)
        ptrs = [leaf.unsafe_buffer_pointer() for leaf in h.leaves]
        assert len(set(ptrs)) == len(ptrs), reduce
        out = jax.jit(lambda h: jax.tree_util.tree_map(lambda l: l + 1, h), donate_argnums=0)(h)
        chex.assert_trees_all_close(O.value(out)["a"], jnp.ones(4))


@pytest.mark.parametrize("calls, fragment", [
    (0.0, "did not run"),
    (2.0, "ran 2 times"),
    (0.5, "was changed after differentiation"),
    (1.5, "was changed after differentiation"),
])
def test_carry_refusal_names_what_happened(calls, fragment):
    assert fragment in carry_lib.bad_calls_message(calls)
    with pytest.raises(RuntimeError, match=fragment):
        carry_lib._raise_on_bad_calls(np.float32(calls))
    carry_lib._raise_on_bad_calls(np.float32(1.0))


@pytest.mark.parametrize("dtype, kind", [
    (jnp.int8, "widen"), (jnp.uint16, "widen"), (jnp.bool_, "widen"),  # narrower than a 32-bit word
    (jnp.int32, "bits32"), (jnp.uint32, "bits32"),                      # exactly one word
    (jnp.bfloat16, "float"), (jnp.float32, "float"),
])
def test_leaves_up_to_32_bits_round_trip_at_their_extremes(dtype, kind):
    info = jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else None
    values = ([info.min, info.min + 1, -1 if info.min < 0 else 1, 0, info.max - 1, info.max] if info is not None
              else [True, False] if dtype == jnp.bool_ else [-3.5, 0.0, 1e-30, 6.5e4])
    leaf = jnp.array(values, dtype)
    assert O.codec_for(leaf) == O.LeafCodec(kind, jnp.dtype(dtype).name)
    back = O.value(O.handle({"x": leaf}, reduce="replace"))["x"]
    assert back.dtype == leaf.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(leaf))


def test_leaves_wider_than_32_bits_are_refused_by_name():
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match="wider than 32 bits"):
            O.codec_for(jnp.zeros(2, jnp.int64))
        with pytest.raises(TypeError, match=r"state leaf \['n'\].*wider than 32 bits"):
            O.handle({"n": jnp.zeros(2, jnp.uint64)}, reduce="replace")
