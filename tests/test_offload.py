"""Host-offloaded boundaries (`reconstruct(..., offload=True)`).

Checks that the stored boundaries are placed in pinned host memory (in the
traced program, in the program lowered for CUDA, and in the compiled HLO where
the backend has a host memory space), that the backward copies each one back
inside its loop, and that gradients, pass state and stats are exactly those
of the on-device store.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import offload as offload_lib
from eae_jax.blocks import BlockConfig, decoder_block, init_stack, plain_stack
from eae_jax.passes import chain, clip_by_norm, int8_fake_quant

CFG = BlockConfig(dim=32, num_heads=4, num_kv_heads=2, ffn_hidden_dim=64)
DECODER = decoder_block(CFG)
X_SHAPE = (2, 8, 32)


def BLOCK(p, x):
    """A residual MLP block: the offload machinery is block-agnostic, and this
    compiles in a fraction of the decoder block's time."""
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def _inputs(depth, seed=0, dtype=jnp.float32, decoder=False):
    if decoder:
        params = init_stack(jax.random.key(seed), CFG, depth, dtype)
    else:
        k1, k2 = jax.random.split(jax.random.key(seed))
        params = {"w1": 0.3 * jax.random.normal(k1, (depth, 32, 48), dtype),
                  "w2": 0.3 * jax.random.normal(k2, (depth, 48, 32), dtype)}
    x = jax.random.normal(jax.random.key(seed + 100), X_SHAPE, dtype)
    y = jax.random.normal(jax.random.key(seed + 200), X_SHAPE, dtype)
    return params, x, y


def _step(stack):
    def loss(p, c, x, y):
        return jnp.mean((stack(p, x, c).astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

    @jax.jit
    def step(p, c, x, y):
        val, (gp, gc, gx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(p, c, x, y)
        c2, stats = stack.update(c, gc)
        return val, gp, gx, c2, stats

    return step


def test_host_offload_supported_says_whether_arrays_can_live_in_pinned_host_memory():
    x = jnp.arange(4.0)
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    if offload_lib.host_offload_supported():
        y = jax.device_put(x, where)
        assert y.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        assert jax.jit(offload_lib.to_host)(x).sharding.memory_kind == "pinned_host"
    else:
        with pytest.raises((ValueError, RuntimeError)):
            jax.device_put(x, where)


@pytest.mark.parametrize("depth, boundary_dtype", [(1, None), (2, "bfloat16"), (5, None), (5, "bfloat16")])
def test_offload_gradients_equal_on_device_store(depth, boundary_dtype):
    params, x, y = _inputs(depth, seed=depth)
    outs = {}
    for off in (False, True):
        stack = eae_jax.reconstruct(BLOCK, offload=off, boundary_dtype=boundary_dtype,
                                    passes=chain(int8_fake_quant(), clip_by_norm(0.05)))
        carry = stack.init(params, x, jax.random.key(3))
        val, gp, gx, c2, stats = _step(stack)(params, carry, x, y)
        outs[off] = (val, gp, gx, stack.state(c2), stats)
    # Same arithmetic, only the storage location differs: bit-for-bit equal.
    chex.assert_trees_all_equal(outs[False], outs[True])
    assert float(outs[True][4]["calls"]) == 1.0


@pytest.mark.parametrize("offload", [True, "unrolled"])
def test_offload_decoder_stack_matches_plain_autodiff_in_float32(offload):
    params, x, y = _inputs(4, seed=11, decoder=True)
    stack = eae_jax.reconstruct(DECODER, offload=offload)
    val, gp, gx, _, stats = _step(stack)(params, stack.init(params, x), x, y)

    def ref(p, x):
        return jnp.mean((plain_stack(DECODER, p, x) - y) ** 2)

    rval, (rgp, rgx) = jax.value_and_grad(ref, argnums=(0, 1))(params, x)
    np.testing.assert_allclose(val, rval, rtol=1e-6)
    chex.assert_trees_all_close((gp, gx), (rgp, rgx), rtol=2e-5, atol=1e-7)
    # adjoint norms per boundary are recorded for every boundary, input included
    assert stats["adjoint_norm"].shape == (5,) and bool(jnp.all(stats["adjoint_norm"] > 0))


def test_offload_in_multi_segment_stack():
    """A scanned run followed by a single block: both use the host store."""
    params, x, y = _inputs(3, seed=5)
    head = jax.tree_util.tree_map(lambda a: a[0] * 0.5, params)
    res = {}
    for off in (False, True, "unrolled"):
        stack = eae_jax.reconstruct([eae_jax.Scan(BLOCK, "body"), BLOCK], offload=off)
        val, gp, gx, _, _ = _step(stack)([params, head], stack.init([params, head], x), x, y)
        res[off] = (val, gp, gx)
    for off in (True, "unrolled"):
        chex.assert_trees_all_equal(res[False], res[off])


@pytest.mark.parametrize("depth", [1, 4])
def test_unrolled_offload_matches_on_device_store_with_passes_and_state(depth):
    """The unrolled schedule computes what the scanned one does: gradients,
    pass state and per-boundary stats agree (to float32 rounding: the
    unrolled program fuses differently), and each boundary is its own host
    array."""
    params, x, y = _inputs(depth, seed=20 + depth)
    outs = {}
    for off in (False, "unrolled"):
        stack = eae_jax.reconstruct(BLOCK, offload=off, passes=chain(int8_fake_quant(), clip_by_norm(0.05)))
        carry = stack.init(params, x, jax.random.key(3))
        val, gp, gx, c2, stats = _step(stack)(params, carry, x, y)
        outs[off] = (val, gp, gx, stack.state(c2), stats)
    chex.assert_trees_all_close(outs[False], outs["unrolled"], rtol=1e-6, atol=1e-8)
    assert float(outs["unrolled"][4]["calls"]) == 1.0
    stack = eae_jax.reconstruct(BLOCK, offload="unrolled")
    text = str(jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(stack(p, x) ** 2)))(params, x))
    per_block = f"f32<host>[{','.join(map(str, X_SHAPE))}]"
    assert text.count(per_block) >= depth, "each boundary should be its own host array"
    assert f"f32<host>[{depth}," not in text, "no stacked host array in the unrolled schedule"
    assert " scan[" not in text and "while[" not in text


def test_offload_rejects_unknown_schedule():
    with pytest.raises(ValueError, match="offload must be a bool or one of"):
        eae_jax.reconstruct(BLOCK, offload="async")


def _host_avals(jaxpr_text):
    return re.findall(r"f32<host>\[([0-9,]+)\]", jaxpr_text) + re.findall(r"bf16<host>\[([0-9,]+)\]", jaxpr_text)


@pytest.mark.parametrize("boundary_dtype, tag", [(None, "f32"), ("bfloat16", "bf16")])
def test_boundaries_are_placed_in_host_memory_when_traced(boundary_dtype, tag):
    depth = 4
    params, x, y = _inputs(depth)
    stack = eae_jax.reconstruct(BLOCK, offload=True, boundary_dtype=boundary_dtype)

    def loss(p, x):
        return jnp.sum(stack(p, x) ** 2)

    text = str(jax.make_jaxpr(jax.grad(loss))(params, x))
    stacked = f"{tag}<host>[{depth},{','.join(map(str, X_SHAPE))}]"
    # the forward scan's stacked boundary output, which the backward reads
    assert stacked in text, "the forward scan does not put the stacked boundaries in host memory"
    # one boundary at a time comes back to the device, inside the reverse loop
    assert text.count("devices=(MemorySpace.Device,)") == 1 or text.count("Device") == 1
    # without offload nothing lives on the host
    plain = eae_jax.reconstruct(BLOCK, boundary_dtype=boundary_dtype)
    text_plain = str(jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(plain(p, x) ** 2)))(params, x))
    assert "<host>" not in text_plain


