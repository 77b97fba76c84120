"""Host-memory boundary storage (`eae_jax.reconstruct.host`) on tiny shapes:
`Host.put` / `get` called directly, `HostUnrolled.bind` on hand-made
layouts, and the unrolled forward and backward through small stacks
against plain `jax.grad` and the on-device store (gradients, pass state,
per-boundary statistics, block states, float0 gradients of int params).

`test_offload.py` checks the placement in traced, lowered and compiled
programs on a larger block; this file is the fast one (a few seconds).
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from jaxpr_walk import all_eqns
from eae_jax.passes import at_layers, chain, clip_by_norm, decay, gaussian_noise
from eae_jax.reconstruct import Host, HostUnrolled, OnDevice, Segment, SegmentLayout


def block(p, x):
    return x + jnp.tanh(x @ p["w"]) * (1.0 + p["n"])


def params_of(depth, seed=0):
    return {"w": 0.5 * jax.random.normal(jax.random.key(seed), (depth, 8, 8)),
            "n": jnp.arange(depth, dtype=jnp.int32)}


X = jax.random.normal(jax.random.key(7), (2, 8))
SPEC = jax.ShapeDtypeStruct((2, 8), jnp.float32)


def layout(scanned, depth, first=0):
    one = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)}
    return SegmentLayout(Segment(block, "block", scanned), depth, one, SPEC, None, first)


def test_host_put_places_a_boundary_in_pinned_host_memory_and_get_brings_it_back():
    for dtype, stored_dtype in ((None, jnp.float32), ("bfloat16", jnp.bfloat16)):
        store = Host(dtype)
        stored = jax.jit(store.put)(X)
        assert stored.sharding.memory_kind == "pinned_host" and stored.dtype == stored_dtype
        back = jax.jit(lambda s: store.get(s, SPEC))(stored)
        assert back.sharding.memory_kind == "device" and back.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(back), np.asarray(X.astype(stored_dtype).astype(jnp.float32)))
    ids = jnp.arange(4, dtype=jnp.int32)  # an int boundary is stored as it is
    assert jax.jit(Host("bfloat16").put)(ids).dtype == jnp.int32


def test_host_storage_refuses_grad_of_grad_by_name():
    stack = eae_jax.reconstruct(block, storage=Host())
    params = params_of(3)

    def grad_norm(w):
        g = jax.grad(lambda q: jnp.sum(stack({"w": q, "n": params["n"]}, X) ** 2))(w)
        return jnp.sum(g ** 2)

    with pytest.raises(ValueError) as err:
        jax.grad(grad_norm)(params["w"])
    assert str(err.value) == (
        "eae_jax.reconstruct: differentiating the stack's backward pass (a higher-order derivative, e.g. grad of "
        "grad) is not supported with host storage: boundaries stored in host memory carry no derivative. Build the "
        "stack with offload=False (or storage=OnDevice() / Policy(...)) for higher-order derivatives.")


def test_host_unrolled_serves_only_scanned_runs_of_at_least_one_block():
    store = HostUnrolled("bfloat16")
    assert store.bind(layout(True, 1)) is store and store.bind(layout(True, 3)) is store
    for lay in (layout(True, 0), layout(False, 1)):
        served = store.bind(lay)
        assert type(served) is Host and served.dtype == np.dtype(jnp.bfloat16)


def without_float0(tree):
    """Float0 leaves (int params' gradients) as their shapes and keys as their data: chex compares neither."""
    def plain(a):
        if a.dtype == jax.dtypes.float0:
            return a.shape
        return jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a

    return jax.tree_util.tree_map(plain, tree)


def sided(p, x, s):
    return block(p, x) * s


def plain_loss(params_list, x, s):
    """The stack of `two_segments` with a side input, written out: block 0 alone, then the scanned three."""
    head, body = params_list
    h = sided(head, x, s)
    for i in range(3):
        h = sided(jax.tree_util.tree_map(lambda a: a[i], body), h, s)
    return jnp.sum(jnp.sin(h))


def two_segments():
    head = jax.tree_util.tree_map(lambda a: a[0], params_of(1, seed=3))
    return [head, params_of(3)]


@pytest.mark.parametrize("depth", [1, 3])
def test_host_unrolled_copies_each_boundary_to_the_host_and_back_once(depth):
    stack = eae_jax.reconstruct(lambda w, x: jnp.tanh(x @ w), storage=HostUnrolled())
    text = str(jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(stack(p, x))))(jnp.ones((depth, 8, 8)), X))
    copies = re.findall(r":(\S+) = device_put", text)
    assert sorted(copies) == ["f32<host>[2,8]"] * depth + ["f32[2,8]"] * depth, copies


def test_host_unrolled_fences_each_copy_back_with_the_block_it_overlaps():
    # the copy of boundary i-1 must be done when block i's backward is: a barrier on the copy, block i's
    # input adjoint and its gradients, for every block but the first (XLA:CPU ignores memory placement,
    # so the schedule is checked in the program, not in compiled memory)
    stack = eae_jax.reconstruct(lambda w, x: jnp.tanh(x @ w), storage=HostUnrolled())
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(stack(p, x))))(jnp.ones((3, 8, 8)), X).jaxpr
    eqns = list(all_eqns(jaxpr))
    back = {v for e in eqns if e.primitive.name == "device_put" for v in e.outvars if "<host>" not in str(v.aval)}
    fenced = [e for e in eqns if e.primitive.name == "optimization_barrier" and back & set(e.invars)]
    assert len(back) == 3 and len(fenced) == 2 and all(len(e.invars) == 3 for e in fenced), fenced


