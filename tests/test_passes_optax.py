"""Passes and optax both ways: `to_optax` in an optax chain, hyper-parameters
that follow optax schedules of the step (`eae_jax.passes.schedule`)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eae_jax
from eae_jax import passes as P
from eae_jax.passes.spec import PASSES, parse_passes


def _regression():
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": 2.0 * jax.random.normal(k[0], (4, 3)), "b": jnp.full((3,), 3.0)}
    x = jax.random.normal(k[1], (16, 4))
    y = x @ jax.random.normal(k[2], (4, 3))
    return params, x, y


def _loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def test_optax_chain_with_a_clipping_pass_trains_like_per_leaf_clipping_then_adam():
    params, x, y = _regression()
    tx = optax.chain(P.to_optax(P.clip_by_norm(1.0)), optax.adam(0.1))
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    ref_tx, ref_params = optax.adam(0.1), params
    ref_grad = jax.jit(jax.grad(_loss))
    ref_state = ref_tx.init(ref_params)
    clipped, losses = 0, []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
        clip_states = state[0].passes
        clipped += sum(bool(c.clipped) for c in clip_states)
        # the reference: each leaf's norm bounded in float64, then optax's adam
        g = ref_grad(ref_params, x, y)
        norms = {k: np.linalg.norm(np.asarray(v, np.float64)) for k, v in g.items()}
        g = {k: jnp.asarray(np.asarray(v, np.float64) * (1.0 / (norms[k] + 1e-6) if norms[k] > 1.0 else 1.0),
                            jnp.float32) for k, v in g.items()}
        u, ref_state = ref_tx.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    for k in params:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref_params[k]), rtol=1e-5, atol=1e-6)
    assert clipped >= 2, "the bound was never reached: the test would not see the clipping"
    assert losses[-1] < 0.1 * losses[0]
    assert int(state[0].step) == 30


class Seen(NamedTuple):
    boundary: jax.Array
    block: jax.Array
    step: jax.Array
    num: jax.Array


def _recorder():
    def init(spec, key):
        return Seen(jnp.int32(-1), jnp.int32(-1), jnp.int32(-1), jnp.int32(-1))

    def update(g, state, ctx):
        return g * 2.0, Seen(ctx.boundary, ctx.block, ctx.step, jnp.int32(ctx.num_boundaries))

    return P.AdjointTransformation(init, update, "recorder")


def test_each_float_leaf_is_one_boundary_with_the_update_count_as_step():
    params = {"a": jnp.ones(2), "n": jnp.arange(3), "z": jnp.ones((2, 2))}
    tx = P.to_optax(_recorder())
    state = tx.init(params)
    assert state.passes[1] is None  # the int leaf has no pass state
    for step in range(2):
        updates, state = tx.update(params, state)
    assert [int(s.boundary) for s in (state.passes[0], state.passes[2])] == [0, 2]
    assert [int(s.block) for s in (state.passes[0], state.passes[2])] == [0, 2]  # block is the leaf index too
    assert [int(s.step) for s in (state.passes[0], state.passes[2])] == [1, 1]
    assert int(state.passes[0].num) == 3
    np.testing.assert_array_equal(updates["a"], 2.0 * params["a"])
    np.testing.assert_array_equal(updates["n"], params["n"])  # not floating: untouched
    # at_layers picks leaves by index
    tx = P.to_optax(P.at_layers(_recorder(), [-1]))
    updates, _ = tx.update(params, tx.init(params))
    np.testing.assert_array_equal(updates["a"], params["a"])
    np.testing.assert_array_equal(updates["z"], 2.0 * params["z"])
    with pytest.raises(TypeError, match="the updates have 2 leaves, the params given to init had 3"):
        tx.update({"a": params["a"], "z": params["z"]}, tx.init(params))


def test_a_keyed_pass_draws_from_the_key_split_once_per_leaf():
    params = {"a": jnp.zeros(5), "b": jnp.zeros((2, 3))}
    tx = P.to_optax(P.gaussian_noise(0.5), key=jax.random.key(7))
    state = tx.init(params)
    keys = list(jax.random.split(jax.random.key(7), 2))  # one per leaf, in tree_leaves order
    for _ in range(2):
        updates, state = jax.jit(tx.update)(params, state)
        for i, name in enumerate(["a", "b"]):  # each call splits the leaf's key, draws from the second half
            keys[i], sub = jax.random.split(keys[i])
            want = 0.5 * jax.random.normal(sub, params[name].shape)
            np.testing.assert_allclose(np.asarray(updates[name]), np.asarray(want), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- schedules
def test_scheduled_gaussian_noise_follows_its_schedule_in_a_stack():
    schedule = optax.linear_schedule(0.0, 1.0, transition_steps=2)
    stack = eae_jax.reconstruct(lambda w, x: x * w, passes=P.gaussian_noise(schedule))
    w, x = jnp.ones((1, 64)), jnp.linspace(0.5, 1.5, 64)
    carry = stack.init(w, x, jax.random.key(3))

    @jax.jit
    def step(carry):
        g_w, g_c = jax.grad(lambda w, c: jnp.sum(stack(w, x, c)), argnums=(0, 1))(w, carry)
        new, _ = stack.update(carry, g_c)
        return g_w, new

    for t in range(4):
        key = stack.state(carry)["top"].key  # the output boundary's noise key before this step
        g_w, carry = step(carry)
        # dL/dx1 = 1 + std(t) * noise; block 0's weight gradient is x times that
        noise = jax.random.normal(jax.random.split(key)[1], (64,))
        want = x * (1.0 + float(schedule(t)) * noise)
        np.testing.assert_allclose(np.asarray(g_w[0]), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert [float(schedule(t)) for t in range(4)] == [0.0, 0.5, 1.0, 1.0]  # the steps saw each value


@pytest.mark.parametrize("make, want", [
    (lambda s: P.decay(s), lambda g, v: g * (1.0 - v)),
    (lambda s: P.clip_by_norm(s), lambda g, v: g * min(1.0, v / (np.linalg.norm(g) + 1e-6))),
    (lambda s: P.gaussian_noise(s), None),
], ids=["decay", "clip_by_norm", "gaussian_noise"])
def test_a_schedule_is_read_at_the_pass_context_step(make, want):
    schedule = optax.piecewise_constant_schedule(0.75, {2: 0.5, 4: 0.2})
    pass_ = make(schedule)
    g = jnp.array([3.0, -4.0, 1.0])
    state = pass_.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0))
    for step in range(6):
        out, _ = jax.jit(pass_.update)(g, state, P.PassContext(jnp.int32(0), jnp.int32(0), jnp.int32(step), 2))
        value = float(schedule(step))
        if want is None:  # noise: the same draw at each step (the state is not advanced), scaled by std(step)
            noise = jax.random.normal(jax.random.split(state.key)[1], g.shape)
            expected = np.asarray(g) + value * np.asarray(noise)
        else:
            expected = want(np.asarray(g, np.float64), value)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)
    assert pass_.name.endswith("(schedule)")


def test_clip_by_norm_follows_a_schedule_through_zero_and_below():
    """A scheduled bound is read at each step; once it reaches 0 or goes negative the
    adjoint is zeroed (the bound is taken as max(bound, 0)), not flipped in sign."""
    schedule = optax.linear_schedule(6.0, -2.0, 4)  # 6, 4, 2, 0, -2, -2
    clip = P.clip_by_norm(schedule)
    g = jnp.array([3.0, -4.0])  # norm 5
    state = clip.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None)
    update = jax.jit(clip.update)
    for step in range(6):
        out, state = update(g, state, P.PassContext(jnp.int32(0), jnp.int32(0), jnp.int32(step), 2))
        bound = max(float(schedule(step)), 0.0)
        want = np.asarray(g, np.float64) * (bound / (5.0 + 1e-6) if bound < 5.0 else 1.0)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=0, err_msg=f"step {step}")
        assert bool(state.clipped) == (bound < 5.0) and float(state.norm) == 5.0
    assert [float(schedule(t)) for t in range(6)] == [6.0, 4.0, 2.0, 0.0, -2.0, -2.0]


def test_a_scheduled_decay_rounds_a_bfloat16_adjoint_once():
    """The factor 1 - strength(step) in float32, the product rounded once to the adjoint's dtype."""
    import ml_dtypes

    schedule = optax.linear_schedule(0.0, 0.74, 2)  # 0, 0.37, 0.74
    decay = P.decay(schedule)
    g = jnp.asarray(np.random.default_rng(0).standard_normal(64), jnp.bfloat16)
    update = jax.jit(decay.update)
    for step in range(3):
        out, _ = update(g, P.EmptyState(), P.PassContext(jnp.int32(0), jnp.int32(0), jnp.int32(step), 2))
        factor = np.float32(1.0) - np.float32(schedule(step))
        want = (np.asarray(g, np.float32) * factor).astype(ml_dtypes.bfloat16)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out).astype(np.float32), want.astype(np.float32), err_msg=f"step {step}")


