"""Weights cast to fp8 once per step (`eae_jax.fp8.cast_weights`).

With delayed weight scales the e4m3 bytes of a weight depend only on the
weight and the state's scale, so a step can make them once and let every
call read them (a reconstruct train step runs each block twice). These
tests hold the cast path to the uncast one bit for bit (outputs, gradients,
folded states over several steps, under every fallback granularity) and
check that a step given cast weights quantizes no weight at all.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import fp8
from eae_jax.blocks import BlockConfig, init_stack, init_swiglu
from eae_jax.fp8 import quant


def _rand(key, shape, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


def _assert_trees_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("rows", [(24,), (16, 8)])
def test_fp8_linear_with_cast_bytes_equals_delayed_scaling(per_row, rows):
    """Output, dx, dw and the observed amax of a cast weight equal the uncast
    delayed call's; the bytes and their amax get zero cotangents."""
    x = _rand(0, (32, 48), 1.0, jnp.bfloat16)
    blocks = tuple(_rand(1 + i, (r, 48), 0.05 * (i + 1), jnp.bfloat16) for i, r in enumerate(rows))
    xs = quant.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.01)
    # A scale below the weights' amax: saturation must behave identically too.
    scale = quant.scale_from_amax(quant.weight_amax(blocks)) * 0.75
    q, amax = quant.cast_weight(blocks, scale)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (sum(rows), 48)
    np.testing.assert_allclose(float(amax), max(float(np.abs(np.asarray(b, np.float64)).max()) for b in blocks),
                               rtol=1e-6)
    g = _rand(9, (32, sum(rows)), 1.0, jnp.bfloat16)

    y_d, vjp_d = jax.vjp(lambda a, b, s: fp8.fp8_linear(a, b, xs, weight_scaling="delayed", weight_scale=s),
                         x, blocks, scale)
    y_c, vjp_c = jax.vjp(lambda a, b, s, qq, am: fp8.fp8_linear(a, b, xs, weight_scaling="delayed", weight_scale=s,
                                                                weight_cast=(qq, am)),
                         x, blocks, scale, q, amax)
    np.testing.assert_array_equal(np.asarray(y_c, np.float32), np.asarray(y_d, np.float32))
    dx_d, dw_d, obs_d = vjp_d(g)
    dx_c, dw_c, obs_c, dq, damax = vjp_c(g)
    _assert_trees_equal((dx_c, dw_c, obs_c), (dx_d, dw_d, obs_d))
    assert not np.any(np.asarray(dq, np.float32)) and float(damax) == 0.0


def test_fp8_linear_refuses_bad_cast_arguments():
    x, w = _rand(0, (4, 8)), _rand(1, (6, 8))
    q, amax = quant.cast_weight((w,), jnp.float32(0.01))
    with pytest.raises(ValueError, match="needs weight_scaling='delayed'"):
        fp8.fp8_linear(x, w, jnp.float32(1.0), weight_scaling="tensor", weight_cast=(q, amax))
    with pytest.raises(ValueError, match=r"float8_e4m3fn of shape \(6, 8\)"):
        fp8.fp8_linear(x, w, jnp.float32(1.0), weight_scaling="delayed", weight_scale=jnp.float32(0.01),
                       weight_cast=(q[:5], amax))
    with pytest.raises(ValueError, match="float8_e4m3fn of shape"):
        fp8.fp8_linear(x, w, jnp.float32(1.0), weight_scaling="delayed", weight_scale=jnp.float32(0.01),
                       weight_cast=(q.astype(jnp.float8_e5m2), amax))
    with pytest.raises(ValueError, match="amax must be a float32 scalar"):
        fp8.fp8_linear(x, w, jnp.float32(1.0), weight_scaling="delayed", weight_scale=jnp.float32(0.01),
                       weight_cast=(q, jnp.ones((2,))))
    with pytest.raises(ValueError, match="frozen Fp8Weight"):
        fp8.fp8_linear(x, fp8.quantize_weight(w), jnp.float32(1.0), weight_cast=(q, amax))


def _seam_case(kind):
    if kind == "ffn":
        params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(0), 64, 128))
        return fp8.ffn_seam(weight_scaling="delayed"), params
    params = {n: _rand(i, (r, 64), 0.1, jnp.bfloat16) for i, (n, r) in enumerate((("wq", 64), ("wk", 32),
                                                                                  ("wv", 32)))}
    return fp8.qkv_seam(weight_scaling="delayed"), params


