"""Delayed per-tensor weight scales (``weight_scaling='delayed'``).

The forward quantizes each weight with a scale kept in the seam state (from
the amax observed in an earlier step), so the quantization waits for no
reduction over the weight; a differentiated call observes the weight amax and
hands it out as the cotangent of the scale handle; `fold_state` turns it into
the next scale and counts weights that outgrew their scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import fp8
from eae_jax.blocks import BlockConfig, init_stack, init_swiglu, rms_norm
from eae_jax.fp8 import quant
from jaxpr_walk import ancestors, reads

E4M3_MAX = 448.0


def _rand(key, shape, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


def _amax64(*ws):
    return max(float(np.abs(np.asarray(w, np.float64)).max()) for w in ws)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("rows", [(24,), (16, 8)])
def test_delayed_scale_equal_to_current_amax_is_tensor_scaling_bit_for_bit(per_row, rows):
    """Given the scale per-tensor scaling would compute, delayed scaling gives
    the same output and gradients, and observes the weight amax (of all
    blocks) as the handle's cotangent."""
    x = _rand(0, (32, 48), 1.0, jnp.bfloat16)
    blocks = tuple(_rand(1 + i, (r, 48), 0.05 * (i + 1), jnp.bfloat16) for i, r in enumerate(rows))
    xs = quant.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.01)
    ws = quant.scale_from_amax(quant.weight_amax(blocks))
    np.testing.assert_allclose(float(ws), _amax64(*blocks) / E4M3_MAX, rtol=1e-6)
    g = _rand(9, (32, sum(rows)), 1.0, jnp.bfloat16)

    y_t, vjp_t = jax.vjp(lambda a, b: fp8.fp8_linear(a, b, xs, weight_scaling="tensor"), x, blocks)
    y_d, vjp_d = jax.vjp(lambda a, b, s: fp8.fp8_linear(a, b, xs, weight_scaling="delayed", weight_scale=s),
                         x, blocks, ws)
    np.testing.assert_array_equal(np.asarray(y_d, np.float32), np.asarray(y_t, np.float32))
    (dx_t, dw_t), (dx_d, dw_d, obs) = vjp_t(g), vjp_d(g)
    np.testing.assert_array_equal(np.asarray(dx_d, np.float32), np.asarray(dx_t, np.float32))
    for a, b in zip(dw_d, dw_t):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_allclose(float(obs), _amax64(*blocks), rtol=1e-6)


def test_delayed_scale_is_used_and_saturates_beyond_its_range():
    """A scale made for half the weight's amax: the forward equals a float64
    reference quantizing with that scale (largest weights clipped to
    +-448 * scale), not the per-tensor result; the observation is still the
    true amax."""
    x = _rand(0, (16, 32), 1.0)
    w = _rand(1, (8, 32), 0.1)
    xs = jnp.float32(0.01)
    true_scale = quant.scale_from_amax(quant.weight_amax((w,)))
    small = true_scale / 2
    y, vjp = jax.vjp(lambda s: fp8.fp8_linear(x, w, xs, weight_scaling="delayed", weight_scale=s), small)
    ref = quant.reference_linear(x, w, xs, "delayed", small)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref, quant.reference_linear(x, w, xs, "tensor"), rtol=1e-3)
    clipped = np.clip(np.asarray(w, np.float64), -448 * float(small), 448 * float(small))
    assert np.abs(np.asarray(w)).max() > np.abs(clipped).max()  # the largest weights really saturate
    (obs,) = vjp(jnp.ones_like(y))
    np.testing.assert_allclose(float(obs), _amax64(w), rtol=1e-6)


def test_delayed_weight_quantization_does_not_wait_for_a_weight_reduction():
    """What delayed weight scales buy: no e4m3 weight in the forward depends
    on a reduce_max over the weight (per-tensor current scaling does)."""
    x, w = _rand(0, (16, 32)), _rand(1, (8, 32), 0.1)

    def waits_for_weight_amax(weight_scaling, **kw):
        # Traced through the VJP's forward rule (what a train step runs), so
        # its equations are at the top level, the amax observation included.
        jaxpr = jax.make_jaxpr(lambda w_: jax.vjp(
            lambda v: fp8.fp8_linear(x, v, jnp.float32(0.01), weight_scaling=weight_scaling, **kw), w_)[0])(w).jaxpr
        w_var = jaxpr.invars[0]
        # the e4m3 weight: the fp8 array shaped like w
        wq = [v for e in jaxpr.eqns for v in e.outvars
              if v.aval.dtype == jnp.float8_e4m3fn and v.aval.shape == w.shape]
        assert wq, "no e4m3 weight in the forward"
        return any(e.primitive.name == "reduce_max" and reads(jaxpr, e, w_var) for e in ancestors(jaxpr, *wq))

    assert waits_for_weight_amax("tensor")
    assert not waits_for_weight_amax("delayed", weight_scale=jnp.float32(1e-3))