def test_schedules_are_checked_at_step_zero():
    with pytest.raises(ValueError, match="gaussian_noise: std schedule at step 0: std must be >= 0.0, got -1.0"):
        P.gaussian_noise(lambda step: -1.0 + step)
    with pytest.raises(TypeError, match="clip_by_norm: a max_norm schedule must return a real scalar"):
        P.clip_by_norm(lambda step: jnp.ones(2))
    with pytest.raises(TypeError, match="decay: the strength schedule failed at step 0: no"):
        P.decay(lambda step: (_ for _ in ()).throw(RuntimeError("no")))
    with pytest.raises(ValueError, match="decay: strength must be finite, got inf"):
        P.decay(float("inf"))
    assert P.gaussian_noise(lambda step: 0.0 * step).name == "gaussian_noise(schedule)"  # 0 at step 0 is allowed


def test_a_schedule_value_at_step_zero_is_checked_like_a_number():
    """A real scalar (integer or float) passes; other dtypes, shapes and values out of
    bounds are refused with the whole message; finite is checked for a schedule too."""
    assert P.decay(lambda step: 1).name == "decay(schedule)"  # an integer is a real scalar
    for schedule, got in [(lambda step: 1j, "complex128[]"), (lambda step: True, "bool[]"),
                          (lambda step: jnp.ones(2), "float32[2]")]:
        with pytest.raises(TypeError) as err:
            P.decay(schedule)
        assert str(err.value) == f"decay: a strength schedule must return a real scalar, got {got} at step 0"
    with pytest.raises(ValueError) as err:
        P.decay(lambda step: jnp.inf + 0.0 * step)
    assert str(err.value) == "decay: strength schedule at step 0: strength must be finite, got inf"
    # an infinite clipping bound is a number > 0 (no clipping): finite is off by default
    assert P.clip_by_norm(float("inf")).name == "clip_by_norm(inf)"
    assert P.clip_by_norm(lambda step: jnp.inf + 0.0 * step).name == "clip_by_norm(schedule)"


def test_the_command_line_still_takes_numbers_for_schedulable_hyperparameters():
    assert {p.name: p.kind for p in PASSES["noise"].params} == {"std": float}
    assert {p.name: p.kind for p in PASSES["clip"].params} == {"max_norm": float}
    assert parse_passes("noise=0.25,decay(strength=0.5),clip").name == \
        "chain(gaussian_noise(0.25), decay(0.5), clip_by_norm(1))"
