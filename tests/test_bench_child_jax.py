"""The JAX child of the stack benchmark (experiments/bench_child_jax.py):
its remat stack is the library's but for ``prevent_cse``, and it knows when
`reconstruct` keeps boundaries in the gradient buffers."""

import jax
import jax.numpy as jnp

from conftest import load_experiment
from jaxpr_walk import all_eqns

bcj = load_experiment("bench_child_jax")

from eae_jax.blocks import BlockConfig, decoder_block, init_stack, plain_stack  # noqa: E402

CFG = BlockConfig(dim=32, num_heads=4, num_kv_heads=2, ffn_hidden_dim=64)


def _setup(depth=2):
    params = init_stack(jax.random.key(0), CFG, depth)
    return decoder_block(CFG), params, jnp.ones((2, 8, 32))


def _prevent_cse_flags(closed):
    """``prevent_cse`` of every checkpoint equation (whatever JAX names the primitive)."""
    return [e.params["prevent_cse"] for e in all_eqns(closed.jaxpr) if "prevent_cse" in e.params]


def test_remat_stack_with_prevent_cse_is_plain_stacks_remat():
    block, params, x = _setup()
    policy = jax.checkpoint_policies.nothing_saveable
    ours = jax.make_jaxpr(lambda p: bcj.remat_stack(block, p, x, policy, True))(params)
    lib = jax.make_jaxpr(lambda p: plain_stack(block, p, x, remat_policy=policy))(params)
    assert str(ours) == str(lib)
    nocse = jax.make_jaxpr(lambda p: bcj.remat_stack(block, p, x, policy, False))(params)
    assert _prevent_cse_flags(nocse) == [False] and _prevent_cse_flags(ours) == [True]


def test_remat_stack_gradients_match_plain_autodiff():
    block, params, x = _setup()
    loss = lambda f: lambda p: jnp.sum(f(p) ** 2)  # noqa: E731
    want = jax.jit(jax.grad(loss(lambda p: plain_stack(block, p, x))))(params)
    got = jax.jit(jax.grad(loss(lambda p: bcj.remat_stack(block, p, x, None, False))))(params)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_boundaries_in_grads_follows_reconstructs_conditions():
    params = jax.eval_shape(lambda: init_stack(jax.random.key(0), CFG, 3))
    p_sds = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    small = jax.ShapeDtypeStruct((1, 8, 32), jnp.bfloat16)  # one boundary fits in one block's gradients
    large = jax.ShapeDtypeStruct((64, 512, 32), jnp.bfloat16)  # it does not
    assert bcj.boundaries_in_grads({}, p_sds, small) is True
    assert bcj.boundaries_in_grads({}, p_sds, large) is False
    for variant in ({"boundaries_in_grads": False}, {"offload": True}, {"policy": "dots"}):
        assert bcj.boundaries_in_grads(variant, p_sds, small) is False
