"""Optimizer state and master weights in pinned host memory (`eae_jax.offload_optim`),
against optax's transformation applied on the device to the whole tree: the same bits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eae_jax import offload_optim
from eae_jax.offload_optim import Chunks, host_memory_kind, offload_optimizer

#: The placement tests need a backend with a pinned_host memory kind (XLA:CPU has it in jax >= 0.4.3x).
needs_host_memory = pytest.mark.skipif(host_memory_kind() is None,
                                       reason=f"the {jax.default_backend()} backend has no pinned_host memory kind")


def _params(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 3)
    return {"blocks": {"w": jax.random.normal(k[0], (4, 8, 16)).astype(dtype),
                       "v": jax.random.normal(k[1], (4, 16)).astype(dtype)},
            "head": jax.random.normal(k[2], (16, 5)).astype(dtype), "gain": jnp.asarray(1.5, dtype)}


def _grads(params, t):
    return jax.tree_util.tree_map(lambda p: jnp.sin(p.astype(jnp.float32) * (t + 1.3)).astype(p.dtype), params)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, 10, 3e-3)


def _assert_same_bits(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8))


def _dense(state):
    """The chunked state as whole arrays (for comparison with optax's)."""
    return jax.tree_util.tree_map(lambda c: jnp.concatenate([p.reshape((-1,) + p.shape[1:]) for p in c.parts])
                                  .reshape(c.shape) if c.parts[0].ndim else c.parts[0], state,
                                  is_leaf=lambda x: isinstance(x, Chunks))


@needs_host_memory
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 2 * (8 * 16 * 4) * 2])  # whole leaves; two rows of mu and nu
def test_updates_are_bit_identical_to_adamw_on_the_device(chunk_bytes):
    params = _params()
    ref_tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(SCHEDULE, weight_decay=0.1))
    opt = offload_optimizer(optax.adamw(SCHEDULE, weight_decay=0.1), grad_clip=0.5, chunk_bytes=chunk_bytes)

    @jax.jit
    def ref_step(p, s, g):
        u, s = ref_tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(opt.apply, donate_argnums=(2,))
    p_ref, s_ref = params, ref_tx.init(params)
    p, s = jax.tree_util.tree_map(jnp.copy, params), opt.init(params)  # p is donated
    for t in range(4):  # step 0 has learning rate 0: the later steps are the test
        g = _grads(params, t)
        p_ref, s_ref = ref_step(p_ref, s_ref, g)
        p, s = step(g, s, p)
        _assert_same_bits(p, p_ref)
    adam = s_ref[1][0]
    _assert_same_bits([_dense(s.inner[0].mu), _dense(s.inner[0].nu), s.inner[0].count], [adam.mu, adam.nu, adam.count])
    kinds = {part.sharding.memory_kind for c in jax.tree_util.tree_leaves(s, is_leaf=lambda x: isinstance(x, Chunks))
             if isinstance(c, Chunks) for part in c.parts}
    assert kinds == {"pinned_host"}
    # chunks of rows: the stacked (4, 8, 16) leaf in one chunk per two rows, or whole
    assert len(s.inner[0].mu["blocks"]["w"].parts) == (2 if chunk_bytes < 1 << 20 else 1)


def _where(tree):
    return jax.tree_util.tree_map(lambda a: a.sharding, tree)


@needs_host_memory
@pytest.mark.parametrize("param_dtype,master_dtype", [(jnp.float32, None), (jnp.bfloat16, jnp.float32)])
def test_a_donated_host_state_is_updated_in_place_with_the_same_bits(param_dtype, master_dtype):
    # With every sharding named (memory kinds included) jax aliases a donated host chunk only to a
    # host output; float32 params without master weights have the chunks' shapes on the device too.
    params = _params(param_dtype)
    tx = optax.adamw(SCHEDULE, weight_decay=0.1)
    opt = offload_optimizer(tx, master_dtype=master_dtype, grad_clip=0.5, chunk_bytes=8 * 16 * 4 * 2)
    p_ref, s_ref = params, opt.init(params)
    p, s = jax.tree_util.tree_map(jnp.copy, params), opt.init(params)
    g_sh = _where(_grads(params, 0))
    step = jax.jit(opt.apply, in_shardings=(g_sh, _where(s), _where(p)), out_shardings=(_where(p), _where(s)),
                   donate_argnums=(1, 2))
    compiled = step.lower(_grads(params, 0), s, p).compile()
    # XLA may still copy a scalar param; every byte of the optimizer state is updated in place.
    stats = compiled.memory_analysis()
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(s))
    assert stats.alias_size_in_bytes + stats.host_alias_size_in_bytes >= state_bytes
    for t in range(3):
        g = _grads(params, t)
        p_ref, s_ref = jax.jit(opt.apply)(g, s_ref, p_ref)
        old = jax.tree_util.tree_leaves(s)
        p, s = compiled(g, s, p)
        assert all(x.is_deleted() for x in old)
        _assert_same_bits((p, s), (p_ref, s_ref))
        assert jax.tree_util.tree_leaves(_where(s)) == jax.tree_util.tree_leaves(_where(s_ref))


