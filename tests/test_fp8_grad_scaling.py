"""Gradient scaling of the fp8 backward: current vs delayed.

Every seam GEMM's backward observes the amax of its output gradient and hands
it out as the cotangent of ``SeamState.grad_scales``; `fold_state` turns it
into the next step's e5m2 scales, which ``grad_scaling='delayed'`` quantizes
with (and counts saturation against).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import fp8
from eae_jax.blocks import BlockConfig, init_stack, init_swiglu, rms_norm

D, F, ROWS = 64, 128, 96
E5M2_MAX = 57344.0


def _setup(grad_scaling="current", margin=2.0):
    p = init_swiglu(jax.random.key(0), D, F)
    xs = jax.random.normal(jax.random.key(7), (ROWS, D))
    h = rms_norm({"scale": jnp.ones((D,))}, xs)
    bound = fp8.bind(fp8.ffn_seam(grad_scaling=grad_scaling, grad_margin=margin), p, [h], residuals=[xs])
    ct = jax.random.normal(jax.random.key(3), (ROWS, D)) * 1e-3
    return p, h, ct, bound


def _grads(seam, state, p, h, ct):
    def loss(p_, h_, s_):
        return jnp.sum(fp8.apply(seam, s_, p_, h_) * ct)

    return jax.grad(loss, argnums=(0, 1, 2))(p, h, state)


def _reference_grad_amax(p, h, ct):
    """float64 amax of the output gradients of the gate|up GEMM and of the
    down GEMM of the high-precision SwiGLU."""
    h = np.asarray(h, np.float64)
    g = h @ np.asarray(p["w_gate"], np.float64).T
    u = h @ np.asarray(p["w_up"], np.float64).T
    ct = np.asarray(ct, np.float64)
    dhid = ct @ np.asarray(p["w_down"], np.float64)
    sig = 1 / (1 + np.exp(-g))
    dg = dhid * u * (sig * (1 + g * (1 - sig)))
    du = dhid * g * sig
    return np.abs(np.concatenate([dg, du], axis=1)).max(), np.abs(ct).max()


def test_backward_observes_gradient_amax_and_fold_turns_it_into_scales():
    p, h, ct, bound = _setup()
    _, _, gstate = _grads(bound.seam, bound.state, p, h, ct)
    obs = np.asarray(gstate.grad_scales)
    ref = _reference_grad_amax(p, h, ct)
    # The down GEMM's output gradient is ct itself: exact. The gate|up one
    # comes out of the fp8 dgrad of the down projection (e5m2 x e4m3).
    np.testing.assert_allclose(obs[1], ref[1], rtol=1e-6)
    np.testing.assert_allclose(obs[0], ref[0], rtol=0.15)
    new = bound.fold(bound.state, gstate, notify=False)
    np.testing.assert_allclose(np.asarray(new.grad_scales), obs * 4.0 / E5M2_MAX, rtol=1e-6)  # margin 2 binades
    np.testing.assert_array_equal(np.asarray(new.grad_clipped), [0.0, 0.0])
    rep = bound.report(new)[0]
    assert rep["grad_scales"] == [float(v) for v in np.asarray(new.grad_scales)] and rep["grad_clipped"] == [0, 0]


def test_delayed_scaling_tracks_current_scaling():
    p, h, ct, bound = _setup()
    gp_cur, gh_cur, gstate = _grads(bound.seam, bound.state, p, h, ct)
    state = bound.fold(bound.state, gstate, notify=False)
    delayed = bound.seam.replace(grad_scaling="delayed")
    fp8.require_grad_scales(delayed, state)
    gp_del, gh_del, gstate2 = _grads(delayed, state, p, h, ct)
    exact = jax.grad(lambda p_, h_: jnp.sum(fp8.seams.high_precision(bound.seam, p_, h_) * ct), argnums=(0, 1))(p, h)

    def cos(a, b):
        a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
        return a @ b / np.linalg.norm(a) / np.linalg.norm(b)

    for got, cur, ref in zip(jax.tree_util.tree_leaves((gp_del, gh_del)), jax.tree_util.tree_leaves((gp_cur, gh_cur)),
                             jax.tree_util.tree_leaves(exact)):
        assert cos(got, ref) > 0.99 and cos(cur, ref) > 0.99
        # two binades of headroom cost delayed scaling little against current
        assert cos(got, ref) > cos(cur, ref) - 5e-3
    # Same gradients observed in the delayed step: nothing clipped.
    np.testing.assert_allclose(np.asarray(gstate2.grad_scales), np.asarray(gstate.grad_scales), rtol=0.15)
    after = fp8.fold_state(delayed, state, gstate2)
    np.testing.assert_array_equal(np.asarray(after.grad_clipped), [0.0, 0.0])


def test_delayed_scale_too_small_saturates_and_is_counted():
    p, h, ct, bound = _setup()
    _, _, gstate = _grads(bound.seam, bound.state, p, h, ct)
    state = bound.fold(bound.state, gstate, notify=False)
    delayed = bound.seam.replace(grad_scaling="delayed")
    # The gradient grows 100x (> 2 binades of margin) after the scales were set.
    gp_big, _, gobs = _grads(delayed, state, p, h, ct * 100.0)
    after = fp8.fold_state(delayed, state, gobs)
    np.testing.assert_array_equal(np.asarray(after.grad_clipped), [1.0, 1.0])
    assert bound.report(after)[0]["grad_clipped"] == [1, 1]
    # The scales follow the observed amax. The down GEMM is in range the next
    # step; the gate|up gradient comes out of the down GEMM's (saturated)
    # dgrad, so its first observation was low and it settles one step later.
    _, _, gobs2 = _grads(delayed, after, p, h, ct * 100.0)
    after2 = fp8.fold_state(delayed, after, gobs2)
    np.testing.assert_array_equal(np.asarray(after2.grad_clipped), [2.0, 1.0])
    _, _, gobs3 = _grads(delayed, after2, p, h, ct * 100.0)
    np.testing.assert_array_equal(np.asarray(fp8.fold_state(delayed, after2, gobs3).grad_clipped), [2.0, 1.0])
    # Under current scaling the same growth is no event.
    cur_after = fp8.fold_state(bound.seam, state, _grads(bound.seam, state, p, h, ct * 100.0)[2])
    np.testing.assert_array_equal(np.asarray(cur_after.grad_clipped), [0.0, 0.0])


def test_delayed_scaling_needs_observed_scales():
    p, h, ct, bound = _setup(grad_scaling="delayed")
    with pytest.raises(ValueError, match=r"gradient scales never observed at \(0,\), \(1,\)"):
        fp8.require_grad_scales(bound.seam, bound.state)
    legacy = fp8.SeamState(bound.state.scales, bound.state.ledger)
    with pytest.raises(ValueError, match="has no grad_scales"):
        fp8.require_grad_scales(bound.seam, legacy)
    with pytest.raises(ValueError, match="grad_scaling='delayed' but its state has no grad_scales"):
        _grads(bound.seam, legacy, p, h, ct)
    # A legacy state still runs with current scaling (nothing observed).
    cur = bound.seam.replace(grad_scaling="current")
    _, _, gstate = _grads(cur, legacy, p, h, ct)
    assert gstate.grad_scales is None


@pytest.mark.parametrize("field, value, match", [("grad_scaling", "late", "unknown grad_scaling"),
                                                 ("grad_margin", -1.0, "grad_margin must be in")])
def test_config_rejects_bad_grad_scaling(field, value, match):
    with pytest.raises(ValueError, match=match):
        fp8.SeamConfig(**{field: value})


def test_bound_block_two_phase_training_under_reconstruct():
    """The protocol a train loop follows: a current-scaling step records the
    gradient scales of every seam and layer, then delayed steps use them;
    counts stay exact and gradients close to the current-scaling ones."""
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128)
    depth = 2
    params = init_stack(jax.random.key(0), cfg, depth)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    bound = fp8.bind_block(cfg, params, [x])

    def step_of(b):
        stack = eae_jax.reconstruct(b.block_fn())

        @jax.jit
        def step(params, state):
            loss, g = jax.value_and_grad(lambda p: jnp.mean(stack(p, x) * ct))(b.params(params, state))
            return g["params"], b.fold(state, g["fp8"], notify=False)

        return step

    with pytest.raises(ValueError, match="never observed"):
        bound.with_grad_scaling("delayed").require_grad_scales(bound.state)
    g_cur, state = step_of(bound.with_grad_scaling("current"))(params, bound.state)
    delayed = bound.with_grad_scaling("delayed")
    delayed.require_grad_scales(state)
    g_del, state2 = step_of(delayed)(params, state)
    for a, b in zip(jax.tree_util.tree_leaves(g_del), jax.tree_util.tree_leaves(g_cur)):
        a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30) > 0.995
    rep = delayed.report(state2)
    assert len(rep) == 3 * depth
    assert all(e["calls"] == 2 and e["fp8_calls"] == 2 and e["grad_clipped"] == [0] * len(e["grad_scales"])
               for e in rep)
    with pytest.raises(ValueError, match="unknown grad_scaling"):
        bound.with_grad_scaling("sometimes")
