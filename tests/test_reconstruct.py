"""`eae_jax.reconstruct`: gradients against plain autodiff, composition,
memory, arguments and carries, higher-order derivatives.

The storages one by one: tests/test_reconstruct_storage.py.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import eae_jax
from eae_jax import passes as P
from eae_jax.blocks import BlockConfig, decoder_block, init_block, init_stack, plain_stack
from eae_jax.blocks.linear import init_linear, linear


def max_tree_rel_err(a, b):
    """The largest per-leaf `rel_err` of two trees of one structure, shapes and dtypes."""
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    return max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(rel_err, a, b)))


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
    _, stats2 = stack.update(carry2, jax.jit(jax.grad(lambda c: loss_of(stack(params, x, c))))(carry2))
    assert int(stats2["step"]) == 1


def test_boundary_dtype_bf16_stores_rounded_boundaries():
    cfg = BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32)
    block = decoder_block(cfg)
    params = init_stack(jax.random.key(0), cfg, 3)
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    stack = eae_jax.reconstruct(block, boundary_dtype="bf16")
    y = stack(params, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain_stack(block, params, x)))
    got = jax.jit(jax.grad(lambda p: loss_of(stack(p, x))))(params)
    want = jax.jit(jax.grad(lambda p: loss_of(plain_stack(block, p, x))))(params)
    err = max_tree_rel_err(got, want)
    assert 0 < err < 2e-2  # recomputed from bf16-rounded boundaries: close, not identical

    # stored separately, the residuals the backward keeps are bf16; stored in
    # the (f32) gradient slots they hold the same bf16 bits: same gradients
    separate = eae_jax.reconstruct(block, boundary_dtype="bf16", boundaries_in_grads=False)
    jaxpr = jax.make_jaxpr(lambda p: jax.vjp(lambda q: separate(q, x), p)[1])(params)
    assert "bf16[3,2,6,16]" in str(jaxpr)
    chex.assert_trees_all_equal(jax.jit(jax.grad(lambda p: loss_of(separate(p, x))))(params), got)


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
    got = jax.jit(jax.vmap(lambda x: jax.grad(lambda p: loss_of(stack(p, x)))(params)))(xs)
    want = jax.jit(jax.vmap(lambda x: jax.grad(lambda p: loss_of(plain_stack(block, p, x)))(params)))(xs)
    assert max_tree_rel_err(got, want) <= 1e-5


# ---------------------------------------------------------------- small residual stacks
def _block(w, x):
    return x + jnp.tanh(x @ w["w"]) * w["s"]


def _plain(params, x):
    return jax.lax.scan(lambda h, p: (_block(p, h), None), x, params)[0]


def _params(depth, dim, dtype, key=0):
    return {"w": jax.random.normal(jax.random.key(key), (depth, dim, dim), dtype) * 0.4,
            "s": jnp.linspace(0.5, 1.5, depth, dtype=dtype)}


@pytest.mark.parametrize("boundaries_in_grads", [True, False])
@pytest.mark.parametrize("depth", [1, 3])
def test_float64_stack_under_x64_matches_plain_autodiff(depth, boundaries_in_grads):
    # With jax_enable_x64 the gradient-slot store mixed an int32 row index with
    # an int64 literal 0 and every default stack failed to trace.
    with jax.enable_x64(True):
        params = _params(depth, 6, jnp.float64)
        x = jax.random.normal(jax.random.key(1), (2, 6), jnp.float64)
        stack = eae_jax.reconstruct(_block, boundaries_in_grads=boundaries_in_grads)
        got = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(stack(p, x))), argnums=(0, 1)))(params, x)
        ref = jax.grad(lambda p, x: jnp.sum(jnp.sin(_plain(p, x))), argnums=(0, 1))(params, x)
        assert all(l.dtype == jnp.float64 for l in jax.tree_util.tree_leaves(got))
        chex.assert_trees_all_close(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw", [{}, {"offload": "unrolled"}])
def test_depth_zero_scan_is_the_identity(kw):
    # A scanned run of depth 0 failed to trace (slot store, unrolled offload).
    head = jnp.arange(16.0).reshape(4, 4) / 8 - 1  # not symmetric: a transposed weight would show
    stack = eae_jax.reconstruct([eae_jax.Scan(_block), lambda w, x: x @ w], passes=P.statistics(), **kw)
    params = [_params(0, 4, jnp.float32), head]
    x = jnp.arange(8.0).reshape(2, 4)
    carry = stack.init(params, x)
    gp, gc, gx = jax.jit(jax.grad(lambda p, c, x: jnp.sum(stack(p, x, c) ** 2), argnums=(0, 1, 2)))(params, carry, x)
    _, stats = stack.update(carry, gc)
    want_w, want_x = jax.grad(lambda w, x: jnp.sum((x @ w) ** 2), argnums=(0, 1))(head, x)
    chex.assert_trees_all_close((gp[1], gx), (want_w, want_x), rtol=1e-6)
    assert gp[0]["w"].shape == (0, 4, 4) and stats["adjoint_norm"].shape == (2,) and int(stats["calls"]) == 1


@pytest.mark.parametrize("blocks", [None, 5, "ab"])
def test_reconstruct_rejects_non_blocks_clearly(blocks):
    with pytest.raises(TypeError, match="reconstruct: blocks must be"):
        eae_jax.reconstruct(blocks)


def test_lone_scan_and_list_input():
    # A lone Scan (a NamedTuple) was iterated as a list of blocks; a nested
    # list x raised AttributeError.
    params = _params(2, 3, jnp.float32)
    x = [[0.1, -0.2, 0.3]]
    got = eae_jax.reconstruct(eae_jax.Scan(_block, "run"))(params, x)
    np.testing.assert_allclose(got, _plain(params, jnp.asarray(x)), rtol=1e-6)


def test_carry_of_another_depth_raises_clearly():
    stack = eae_jax.reconstruct(_block, passes=P.capture())
    x = jnp.ones((2, 4))
    carry = stack.init(_params(3, 4, jnp.float32), x)
    with pytest.raises(ValueError, match="carry was made for a stack with 4 boundaries"):
        jax.grad(lambda p, c: jnp.sum(stack(p, x, c)), argnums=(0, 1))(_params(5, 4, jnp.float32), carry)


# ---------------------------------------------------------------- higher order
def _grad_of_grad(stack_fn, params, x):
    inner = lambda p, x: jax.grad(lambda x: jnp.sum(jnp.sin(stack_fn(p, x))))(x)  # noqa: E731
    return jax.grad(lambda p: jnp.sum(inner(p, x) ** 2))(params)


@pytest.mark.parametrize("kw", [{"boundaries_in_grads": False}, {"policy": "dots"}])
def test_grad_of_grad_matches_plain_autodiff(kw):
    with jax.enable_x64(True):
        params, x = _params(3, 4, jnp.float64), jax.random.normal(jax.random.key(1), (2, 4), jnp.float64)
        got = _grad_of_grad(eae_jax.reconstruct(_block, **kw), params, x)
        chex.assert_trees_all_close(got, _grad_of_grad(_plain, params, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw, fix", [({}, "boundaries_in_grads=False"), ({"offload": True}, "offload=False"),
                                     ({"offload": "unrolled"}, "offload=False")])
def test_grad_of_grad_through_byte_stored_boundaries_raises(kw, fix):
    # Boundaries kept as raw bytes in the gradient slots (the default) have
    # no derivative path: grad of grad silently returned wrong numbers.
    params, x = _params(3, 4, jnp.float32), jnp.ones((2, 4))
    with pytest.raises(ValueError, match=fix):
        _grad_of_grad(eae_jax.reconstruct(_block, **kw), params, x)


def test_differentiating_only_the_cotangent_through_gradient_slots_raises():
    # d/dc of grad_p(c * loss): the boundaries do not depend on c, only the
    # gradients do, and those go through the slots as raw bytes; without
    # their own guard d/dc silently came out 0. Stored apart, it is plain
    # autodiff's.
    params, x = 0.5 * jax.random.normal(jax.random.key(0), (3, 4, 4)), jnp.ones((2, 4))

    def d_dc(stack_fn):
        inner = lambda c: jax.grad(lambda p: c * jnp.sum(jnp.sin(stack_fn(p, x))))(params)  # noqa: E731
        return jax.grad(lambda c: jnp.sum(inner(c) ** 2))(2.0)

    block = lambda w, h: jnp.tanh(h @ w)  # noqa: E731 (one weight leaf: its gradient fills the slots)
    with pytest.raises(ValueError, match="with grad_slots storage: .*boundaries_in_grads=False"):
        d_dc(eae_jax.reconstruct(block))
    want = d_dc(lambda p, h: jax.lax.scan(lambda h, w: (block(w, h), None), h, p)[0])
    np.testing.assert_allclose(d_dc(eae_jax.reconstruct(block, boundaries_in_grads=False)), want, rtol=1e-5)


# ---------------------------------------------------------------- init and the carry
@pytest.mark.parametrize("key", [0, 7, np.int64(7), "typed", "raw"])
def test_init_takes_int_seeds_and_both_key_kinds(key):
    # An int seed used to fail deep inside jax.random.split with a message
    # about key_data attributes.
    stack = eae_jax.reconstruct(_block, passes=P.gaussian_noise(0.1))
    params, x = _params(3, 4, jnp.float32), jnp.ones((2, 4))
    as_key = {"typed": jax.random.key(7), "raw": jax.random.PRNGKey(7)}.get(key, key)
    carry = stack.init(params, x, key=as_key)
    ref = stack.init(params, x, key=jax.random.key(int(key) if not isinstance(key, str) else 7))
    chex.assert_trees_all_equal(carry, ref)


@pytest.mark.parametrize("key", [1.5, True, "0", jnp.zeros((3,), jnp.uint32), jax.random.split(jax.random.key(0), 2)])
def test_init_refuses_what_is_not_a_key(key):
    stack = eae_jax.reconstruct(_block, passes=P.gaussian_noise(0.1))
    params, x = _params(3, 4, jnp.float32), jnp.ones((2, 4))
    with pytest.raises(TypeError, match="key must be"):
        stack.init(params, x, key=key)


@pytest.mark.parametrize("change", ["dtype", "rows"])
def test_carry_made_for_other_shapes_or_dtypes_is_named(change):
    # A capture state made for float32 adjoints was silently cast from the
    # bfloat16 ones; a top-k residual made for 2 rows failed inside the
    # backward with a bare broadcasting error.
    stack = eae_jax.reconstruct(_block, passes=P.chain(P.capture(), P.topk_compress(0.5)))
    params, x = _params(3, 4, jnp.float32), jnp.ones((2, 4))
    carry = stack.init(params, x)
    if change == "dtype":
        params, x = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params), x.astype(jnp.bfloat16)
    else:
        x = jnp.ones((3, 4))

    def loss(p, c, x_):
        return jnp.sum(stack(p, x_, c).astype(jnp.float32))

    with pytest.raises(ValueError, match=r"pass state .*(bfloat16|float32\[3, 3, 4\])"):
        jax.grad(loss, argnums=(0, 1))(params, carry, x)
    # The carry made for this call works.
    jax.grad(loss, argnums=(0, 1))(params, stack.init(params, x), x)


def test_params_without_depth_axis_are_explained():
    # Unstacked params of a scanned block: the first weight axis was taken
    # for the depth and the message only said the block changed the shape.
    stack = eae_jax.reconstruct(lambda p, x: jnp.tanh(x @ p["w"]))
    with pytest.raises(ValueError, match=r"params \{\['w'\]: float32\[4\]\}.*leading depth axis; it was read as 4"):
        stack({"w": jnp.ones((4, 4))}, jnp.ones((2, 4)))


def test_side_with_python_scalars_passes_the_carry_check():
    # The carry check abstracted side leaf by leaf and failed on a Python float.
    stack = eae_jax.reconstruct(lambda p, x, side: _block(p, x) * side["a"], passes=P.capture())
    params, x, side = _params(3, 4, jnp.float32), jnp.ones((2, 4)), {"a": 2.0}
    carry = stack.init(params, x, side=side)
    g, _ = jax.jit(jax.grad(lambda p, c: jnp.sum(stack(p, x, c, side=side)), argnums=(0, 1)))(params, carry)
    ref = jax.grad(lambda p: jnp.sum(jax.lax.scan(lambda h, q: (_block(q, h) * 2.0, None), x, p)[0]))(params)
    chex.assert_trees_all_close(g, ref, rtol=0, atol=1e-5)


def test_numpy_float64_input_is_canonicalised_like_jit_does():
    """A numpy float64 x (x64 off) looked like a scanned block changing the
    dtype (float64 -> float32) and was refused; lax.scan accepts it."""
    params = _params(3, 4, jnp.float32)
    x = np.linspace(-1.0, 1.0, 8).reshape(2, 4)  # float64
    stack = eae_jax.reconstruct(_block)
    y = stack(params, x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(_plain(params, jnp.asarray(x))), rtol=1e-6)
    g = jax.grad(lambda p: jnp.sum(stack(p, x) ** 2))(params)
    ref = jax.grad(lambda p: jnp.sum(_plain(p, jnp.asarray(x)) ** 2))(params)
    chex.assert_trees_all_close(g, ref, rtol=0, atol=1e-5)


def test_layout_errors_name_typed_key_params():
    # Formatting the params of a failing block crashed on a typed key's dtype.
    stack = eae_jax.reconstruct(lambda p, x: x @ p["w"])
    params = {"w": jnp.ones((2, 3, 4)), "rng": jax.random.split(jax.random.key(0), 2)}
    with pytest.raises(ValueError, match=r"\{\['rng'\]: key<fry>\[\], \['w'\]: float32\[3, 4\]\}"):
        stack(params, jnp.ones((1, 3)))