def test_bad_weight_scale_arguments_are_refused():
    x, w = _rand(0, (4, 8)), _rand(1, (6, 8))
    with pytest.raises(ValueError, match="weight_scaling='delayed' needs a weight_scale"):
        fp8.fp8_linear(x, w, jnp.float32(1.0), weight_scaling="delayed")
    with pytest.raises(ValueError, match="only used with weight_scaling='delayed'"):
        fp8.fp8_linear(x, w, jnp.float32(1.0), weight_scaling="tensor", weight_scale=jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"weight_scale must be a float32 scalar, got shape \(2,\)"):
        fp8.fp8_linear(x, w, jnp.float32(1.0), weight_scaling="delayed", weight_scale=jnp.ones((2,)))
    with pytest.raises(ValueError, match="frozen Fp8Weight, which keeps its own scales"):
        fp8.fp8_linear(x, fp8.quantize_weight(w), jnp.float32(1.0), weight_scale=jnp.float32(1.0))


def _ffn_setup(**config):
    p = init_swiglu(jax.random.key(0), 64, 128)
    xs = jax.random.normal(jax.random.key(7), (96, 64))
    h = rms_norm({"scale": jnp.ones((64,))}, xs)
    return p, h, xs, fp8.ffn_seam(**config)


def test_bind_starts_from_the_weights_and_matches_per_tensor_scaling():
    p, h, xs, seam = _ffn_setup(weight_scaling="delayed")
    bound = fp8.bind(seam, p, [h], residuals=[xs])
    want = np.array([_amax64(p["w_gate"], p["w_up"]), _amax64(p["w_down"])]) / E4M3_MAX
    np.testing.assert_allclose(np.asarray(bound.state.weight_scales), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(bound.state.weight_clipped), [0.0, 0.0])
    tensor = fp8.bind(seam.replace(weight_scaling="tensor"), p, [h], residuals=[xs])
    assert tensor.state.weight_scales is None  # other modes keep the old state layout
    np.testing.assert_array_equal(np.asarray(bound(bound.state, p, h)), np.asarray(tensor(tensor.state, p, h)))
    assert bound.certification.worst_cos == tensor.certification.worst_cos
    rep = bound.report(bound.state)[0]
    assert rep["weight_scales"] == pytest.approx(want.tolist(), rel=1e-6) and rep["weight_clipped"] == [0, 0]


def test_state_without_weight_scales_is_refused():
    p, h, _, seam = _ffn_setup(weight_scaling="delayed")
    with pytest.raises(ValueError, match="weight_scaling='delayed': its state starts from the weights"):
        fp8.init_state(seam, [0.01, 0.01])
    legacy = fp8.init_state(seam.replace(weight_scaling="channel"), [0.01, 0.01])
    with pytest.raises(ValueError, match="has weight_scaling='delayed' but its state has no weight_scales"):
        fp8.apply(seam, legacy, p, h)
    with pytest.raises(ValueError, match="pass the stacked block params"):
        fp8.init_block_state(fp8.block_seams(config=fp8.SeamConfig(weight_scaling="delayed")), 2)


def test_fold_follows_the_weights_and_counts_a_weight_that_outgrew_its_scale():
    p, h, xs, seam = _ffn_setup(weight_scaling="delayed")
    bound = fp8.bind(seam, p, [h], residuals=[xs])
    ct = jax.random.normal(jax.random.key(3), (96, 64))

    def observe(state, params):
        return jax.grad(lambda s: jnp.sum(fp8.apply(seam, s, params, h) * ct))(state)

    # The weights moved (a training step): the observation is the new amax,
    # the fold makes it the next scale, nothing was clipped while they shrank.
    shrunk = jax.tree_util.tree_map(lambda w: w * 0.75, p)
    state = fp8.fold_state(seam, bound.state, observe(bound.state, shrunk))
    want = np.array([_amax64(shrunk["w_gate"], shrunk["w_up"]), _amax64(shrunk["w_down"])]) / E4M3_MAX
    np.testing.assert_allclose(np.asarray(state.weight_scales), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.weight_clipped), [0.0, 0.0])
    # Weights that grew by 2%: their largest values land within rounding of
    # 448 (up to 464 rounds to 448 anyway): nothing counted as clipped.
    state_hair = fp8.fold_state(seam, state, observe(state, jax.tree_util.tree_map(lambda w: w * 1.02, shrunk)))
    np.testing.assert_array_equal(np.asarray(state_hair.weight_clipped), [0.0, 0.0])
    # Weights that grew by half since: quantized with the old scale they saturate,
    # the step is counted per GEMM, and the next scale covers them again.
    grown = jax.tree_util.tree_map(lambda w: w * 1.5, shrunk)
    state2 = fp8.fold_state(seam, state, observe(state, grown))
    np.testing.assert_array_equal(np.asarray(state2.weight_clipped), [1.0, 1.0])
    np.testing.assert_allclose(np.asarray(state2.weight_scales), want * 1.5, rtol=1e-6)
    # A ledger-only fold (forward increments) leaves the weight scales alone.
    _, inc = fp8.apply_with_ledger(seam, state2, grown, h)
    np.testing.assert_array_equal(np.asarray(fp8.fold_state(seam, state2, inc).weight_scales),
                                  np.asarray(state2.weight_scales))