def test_host_unrolled_gradients_equal_plain_autodiff_and_int_params_get_float0():
    params, side = two_segments(), jnp.linspace(0.5, 1.5, 8)
    # the side input is a constant to the stack (its cotangent is zero): not differentiated here
    want_value, want = jax.value_and_grad(plain_loss, argnums=(0, 1), allow_int=True)(params, X, side)
    for storage in (HostUnrolled(), [Host(), HostUnrolled()]):
        stack = eae_jax.reconstruct([sided, eae_jax.Scan(sided)], storage=storage)
        value, got = jax.jit(jax.value_and_grad(lambda p, x, s: jnp.sum(jnp.sin(stack(p, x, side=s))),
                                                argnums=(0, 1), allow_int=True))(params, X, side)
        np.testing.assert_allclose(value, want_value, rtol=1e-6)
        chex.assert_trees_all_close(without_float0(got), without_float0(want), rtol=1e-5, atol=1e-5)
        assert got[0][1]["n"].dtype == jax.dtypes.float0 and got[0][1]["n"].shape == (3,)


def test_host_unrolled_recomputes_a_bfloat16_stack_in_bfloat16():
    # the boundaries come back in the input's dtype: the block's VJP must see bfloat16, as the device store's does
    params = {"w": params_of(3)["w"].astype(jnp.bfloat16), "n": jnp.zeros(3, jnp.bfloat16)}
    x = X.astype(jnp.bfloat16)
    grads = [jax.jit(jax.grad(lambda p, xx: jnp.sum(jnp.sin(s(p, xx)).astype(jnp.float32)), argnums=(0, 1)))(params, x)
             for s in (eae_jax.reconstruct(block, storage=HostUnrolled()),
                       eae_jax.reconstruct(block, storage=OnDevice()))]
    assert grads[0][1].dtype == jnp.bfloat16 and grads[0][0]["w"].dtype == jnp.bfloat16
    chex.assert_trees_all_close(grads[0], grads[1], rtol=1e-2, atol=1e-2)


def carry_step(stack, params):
    def loss(p, c, x):
        return jnp.sum(jnp.sin(stack(p, x, c)))

    @jax.jit
    def step(p, c, x):
        value, (gp, gc, gx) = jax.value_and_grad(loss, argnums=(0, 1, 2), allow_int=True)(p, c, x)
        c2, stats = stack.update(c, gc)
        return value, gp, gx, stack.state(c2), stats

    return step(params, stack.init(params, X, jax.random.key(5)), X)


def test_host_unrolled_runs_the_passes_at_each_boundary_like_the_device_store():
    # bfloat16 boundaries (recomputed from in float32), noise drawn from each block's own key (pass
    # state), a pass at boundary 2 only (the second block of the unrolled run, which starts at boundary 1)
    # and a clip at every boundary: gradients, pass state and statistics
    passes = chain(gaussian_noise(0.01), at_layers(decay(0.5), [2]), clip_by_norm(0.5))
    params = two_segments()
    got, want = (carry_step(eae_jax.reconstruct([block, eae_jax.Scan(block)], passes=passes, storage=s), params)
                 for s in (HostUnrolled("bfloat16"), OnDevice("bfloat16")))
    chex.assert_trees_all_close(without_float0(got), without_float0(want), rtol=1e-6, atol=1e-7)
    assert got[4]["adjoint_norm"].shape == (5,) and bool(jnp.all(got[4]["adjoint_norm"] > 0))
    # the decay acted at boundary 2: without it the gradients differ
    other = carry_step(eae_jax.reconstruct([block, eae_jax.Scan(block)], passes=chain(
        gaussian_noise(0.01), at_layers(decay(0.5), [3]), clip_by_norm(0.5)), storage=HostUnrolled("bfloat16")), params)
    assert not np.allclose(other[1][0]["w"], got[1][0]["w"])


def test_host_unrolled_returns_each_blocks_new_state():
    def stateful(p, x):
        return x + jnp.tanh(x @ p["w"]), p["count"] + jnp.sum(x)

    params = {"w": params_of(3)["w"], "count": jnp.zeros((3,))}
    outs = []
    for storage in (HostUnrolled(), OnDevice()):
        stack = eae_jax.reconstruct(stateful, block_state=True, storage=storage)
        def run(p):
            (y, states), vjp = jax.vjp(lambda q: stack(q, X), p)
            return y, states, vjp((jnp.cos(y), jnp.zeros_like(states)))

        outs.append(jax.jit(run)(params))
    chex.assert_trees_all_close(outs[0], outs[1], rtol=1e-6, atol=1e-7)
    h, counts = X, []
    for i in range(3):
        counts.append(jnp.sum(h))
        h = h + jnp.tanh(h @ params["w"][i])
    np.testing.assert_allclose(outs[0][1], np.asarray(counts), rtol=1e-6)
