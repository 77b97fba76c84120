"""Boundaries stored inside the gradient buffers (`eae_jax.grad_slots`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import grad_slots
from eae_jax.blocks import BlockConfig, decoder_block, init_stack, plain_stack
from eae_jax.passes import chain, clip_by_norm, int8_fake_quant


@pytest.mark.parametrize("bdtype,leaf_dtypes,shape", [
    (jnp.bfloat16, (jnp.float32, jnp.float32), (3, 5, 7)),      # 2-byte boundary in 4-byte slots, odd size
    (jnp.float32, (jnp.bfloat16, jnp.bfloat16), (2, 4, 6)),     # 4-byte boundary in 2-byte slots
    (jnp.float16, (jnp.bfloat16, jnp.float32), (5, 9)),          # mixed slot dtypes
    (jnp.float32, (jnp.float32, jnp.float32), (4, 4)),
])
def test_pack_unpack_round_trips_the_exact_bits(bdtype, leaf_dtypes, shape):
    n_elems = int(np.prod(shape))
    # leaves just big enough together (each holds ~60% of the boundary's bytes)
    specs = [((int(0.6 * n_elems * jnp.dtype(bdtype).itemsize / jnp.dtype(d).itemsize) + 1,), d) for d in leaf_dtypes]
    specs.append(((3,), jnp.int32))  # never used: not float
    p = grad_slots.plan(specs, shape, bdtype)
    assert p is not None and 3 not in p.leaves
    depth = 4
    bufs = grad_slots.empty_slots(p, depth)
    xs = [jax.random.normal(jax.random.key(i), shape).astype(bdtype) for i in range(depth)]
    xs[1] = xs[1].at[0].set(jnp.nan).at[-1].set(-jnp.inf)  # special values survive too
    for i, x in enumerate(xs):
        bufs = grad_slots.pack(p, x, bufs, i)
    for i, x in enumerate(xs):
        got = grad_slots.unpack(p, bufs, i)
        assert got.dtype == jnp.dtype(bdtype) and got.shape == shape
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16 if got.dtype.itemsize
                                                                               == 2 else jnp.uint32)),
                                      np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize
                                                                              == 2 else jnp.uint32)))


def test_plan_is_none_when_params_are_smaller_than_a_boundary():
    assert grad_slots.plan([((10,), jnp.float32)], (4, 4), jnp.float32) is None
    assert grad_slots.plan([((100,), jnp.int32)], (4, 4), jnp.float32) is None
    assert grad_slots.plan([((100,), jnp.float32)], (4, 4), jnp.int32) is None  # int boundaries are not slotted
    p = grad_slots.plan([((8,), jnp.float32), ((20,), jnp.float32)], (4, 4), jnp.float32)
    assert p.leaves == (1,)  # largest first, and only as many as needed


def test_plan_skips_int_bool_and_typed_key_leaves():
    # A typed PRNG key (flax nnx.Dropout's rng state) used to crash the plan:
    # "Cannot interpret 'key<fry>' as a data type".
    keys = jax.random.split(jax.random.key(0), 40)
    specs = [(keys.shape, keys.dtype), ((30,), jnp.int32), ((50,), jnp.bool_), ((16,), jnp.float32)]
    p = grad_slots.plan(specs, (4, 4), jnp.float32)
    assert p.leaves == (3,) and p.chunks == ((0, 64),)
    assert grad_slots.plan(specs[:3], (4, 4), jnp.float32) is None


@pytest.mark.parametrize("leaf_elems, bdtype, shape, fits", [
    (16, jnp.float32, (4, 4), True),     # exactly one boundary's bytes
    (15, jnp.float32, (4, 4), False),    # one element short
    (8, jnp.bfloat16, (4, 4), True),     # 32 bytes of bf16 in 8 float32 elements
    (7, jnp.bfloat16, (4, 4), False),
    (2, jnp.bfloat16, (3,), True),       # 6 bytes take two whole float32 elements (2 bytes of padding)
    (1, jnp.bfloat16, (3,), False),
])
def test_plan_threshold_is_exactly_one_boundary(leaf_elems, bdtype, shape, fits):
    p = grad_slots.plan([((leaf_elems,), jnp.float32)], shape, bdtype)
    assert (p is not None) == fits
    if fits:
        assert p.leaves == (0,) and p.chunks == ((0, leaf_elems * 4),)


def test_plan_takes_the_largest_leaves_first_and_breaks_ties_by_position():
    f32 = jnp.float32
    assert grad_slots.plan([((16,), f32), ((16,), f32)], (4, 4), f32).leaves == (0,)
    p = grad_slots.plan([((6,), f32), ((10,), f32), ((4,), f32)], (4, 4), f32)
    assert p.leaves == (1, 0) and p.chunks == ((0, 40), (40, 24))  # 40 + 24 bytes = one boundary


def _setup(dtype=jnp.float32, depth=4):
    cfg = BlockConfig(dim=32, num_heads=4, num_kv_heads=2, ffn_hidden_dim=64)
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), init_stack(jax.random.key(0), cfg, depth))
    x = jax.random.normal(jax.random.key(1), (2, 8, 32)).astype(dtype)
    return decoder_block(cfg), params, x


def _loss(y):
    return jnp.mean(jnp.sin(y.astype(jnp.float32)))


@pytest.mark.parametrize("kwargs", [{}, {"boundary_dtype": "bf16"},
                                    {"passes": chain(int8_fake_quant(), clip_by_norm(0.05))}])
def test_slotted_stack_gives_the_same_gradients_and_carry(kwargs):
    block, params, x = _setup()
    slotted = eae_jax.reconstruct(block, **kwargs)
    separate = eae_jax.reconstruct(block, boundaries_in_grads=False, **kwargs)
    carry = slotted.init(params, x, jax.random.key(2))

    def grads(stack):
        return jax.jit(jax.grad(lambda p, c: _loss(stack(p, x, c)), argnums=(0, 1)))(params, carry)

    g_slot, g_sep = grads(slotted), grads(separate)
    # The boundary read out of the slots may fuse into the block's first
    # kernels, which can change XLA's float32 reduction order by an ulp or
    # two; a wrong boundary byte would be off by far more (the bytes
    # themselves round-trip exactly: test_pack_unpack_round_trips_the_exact_bits).
    chex.assert_trees_all_close(g_slot, g_sep, rtol=2e-5, atol=1e-8)
    if not kwargs:  # and both are ordinary autodiff's gradients
        want = jax.jit(jax.grad(lambda p: _loss(plain_stack(block, p, x))))(params)
        chex.assert_trees_all_close(g_slot[0], want, rtol=2e-5, atol=1e-7)


def test_slotted_backward_saves_the_boundaries_in_compiled_memory():
    # boundaries large next to the rest of the step, as in real training
    cfg = BlockConfig(dim=128, num_heads=4, num_kv_heads=2, ffn_hidden_dim=384, compute_dtype="bf16")
    depth = 8
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_stack(jax.random.key(0), cfg, depth))
    x = jax.random.normal(jax.random.key(1), (4, 256, 128)).astype(jnp.bfloat16)

    def temp_bytes(flag):
        stack = eae_jax.reconstruct(decoder_block(cfg), boundaries_in_grads=flag)
        f = jax.jit(jax.grad(lambda p, x: _loss(stack(p, x))))
        return f.lower(params, x).compile().memory_analysis().temp_size_in_bytes

    saved = temp_bytes(False) - temp_bytes(True)
    # CPU buffer assignment; the ideal saving is `depth` boundaries
    assert saved >= 0.75 * depth * x.size * x.dtype.itemsize, saved / (x.size * x.dtype.itemsize)


def test_heterogeneous_stack_and_too_small_params_fall_back():
    block, params, x = _setup()
    # a Scan segment next to a single block; a tiny-param scanned block that
    # cannot hold its boundary stores it the ordinary way
    def scale_block(p, h):
        return h * p["s"]

    tiny = {"s": jnp.full((3, 1), 1.01, jnp.float32)}
    stack = eae_jax.reconstruct([eae_jax.Scan(block), eae_jax.Scan(scale_block), block])
    one = jax.tree_util.tree_map(lambda a: a[0], params)
    plist = [params, tiny, one]

    def ref(pl):
        h = plain_stack(block, pl[0], x)
        for i in range(3):
            h = h * pl[1]["s"][i]
        return block(pl[2], h)

    got = jax.jit(jax.grad(lambda pl: _loss(stack(pl, x))))(plist)
    want = jax.jit(jax.grad(lambda pl: _loss(ref(pl))))(plist)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=1e-7)


def test_same_width_slots_move_words_without_resizing_bitcasts():
    # bf16 boundary in bf16 gradient slots: the bytes move as uint16 words, so
    # XLA sees only same-width bitcasts (free) and can fuse the row slices with
    # their concatenation; a detour through uint8 splits them into copies.
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128, compute_dtype="bf16")
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_stack(jax.random.key(0), cfg, 3))
    x = jax.random.normal(jax.random.key(1), (2, 96, 64)).astype(jnp.bfloat16)
    stack = eae_jax.reconstruct(decoder_block(cfg))
    leaves = [(a.shape[1:], a.dtype) for a in jax.tree_util.tree_leaves(params)]
    p = grad_slots.plan(leaves, x.shape, x.dtype)
    assert p is not None and len(p.leaves) >= 2 and p.unit == 2  # the boundary spans two gradient rows
    hlo = jax.jit(jax.grad(lambda p, x: _loss(stack(p, x)))).lower(params, x).compile().as_text()
    assert "u16[" in hlo and "u8[" not in hlo