@needs_host_memory
@pytest.mark.parametrize("group_bytes", [1 << 30, 1])  # the state built at once; a leaf at a time
def test_master_weights_in_host_memory_update_as_on_the_device(group_bytes, monkeypatch):
    monkeypatch.setattr(offload_optim, "INIT_GROUP_BYTES", group_bytes)
    params = _params(jnp.bfloat16)
    tx = optax.adamw(SCHEDULE, weight_decay=0.1)
    opt = offload_optimizer(tx, master_dtype=jnp.float32, grad_clip=1.0, chunk_bytes=8 * 16 * 4 * 3)

    @jax.jit
    def ref_step(master, s, g):  # fp32 master weights and their state on the device
        g = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]
        u, s = tx.update(jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), g), s, master)
        master = optax.apply_updates(master, u)
        return master, s, jax.tree_util.tree_map(lambda m: m.astype(jnp.bfloat16), master)

    master = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    s_ref = tx.init(master)
    p, s = params, opt.init(params)
    for t in range(3):
        g = _grads(params, t)
        master, s_ref, p_ref = ref_step(master, s_ref, g)
        p, s = jax.jit(opt.apply)(g, s, p)
        _assert_same_bits(p, p_ref)
        _assert_same_bits(_dense(s.master), master)
    assert {x.dtype for x in jax.tree_util.tree_leaves(p)} == {jnp.dtype(jnp.bfloat16)}


def test_init_groups_hold_at_most_the_group_bytes(monkeypatch):
    # tree_leaves order: blocks/v (4, 16), blocks/w (4, 8, 16), gain (), head (16, 5); fp32 master, mu and nu
    params = _params(jnp.bfloat16)
    opt = offload_optimizer(optax.adamw(1e-2), master_dtype=jnp.float32)
    v, w, gain, head = (12 * int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(params))
    monkeypatch.setattr(offload_optim, "INIT_GROUP_BYTES", v + w)  # at equality: one group
    assert opt._init_groups(params) == [[0, 1], [2, 3]]
    monkeypatch.setattr(offload_optim, "INIT_GROUP_BYTES", v + w - 1)
    assert opt._init_groups(params) == [[0], [1, 2], [3]]
    assert w + gain + head > v + w - 1
    monkeypatch.setattr(offload_optim, "INIT_GROUP_BYTES", 1)  # a leaf larger than the bound is a group alone
    assert opt._init_groups(params) == [[0], [1], [2], [3]]


def test_a_backend_without_host_memory_keeps_the_state_on_the_device():
    class Device:  # a runtime whose device has only device memory
        def addressable_memories(self):
            return [type("M", (), {"kind": "device"})()]

    assert host_memory_kind(Device()) is None
    opt = offload_optimizer(optax.sgd(0.1, momentum=0.9), memory_kind=None)
    params = _params()
    p, s = jax.jit(opt.apply)(_grads(params, 0), opt.init(params), params)
    part = s.inner[0].trace["head"].parts[0]
    assert part.sharding.memory_kind in (None, "device")
    ref = optax.sgd(0.1, momentum=0.9)
    want = jax.jit(lambda g, p: optax.apply_updates(p, ref.update(g, ref.init(p), p)[0]))(_grads(params, 0), params)
    _assert_same_bits(p, want)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="memory_kind must be"):
        offload_optimizer(optax.sgd(0.1), memory_kind="gpu")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is XLA:CPU's; other backends place the state")
def test_a_host_kind_on_a_cpu_mesh_of_several_devices_is_refused_by_name():
    class TwoDevices:  # the refusal comes before any placement
        device_set = {"cpu:0", "cpu:1"}

    params = _params()
    opt = offload_optimizer(optax.sgd(0.1, momentum=0.9), memory_kind="pinned_host")
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"'pinned_host' on a CPU mesh of 2 devices.*memory_kind=None"):
        opt.place(state, TwoDevices())
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # one device: placed in the host kind
    placed = opt.place(state, one)
    chunks = [c for c in jax.tree_util.tree_leaves(placed.inner, is_leaf=offload_optim._is_chunks)
              if offload_optim._is_chunks(c)]
    assert len(chunks) == 4 and {x.sharding.memory_kind for c in chunks for x in c.parts} == {"pinned_host"}