@pytest.mark.parametrize("kind", ["ffn", "qkv"])
def test_seam_with_cast_weights_equals_the_uncast_seam_and_fold_drops_the_bytes(kind):
    seam, params = _seam_case(kind)
    x = _rand(5, (2, 16, 64), 1.0, jnp.bfloat16)
    state = fp8.bind(seam, params, [x], gate_cos=0).state
    cast = fp8.cast_weights(seam, state, params)
    assert isinstance(cast.weight_cast, fp8.CastWeights)
    assert [q.shape for q in cast.weight_cast.q] == ([(256, 64), (64, 128)] if kind == "ffn" else [(128, 64)])
    # The bytes are the weights quantized at the state's (delayed) scales.
    first = (params["w_gate"], params["w_up"]) if kind == "ffn" else (params["wq"], params["wk"], params["wv"])
    want = quant.quantize(jnp.concatenate(first), state.weight_scales[0], quant.E4M3)
    np.testing.assert_array_equal(np.asarray(cast.weight_cast.q[0], np.float32), np.asarray(want, np.float32))

    def loss(s, p, x_):
        y = fp8.apply(seam, s, p, x_)
        y = y if kind == "ffn" else jnp.concatenate(y, axis=-1)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    (l0, (gs0, gp0, gx0)), (l1, (gs1, gp1, gx1)) = grad(state, params, x), grad(cast, params, x)
    assert float(l0) == float(l1)
    _assert_trees_equal((gp0, gx0), (gp1, gx1))
    folded0, folded1 = fp8.fold_state(seam, state, gs0), fp8.fold_state(seam, cast, gs1)
    assert folded1.weight_cast is None
    _assert_trees_equal(folded0, folded1)
    # Without differentiation too (the bound seam's unguarded forward).
    bound = fp8.bind(seam, params, [x], gate_cos=0)
    _assert_trees_equal(bound.fp8(params, x, state), bound.fp8(params, x, bound.cast_weights(state, params)))


def test_cast_weights_refuses_what_it_cannot_cast():
    seam, params = _seam_case("ffn")
    x = _rand(5, (32, 64), 1.0, jnp.bfloat16)
    state = fp8.bind(seam, params, [x], gate_cos=0).state
    channel = seam.replace(weight_scaling="channel")
    with pytest.raises(ValueError, match="needs weight_scaling='delayed'"):
        fp8.cast_weights(channel, fp8.init_state(channel), params)
    with pytest.raises(ValueError, match="needs a state with weight_scales"):
        fp8.cast_weights(seam, state._replace(weight_scales=None), params)
    with pytest.raises(ValueError, match="frozen params"):
        fp8.cast_weights(seam, state, fp8.seams.freeze(seam, params))
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), state)
    with pytest.raises(ValueError, match="one layer's state"):
        fp8.cast_weights(seam, stacked, params)
    # Bytes cast from other weights (a narrower FFN) do not fit these params.
    small = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(1), 64, 96))
    foreign = fp8.cast_weights(seam, fp8.init_state(seam, params=small), small)
    with pytest.raises(ValueError, match="do not fit its weights"):
        fp8.apply(seam, state._replace(weight_cast=foreign.weight_cast), params, x)
    # A channel-scaled seam given a state with cast bytes.
    cast = fp8.cast_weights(seam, state, params)
    # Bytes without the scales they were cast at (fp8_forward would otherwise
    # take scales from the weights, which need not be the bytes' scales).
    with pytest.raises(ValueError, match="without the weight_scales they were cast at"):
        fp8.fp8_forward(seam, params, x, state.scales, weight_cast=cast.weight_cast)
    with pytest.raises(ValueError, match="need weight_scaling='delayed'"):
        fp8.apply(channel, cast._replace(weight_scales=None), params, x)


CFG = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128, compute_dtype="bf16", max_seq_len=16)


def _bound_block(fallback, depth=2, saturation_threshold=1e-3):
    params = init_stack(jax.random.key(0), CFG, depth)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64)).astype(jnp.bfloat16)
    seams = fp8.block_seams(config=fp8.SeamConfig(weight_scaling="delayed",
                                                  saturation_threshold=saturation_threshold))
    return fp8.bind_block(CFG, params, [x], seams, fallback=fallback, gate_cos=0), params, x