@pytest.mark.parametrize("fallback", ["block", "step"])
def test_block_training_under_reconstruct_tracks_the_weights(fallback):
    """Two SGD steps of a reconstruct stack with delayed weight scales: the
    first step's gradients equal per-tensor scaling's bit for bit (bind
    started the scales from the same weights), every layer's scales follow
    its weights, counts are exact (the recomputation observes once)."""
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128)
    depth = 2
    params = init_stack(jax.random.key(0), cfg, depth)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    seams = fp8.block_seams(config=fp8.SeamConfig(weight_scaling="delayed"))
    bound = fp8.bind_block(cfg, params, [x], seams, fallback=fallback)
    tensor = fp8.bind_block(cfg, params, [x], fp8.block_seams(config=fp8.SeamConfig(weight_scaling="tensor")),
                            fallback=fallback)

    def step_of(b):
        stack = eae_jax.reconstruct(b.block_fn())

        @jax.jit
        def step(params, state):
            g = jax.grad(lambda p: jnp.mean(stack(p, x) * ct))(b.params(params, state))
            if fallback == "step":
                new_state, bad = b.fold_step(state, g["fp8"], notify=False)
                assert bad.dtype == jnp.bool_
            else:
                new_state = b.fold(state, g["fp8"], notify=False)
            return g["params"], new_state

        return step

    g_d, state = step_of(bound)(params, bound.state)
    g_t, _ = step_of(tensor)(params, tensor.state)
    for a, b in zip(jax.tree_util.tree_leaves(g_d), jax.tree_util.tree_leaves(g_t)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, g_d)
    _, state = step_of(bound)(params, state)
    for layer in range(depth):
        lp = jax.tree_util.tree_map(lambda a: a[layer], params)
        np.testing.assert_allclose(
            np.asarray(state["ffn"].weight_scales[layer]),
            np.array([_amax64(lp["ffn"]["w_gate"], lp["ffn"]["w_up"]), _amax64(lp["ffn"]["w_down"])]) / E4M3_MAX,
            rtol=1e-6)
        np.testing.assert_allclose(
            float(state["qkv"].weight_scales[layer, 0]),
            _amax64(lp["attn"]["wq"], lp["attn"]["wk"], lp["attn"]["wv"]) / E4M3_MAX, rtol=1e-6)
    rep = bound.report(state)
    assert len(rep) == 3 * depth
    assert all(e["calls"] == 2 and e["fp8_calls"] == 2 for e in rep)


def test_step_guard_drops_the_weight_observations_of_a_rejected_step():
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128)
    params = init_stack(jax.random.key(0), cfg, 2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    bound = fp8.bind_block(cfg, params, [x], fp8.block_seams(config=fp8.SeamConfig(weight_scaling="delayed")),
                           fallback="step")
    stack = eae_jax.reconstruct(bound.block_fn())
    # Weights that shrank: the activations stay inside their static scales.
    smaller = jax.tree_util.tree_map(lambda a: a * 0.5, params)

    def grads(xin):
        return jax.grad(lambda p: jnp.sum(stack(p, xin)))(bound.params(smaller, bound.state))["fp8"]

    good, bad_step = bound.fold_step(bound.state, grads(x), notify=False)
    assert not bool(bad_step)
    np.testing.assert_allclose(np.asarray(good["ffn"].weight_scales),
                               0.5 * np.asarray(bound.state["ffn"].weight_scales), rtol=1e-6)
    x_nan = x.at[0, 0, 0].set(jnp.nan)
    dropped, bad_step = bound.fold_step(bound.state, grads(x_nan), notify=False)
    assert bool(bad_step)
    for n in bound.seams:
        np.testing.assert_array_equal(np.asarray(dropped[n].weight_scales), np.asarray(bound.state[n].weight_scales))


def test_microbatch_observations_take_the_maximum_of_amaxes_and_add_counts():
    from eae_jax.fp8.ledger import init_ledger
    from eae_jax.train.loop import _add_observations

    def obs(calls, grad, weight, amax):
        led = init_ledger(2)._replace(calls=jnp.float32(calls), amax=jnp.asarray(amax, jnp.float32))
        return fp8.SeamState(jnp.zeros((2,)), led, jnp.asarray(grad, jnp.float32), jnp.zeros((2,)),
                             jnp.asarray(weight, jnp.float32), jnp.zeros((2,)))

    out = _add_observations({"ffn": obs(1, [1.0, 4.0], [0.5, 0.2], [3.0, 1.0])},
                            {"ffn": obs(2, [3.0, 2.0], [0.5, 0.3], [2.0, 5.0])})["ffn"]
    assert float(out.ledger.calls) == 3.0
    # The activation amax too: summed, it made the train command's delayed scales 3-4x too large.
    np.testing.assert_array_equal(np.asarray(out.ledger.amax), [3.0, 5.0])
    np.testing.assert_array_equal(np.asarray(out.grad_scales), [3.0, 4.0])
    np.testing.assert_array_equal(np.asarray(out.weight_scales), np.float32([0.5, 0.3]))