def test_lowering_for_cuda_annotates_pinned_host():
    """Lowered for CUDA (no GPU needed): the forward stores to pinned_host; the
    backward copies each boundary back inside the reverse loop (one device
    copy)."""
    export = pytest.importorskip("jax.export")
    params, x, y = _inputs(4)
    stack = eae_jax.reconstruct(BLOCK, offload=True)

    def loss(p, x):
        return jnp.sum(stack(p, x) ** 2)

    # A lowering error is a failure: cross-lowering needs no GPU, only jax.export.
    text = export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(params, x).mlir_module()
    assert text.count('_xla_buffer_placement = "pinned_host"') == 1
    assert text.count('_xla_buffer_placement = "device"') == 1
    # the device copy inside the backward loop reads a dynamic slice of the host stack
    assert re.search(r"stablehlo.dynamic_slice %arg\d+, .*tensor<4x2x8x32xf32>", text)


@pytest.mark.skipif(jax.default_backend() == "cpu",
                    reason="XLA:CPU compiles memory placement as a no-op: its HLO has no host memory space")
def test_compiled_hlo_puts_the_boundaries_in_host_memory():
    """On an accelerator the stacked boundaries get memory space S(5)."""
    assert offload_lib.host_offload_supported()
    params, x, y = _inputs(4)
    stack = eae_jax.reconstruct(BLOCK, offload=True)
    hlo = jax.jit(jax.grad(lambda p, x: jnp.sum(stack(p, x) ** 2))).lower(params, x).compile().as_text()
    assert re.search(r"f32\[4,2,8,32\]\{[^}]*S\(5\)\}", hlo), "stacked boundaries are not in host memory"


def test_offload_with_policy_keeps_residuals_on_device_and_grads_exact():
    """offload only applies to boundary-only storage; with a policy the kept
    internals stay on device and the result is unchanged."""
    params, x, y = _inputs(3)
    res = {}
    for off in (False, True):
        stack = eae_jax.reconstruct(BLOCK, offload=off, policy="dots")
        val, gp, gx, _, _ = _step(stack)(params, stack.init(params, x), x, y)
        res[off] = (val, gp, gx)
    chex.assert_trees_all_equal(res[False], res[True])