@pytest.mark.parametrize("fallback,saturation_threshold", [("step", 0.5), ("block", 0.5), ("seam", 1e-3)])
def test_reconstruct_training_with_weights_cast_per_step_matches_uncast_training(fallback, saturation_threshold):
    """Three steps of a reconstruct stack whose weights grow 10% a step, one
    run casting the weights at the start of every step and one not: params
    and seam states (scales, ledgers, weight scales, clipped counts) equal
    bit for bit. With a lax saturation threshold the weights outgrow their
    delayed scales (saturated bytes); with the default one the growing
    activations make seam calls fall back (the high-precision VJP)."""
    bound, params, x = _bound_block(fallback, saturation_threshold=saturation_threshold)
    ct = jax.random.normal(jax.random.key(2), x.shape)
    stack = eae_jax.reconstruct(bound.block_fn())

    def step_of(cast):
        @jax.jit
        def step(params, state):
            used = bound.cast_weights(state, params) if cast else state
            g = jax.grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32) * ct))(bound.params(params, used))
            if fallback == "step":
                new_state, _ = bound.fold_step(used, g["fp8"], notify=False)
            else:
                new_state = bound.fold(used, g["fp8"], notify=False)
            # Weights grow 10% a step: they outgrow their delayed scales
            # (saturating), which the cast bytes must reproduce too.
            return jax.tree_util.tree_map(lambda p, d: 1.1 * p - d, params, g["params"]), new_state
        return step

    runs = {}
    for cast in (False, True):
        p, s, step = params, bound.state, step_of(cast)
        for _ in range(3):
            p, s = step(p, s)
        runs[cast] = (p, s)
    _assert_trees_equal(runs[False], runs[True])
    state = runs[True][1]
    assert all(st.weight_cast is None for st in state.values())
    rep = bound.report(state)
    assert all(e["calls"] == 3 for e in rep)
    if saturation_threshold == 0.5:
        assert sum(e["fallbacks"] for e in rep) == 0
        assert sum(sum(e["weight_clipped"]) for e in rep) > 0, "the weights were meant to outgrow their scales"
    else:
        assert sum(e["fallbacks"] for e in rep) > 0, "the activations were meant to saturate"


def _weight_shaped_e4m3_converts(lowered_text, shapes):
    """How many converts to e4m3 produce an array of one of ``shapes`` (the
    weights' fp8 bytes) in a lowered (StableHLO) program."""
    found = re.findall(r"stablehlo\.convert[^\n]*-> tensor<(\d+)x(\d+)xf8E4M3FN>", lowered_text)
    return sum((int(a), int(b)) in shapes for a, b in found)


def test_a_step_given_cast_weights_quantizes_no_weight():
    bound, params, x = _bound_block("step")
    stack = eae_jax.reconstruct(bound.block_fn())
    grad = jax.jit(jax.grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32))))
    shapes = {(256, 64), (64, 128), (128, 64), (64, 64)}  # gate|up, down, q|k|v, o
    uncast = grad.lower(bound.params(params)).as_text()
    cast = grad.lower(bound.params(params, bound.cast_weights(bound.state, params))).as_text()
    # Uncast: every GEMM's weight is quantized in the forward and again in the
    # recomputation (4 GEMMs per layer body).
    assert _weight_shaped_e4m3_converts(uncast, shapes) >= 8
    assert _weight_shaped_e4m3_converts(cast, shapes) == 0


def test_bound_block_cast_weights_checks_depth_and_keeps_other_seams():
    bound, params, _ = _bound_block("step")
    with pytest.raises(ValueError, match="params have 3 layer"):
        bound.cast_weights(bound.state, init_stack(jax.random.key(3), CFG, 3))
    mixed = dataclasses_replace_ffn_channel(bound, params)
    cast = mixed.cast_weights(mixed.state, params)
    assert cast["ffn"].weight_cast is None and cast["qkv"].weight_cast is not None
    assert cast["qkv"].weight_cast.q[0].shape == (2, 128, 64)


def dataclasses_replace_ffn_channel(bound, params):
    """The bound block with its FFN seam per-channel (no weight scales), the projections delayed."""
    import dataclasses

    seams = dict(bound.seams)
    seams["ffn"] = seams["ffn"].replace(weight_scaling="channel")
    state = dict(bound.state)
    state["ffn"] = state["ffn"]._replace(weight_scales=None, weight_clipped=None)
    return dataclasses.replace(bound, seams=seams, state=state)
