"""Gradient equivalence, composition and memory of `eae_jax.reconstruct`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax.blocks import BlockConfig, decoder_block, init_block, init_stack, plain_stack
from eae_jax.blocks.linear import init_linear, linear


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def max_tree_rel_err(a, b):
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    return max(rel_err(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def loss_of(out):
    # A loss with a non-trivial, non-uniform output cotangent.
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) * 0.37)
    return jnp.sum(jnp.tanh(out) * w)


@pytest.mark.parametrize("depth", [1, 2, 5, 8])
@pytest.mark.parametrize("rope_style", ["interleaved", "half"])
@pytest.mark.parametrize("kv_heads", [4, 2])  # MHA, GQA
def test_gradients_equal_plain_stack(depth, rope_style, kv_heads):
    cfg = BlockConfig(dim=32, num_heads=4, num_kv_heads=kv_heads, ffn_hidden_dim=48, rope_style=rope_style)
    block = decoder_block(cfg)
    params = init_stack(jax.random.key(depth), cfg, depth)
    x = jax.random.normal(jax.random.key(100 + depth), (2, 12, 32), jnp.float32)
    stack = eae_jax.reconstruct(block)

    got = jax.jit(jax.value_and_grad(lambda p, x: loss_of(stack(p, x)), argnums=(0, 1)))(params, x)
    want = jax.jit(jax.value_and_grad(lambda p, x: loss_of(plain_stack(block, p, x)), argnums=(0, 1)))(params, x)
    assert rel_err(got[0], want[0]) <= 1e-6
    assert max_tree_rel_err(got[1], want[1]) <= 1e-6


@pytest.mark.parametrize("policy", ["dots", "dots_all", "everything", jax.checkpoint_policies.nothing_saveable])
def test_policies_give_the_same_gradients(policy):
    cfg = BlockConfig(dim=32, num_heads=4, num_kv_heads=1, ffn_hidden_dim=64)
    block = decoder_block(cfg)
    params = init_stack(jax.random.key(0), cfg, 3)
    x = jax.random.normal(jax.random.key(1), (2, 8, 32))
    stack = eae_jax.reconstruct(block, policy=policy)
    got = jax.jit(jax.grad(lambda p, x: loss_of(stack(p, x)), argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(lambda p, x: loss_of(plain_stack(block, p, x)), argnums=(0, 1)))(params, x)
    assert max_tree_rel_err(got, want) <= 1e-6


def _hetero_model(key):
    """embedding -> 3 scanned decoder blocks -> 1 unscanned block -> projection head."""
    cfg = BlockConfig(dim=32, num_heads=4, num_kv_heads=2, ffn_hidden_dim=48)
    k = jax.random.split(key, 4)
    params = [
        jax.random.normal(k[0], (37, 32)),
        init_stack(k[1], cfg, 3),
        init_block(k[2], cfg),
        init_linear(k[3], 11, 32),
    ]
    blocks = [
        lambda table, tok: jnp.take(table, tok, axis=0),
        eae_jax.Scan(decoder_block(cfg), "decoder"),
        decoder_block(cfg),
        lambda w, h: linear(h, w),
    ]
    return blocks, params, cfg


def test_heterogeneous_stack_matches_plain_composition():
    blocks, params, cfg = _hetero_model(jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, 37)
    stack = eae_jax.reconstruct(blocks)

    def plain(params, tokens):
        h = blocks[0](params[0], tokens)
        h = plain_stack(blocks[1].fn, params[1], h)
        h = blocks[2](params[2], h)
        return blocks[3](params[3], h)

    got = jax.jit(jax.value_and_grad(lambda p: loss_of(stack(p, tokens))))(params)
    want = jax.jit(jax.value_and_grad(lambda p: loss_of(plain(p, tokens))))(params)
    assert rel_err(got[0], want[0]) <= 1e-6
    assert max_tree_rel_err(got[1], want[1]) <= 1e-6


def test_composes_with_has_aux_and_nested_loss_and_stats():
    cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
    block = decoder_block(cfg)
    params = init_stack(jax.random.key(0), cfg, 4)
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    stack = eae_jax.reconstruct(block)
    carry = stack.init(params, x)

    def inner(p, c, x):
        y = stack(p, x, c)
        return loss_of(y), {"mean": jnp.mean(y)}

    def outer(p, c, x):  # the stack used inside a larger user function
        l, aux = inner(p, c, x * 2.0)
        return 0.5 * l + jnp.sum(p["ffn_norm"]["scale"] ** 2), aux

    @jax.jit
    def step(p, c, x):
        (l, aux), (gp, gc) = jax.value_and_grad(outer, argnums=(0, 1), has_aux=True)(p, c, x)
        c, stats = stack.update(c, gc)
        return l, aux, gp, c, stats

    l, aux, gp, carry2, stats = step(params, carry, x)

    def ref(p, x):
        y = plain_stack(block, p, x * 2.0)
        return 0.5 * loss_of(y) + jnp.sum(p["ffn_norm"]["scale"] ** 2), {"mean": jnp.mean(y)}

    (lr, auxr), gr = jax.jit(jax.value_and_grad(ref, has_aux=True))(params, x)
    assert rel_err(l, lr) <= 1e-6 and rel_err(aux["mean"], auxr["mean"]) <= 1e-5
    assert max_tree_rel_err(gp, gr) <= 1e-6

    # per-boundary adjoint norms against an independent per-block VJP chain
    boundaries = [x * 2.0]
    for i in range(4):
        boundaries.append(block(jax.tree_util.tree_map(lambda a: a[i], params), boundaries[-1]))
    g = jax.grad(loss_of)(boundaries[-1]) * 0.5
    norms = [np.linalg.norm(np.asarray(g))]
    for i in reversed(range(4)):
        _, vjp = jax.vjp(lambda h: block(jax.tree_util.tree_map(lambda a: a[i], params), h), boundaries[i])
        (g,) = vjp(g)
        norms.append(np.linalg.norm(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(stats["adjoint_norm"]), norms[::-1], rtol=1e-5)
    assert int(stats["step"]) == 0 and float(stats["calls"]) == 1.0
    _, stats2 = stack.update(carry2, jax.grad(lambda c: loss_of(stack(params, x, c)))(carry2))
    assert int(stats2["step"]) == 1


def test_boundary_dtype_bf16_stores_rounded_boundaries():
    cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
    block = decoder_block(cfg)
    params = init_stack(jax.random.key(0), cfg, 3)
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    stack = eae_jax.reconstruct(block, boundary_dtype="bf16")
    y = stack(params, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain_stack(block, params, x)))
    got = jax.grad(lambda p: loss_of(stack(p, x)))(params)
    want = jax.grad(lambda p: loss_of(plain_stack(block, p, x)))(params)
    err = max_tree_rel_err(got, want)
    assert 0 < err < 2e-2  # recomputed from bf16-rounded boundaries: close, not identical

    # stored separately, the residuals the backward keeps are bf16; stored in
    # the (f32) gradient slots they hold the same bf16 bits: same gradients
    separate = eae_jax.reconstruct(block, boundary_dtype="bf16", boundaries_in_grads=False)
    jaxpr = jax.make_jaxpr(lambda p: jax.vjp(lambda q: separate(q, x), p)[1])(params)
    assert "bf16[3,2,6,16]" in str(jaxpr)
    chex.assert_trees_all_equal(jax.grad(lambda p: loss_of(separate(p, x)))(params), got)


# ---------------------------------------------------------------- bad inputs
def test_wrong_param_tree_names_the_block_and_shapes():
    cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
    stack = eae_jax.reconstruct(decoder_block(cfg))
    params = init_stack(jax.random.key(0), cfg, 2)
    bad = jax.tree_util.tree_map(lambda a: a, params)
    bad["ffn"]["w_up"] = jnp.zeros((2, 31, 16))
    with pytest.raises(ValueError, match=r"decoder_block.*float32\[2, 5, 16\]"):
        stack(bad, jnp.zeros((2, 5, 16)))
    with pytest.raises(ValueError, match=r"decoder block expects input \(batch, seq, 16\), got shape \(2, 5, 8\)"):
        stack(params, jnp.zeros((2, 5, 8)))
    ragged = jax.tree_util.tree_map(lambda a: a, params)
    ragged["attn_norm"]["scale"] = jnp.ones((3, 16))
    with pytest.raises(ValueError, match="same leading depth axis"):
        stack(ragged, jnp.zeros((2, 5, 16)))


def test_scanned_block_must_keep_shape_and_segment_count_checked():
    stack = eae_jax.reconstruct(lambda w, h: linear(h, w))
    with pytest.raises(ValueError, match=r"maps float32\[2, 4\] to float32\[2, 3\]"):
        stack(jnp.zeros((5, 3, 4)), jnp.zeros((2, 4)))
    blocks, params, _ = _hetero_model(jax.random.key(0))
    with pytest.raises(ValueError, match="4 segments .* but 3 param entries"):
        eae_jax.reconstruct(blocks)(params[:3], jnp.zeros((2, 3), jnp.int32))


def test_config_validation_errors():
    with pytest.raises(ValueError, match=r"dim \(30\) must be divisible by num_heads \(4\)"):
        BlockConfig(dim=30, num_heads=4)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        BlockConfig(dim=32, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="even head_dim"):
        BlockConfig(dim=12, num_heads=4)
    cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32, max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds the RoPE table length max_seq_len=8"):
        decoder_block(cfg)(init_block(jax.random.key(0), cfg), jnp.zeros((1, 9, 16)))
    with pytest.raises(ValueError, match="unknown policy"):
        eae_jax.reconstruct(decoder_block(cfg), policy="sometimes")


def test_default_ffn_hidden_dim_rule():
    assert BlockConfig(dim=512, num_heads=8).ffn_hidden_dim == 1536
    assert BlockConfig(dim=2048, num_heads=16).ffn_hidden_dim == 5632
    assert BlockConfig(dim=4096, num_heads=32).ffn_hidden_dim == 11008


# ---------------------------------------------------------------- memory
def _temp_bytes(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend gives no memory_analysis()")
    return analysis.temp_size_in_bytes


def test_temporary_memory_grows_by_one_boundary_per_block():
    # Block internals (q/k/v, attention probabilities, three FFN activations)
    # are many boundaries' worth; params are small next to activations.
    cfg = BlockConfig(dim=64, num_heads=8, num_kv_heads=8, ffn_hidden_dim=256)
    block = decoder_block(cfg)
    batch, seq = 4, 128
    boundary_bytes = batch * seq * cfg.dim * 4
    x = jnp.ones((batch, seq, cfg.dim), jnp.float32)
    stack = eae_jax.reconstruct(block)

    def step_eae(p, x):
        return jax.grad(lambda p: loss_of(stack(p, x)))(p)

    def step_plain(p, x):
        return jax.grad(lambda p: loss_of(plain_stack(block, p, x)))(p)

    temps = {}
    for depth in (2, 8):
        params = init_stack(jax.random.key(0), cfg, depth)
        temps[("eae", depth)] = _temp_bytes(step_eae, params, x)
        temps[("plain", depth)] = _temp_bytes(step_plain, params, x)
    eae_slope = (temps[("eae", 8)] - temps[("eae", 2)]) / 6
    plain_slope = (temps[("plain", 8)] - temps[("plain", 2)]) / 6
    assert plain_slope >= 4 * boundary_bytes, (plain_slope, boundary_bytes)
    assert eae_slope <= 1.5 * boundary_bytes, (eae_slope, boundary_bytes, temps)


def test_side_input_reaches_every_block_and_is_not_differentiated():
    # A per-position gate (like a mask or a table) given to every block as a third argument.
    def block(w, h, gate):
        return h + jnp.tanh(h @ w) * gate[:, None]

    params = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.5
    x = jax.random.normal(jax.random.key(1), (6, 8))
    gate = jnp.linspace(0.0, 1.0, 6)
    stack = eae_jax.reconstruct(block)

    def plain(p, x, gate):
        return plain_stack(lambda w, h: block(w, h, gate), p, x)

    got = jax.jit(jax.grad(lambda p, x: loss_of(stack(p, x, side=gate)), argnums=(0, 1)))(params, x)
    want = jax.grad(lambda p, x: loss_of(plain(p, x, gate)), argnums=(0, 1))(params, x)
    assert max_tree_rel_err(got, want) <= 1e-6
    # the side input gets a zero cotangent, not a wrong one
    g_side = jax.grad(lambda s: loss_of(stack(params, x, side=s)))(gate)
    np.testing.assert_array_equal(np.asarray(g_side), np.zeros(6))


def test_vmap_over_a_batch_of_inputs():
    cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
    block = decoder_block(cfg)
    params = init_stack(jax.random.key(0), cfg, 3)
    xs = jax.random.normal(jax.random.key(1), (3, 1, 5, 16))
    stack = eae_jax.reconstruct(block)
    got = jax.vmap(lambda x: jax.grad(lambda p: loss_of(stack(p, x)))(params))(xs)
    want = jax.vmap(lambda x: jax.grad(lambda p: loss_of(plain_stack(block, p, x)))(params))(xs)
    assert max_tree_rel_err(got, want) <= 1e-5
