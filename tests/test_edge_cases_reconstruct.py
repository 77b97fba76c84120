"""Edge cases of `eae_jax.reconstruct` and `eae_jax.passes` found by probing
with inputs the other tests do not use (regression tests for fixed bugs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import passes as P


def _block(w, x):
    return x + jnp.tanh(x @ w["w"]) * w["s"]


def _plain(params, x):
    return jax.lax.scan(lambda h, p: (_block(p, h), None), x, params)[0]


def _params(depth, dim, dtype, key=0):
    return {"w": jax.random.normal(jax.random.key(key), (depth, dim, dim), dtype) * 0.4,
            "s": jnp.linspace(0.5, 1.5, depth, dtype=dtype)}


def _max_err(a, b):
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _ctx():
    return P.PassContext(jnp.int32(0), jnp.int32(0), jnp.int32(0), 3)


def _apply(pass_, g, calls=1):
    state = pass_.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0))
    for _ in range(calls):
        out, state = jax.jit(pass_.update)(g, state, _ctx())
    return out, state


# ----------------------------------------------------------------------------- x64
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
        assert _max_err(got, ref) < 1e-12


# ----------------------------------------------------------------------------- depth 0
@pytest.mark.parametrize("kw", [{}, {"offload": "unrolled"}])
def test_depth_zero_scan_is_the_identity(kw):
    # A scanned run of depth 0 failed to trace (slot store, unrolled offload).
    stack = eae_jax.reconstruct([eae_jax.Scan(_block), lambda w, x: x @ w], passes=P.statistics(), **kw)
    params = [_params(0, 4, jnp.float32), jnp.eye(4) * 2.0]
    x = jnp.arange(8.0).reshape(2, 4)
    carry = stack.init(params, x)
    gp, gc, gx = jax.jit(jax.grad(lambda p, c, x: jnp.sum(stack(p, x, c) ** 2), argnums=(0, 1, 2)))(params, carry, x)
    _, stats = stack.update(carry, gc)
    np.testing.assert_allclose(gx, 8.0 * x, rtol=1e-6)  # d/dx sum((2x)^2)
    np.testing.assert_allclose(gp[1], 2.0 * x.T @ (2.0 * x) * 1.0, rtol=1e-6)
    assert gp[0]["w"].shape == (0, 4, 4) and stats["adjoint_norm"].shape == (2,) and int(stats["calls"]) == 1


# ----------------------------------------------------------------------------- quantizers
@pytest.mark.parametrize("amax", [1e-36, 3e-37, 4e-36])
def test_int8_fake_quant_keeps_tiny_adjoints_finite(amax):
    # Tiny (normal) adjoints came out NaN: the scale amax/127 is subnormal,
    # flushed to 0, then 0/0. Quantization is equivariant under power-of-two
    # scaling: the tiny adjoint must quantize exactly like itself times 2**80.
    g = jnp.array([amax, -amax / 3, amax / 7, 0.0], jnp.float32)
    out, _ = _apply(P.int8_fake_quant(), g)
    big, _ = _apply(P.int8_fake_quant(), g * 2.0 ** 80)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(big, np.float64) * 2.0 ** -80)


@pytest.mark.parametrize("fmt, scaling", [("e4m3", "current"), ("e5m2", "current"), ("e4m3", "delayed")])
@pytest.mark.parametrize("amax", [1e-36, 3e-37, 4e-36])
def test_fp8_quant_keeps_tiny_adjoints_finite(fmt, scaling, amax):
    # fp8_max/amax overflowed to an infinite inverse scale (or a scale that is
    # subnormal, flushed to 0): NaN or zero adjoints. The scale is now kept
    # at or above 2**-126; reference: numpy's fp8 cast (ml_dtypes) with it.
    import ml_dtypes

    g = jnp.array([amax, -amax / 3, amax / 7, 0.0], jnp.float32)
    out, state = _apply(P.fp8_quant(fmt, scaling), g, calls=2)
    scale = 2.0 ** -126
    fp8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    ref = np.asarray(g, np.float64) * (1.0 / scale)
    ref = ref.astype(np.float32).astype(fp8).astype(np.float64) * scale
    assert bool(jnp.all(jnp.isfinite(out))) and float(state.scale) == scale
    np.testing.assert_array_equal(np.asarray(out, np.float64), ref)
    assert abs(float(out[0]) - amax) <= amax / 4


def test_int8_fake_quant_ordinary_adjoint_still_matches_numpy():
    g = jax.random.normal(jax.random.key(3), (64,), jnp.float32)
    out, state = _apply(P.int8_fake_quant(), g)
    t = np.asarray(g, np.float32)
    scale = np.float32(np.max(np.abs(t)) / np.float32(127.0))
    ref = (np.clip(np.round(t / scale), -127, 127) * scale).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out), ref)
    assert float(state.scale) == float(scale)


# ----------------------------------------------------------------------------- clip
@pytest.mark.parametrize("g", [[3e19, 4e19, 0.0], [3e30, -4e30], [2e18] * 1000])
@pytest.mark.parametrize("max_norm", [1.0, 0.5])
def test_clip_by_norm_clips_huge_finite_adjoints_instead_of_zeroing(g, max_norm):
    # The float32 sum of squares overflowed to inf, the factor became 0 and
    # the adjoint was zeroed instead of clipped.
    g = jnp.asarray(g, jnp.float32)
    out, state = _apply(P.clip_by_norm(max_norm), g)
    ref = np.asarray(g, np.float64)
    norm = np.linalg.norm(ref)
    np.testing.assert_allclose(float(state.norm), norm, rtol=1e-5)
    assert bool(state.clipped)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref * (max_norm / norm), rtol=1e-5, atol=1e-12)


# ----------------------------------------------------------------------------- combinator arguments
@pytest.mark.parametrize("layers", [[4], [-5], [0, 7]])
def test_at_layers_out_of_range_raises_instead_of_wrapping(layers):
    # Indices were taken modulo L+1: boundary 4 of a 4-boundary stack ran at 0.
    stack = eae_jax.reconstruct(_block, passes=P.at_layers(P.decay(0.5), layers))
    params, x = _params(3, 4, jnp.float32), jnp.ones((2, 4))
    with pytest.raises(ValueError, match="out of range"):
        jax.grad(lambda p: jnp.sum(stack(p, x)))(params)


@pytest.mark.parametrize("layers", [0, "0", [0.5], [True]])
def test_at_layers_rejects_non_int_layers(layers):
    with pytest.raises(TypeError, match="at_layers"):
        P.at_layers(P.decay(0.5), layers)


@pytest.mark.parametrize("n", [1.5, "2", True])
def test_every_n_steps_rejects_non_int_n(n):
    with pytest.raises(TypeError, match="every_n_steps"):
        P.every_n_steps(P.decay(0.5), n)


# ----------------------------------------------------------------------------- reconstruct arguments
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


# ----------------------------------------------------------------------------- higher order
def _grad_of_grad(stack_fn, params, x):
    inner = lambda p, x: jax.grad(lambda x: jnp.sum(jnp.sin(stack_fn(p, x))))(x)
    return jax.grad(lambda p: jnp.sum(inner(p, x) ** 2))(params)


@pytest.mark.parametrize("kw", [{"boundaries_in_grads": False}, {"policy": "dots"}])
def test_grad_of_grad_matches_plain_autodiff(kw):
    with jax.enable_x64(True):
        params, x = _params(3, 4, jnp.float64), jax.random.normal(jax.random.key(1), (2, 4), jnp.float64)
        got = _grad_of_grad(eae_jax.reconstruct(_block, **kw), params, x)
        assert _max_err(got, _grad_of_grad(_plain, params, x)) < 1e-12


@pytest.mark.parametrize("kw, fix", [({}, "boundaries_in_grads=False"), ({"offload": True}, "offload=False")])
def test_grad_of_grad_through_byte_stored_boundaries_raises(kw, fix):
    # Boundaries kept as raw bytes in the gradient slots (the default) have
    # no derivative path: grad of grad silently returned wrong numbers.
    params, x = _params(3, 4, jnp.float32), jnp.ones((2, 4))
    with pytest.raises(ValueError, match=fix):
        _grad_of_grad(eae_jax.reconstruct(_block, **kw), params, x)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_clip_by_norm_low_precision_factor_does_not_underflow(dtype):
    # max_norm / norm = 1e-9 underflowed to 0 when cast to float16 first, so
    # the adjoint was zeroed instead of scaled to the bound.
    g = jnp.full((1000,), 3e4, dtype)
    max_norm = 1e-3
    out, state = _apply(P.clip_by_norm(max_norm), g)
    assert bool(state.clipped) and out.dtype == jnp.dtype(dtype)
    ref = np.asarray(g, np.float64) * (max_norm / np.linalg.norm(np.asarray(g, np.float64)))
    tol = {jnp.float16: 1e-3, jnp.bfloat16: 8e-3}[dtype]  # one rounding, plus fp16 subnormal spacing
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(out, np.float64)), max_norm, rtol=tol)


@pytest.mark.parametrize("g", [[3e19, -4e19, 0.0], [3e37] * 64, [1e20, 1.0, -2.0, 5e19]])
def test_statistics_of_huge_finite_adjoints_stay_finite(g):
    # The float32 sum of squares overflowed: a finite adjoint reported an
    # infinite norm and std.
    g = jnp.asarray(g, jnp.float32)
    _, state = _apply(P.statistics(), g)
    ref = np.asarray(g, np.float64)
    assert not bool(state.has_inf) and not bool(state.has_nan)
    np.testing.assert_allclose(float(state.norm), np.linalg.norm(ref), rtol=1e-5)
    np.testing.assert_allclose(float(state.std), np.std(ref), rtol=1e-5)
    np.testing.assert_allclose(float(state.mean), np.mean(ref), rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert float(state.max) == float(ref.max()) and float(state.min) == float(ref.min())


def test_statistics_of_nonfinite_adjoints_keep_their_flags():
    # The overflow path is for finite adjoints only: an inf stays reported as inf.
    _, state = _apply(P.statistics(), jnp.asarray([1.0, jnp.inf, 2.0], jnp.float32))
    assert bool(state.has_inf) and np.isinf(float(state.norm))


@pytest.mark.parametrize("key", [0, 7, np.int64(7), "typed", "raw"])
def test_init_takes_int_seeds_and_both_key_kinds(key):
    # An int seed used to fail deep inside jax.random.split with a message
    # about key_data attributes.
    stack = eae_jax.reconstruct(_block, passes=P.gaussian_noise(0.1))
    params, x = _params(3, 4, jnp.float32), jnp.ones((2, 4))
    as_key = {"typed": jax.random.key(7), "raw": jax.random.PRNGKey(7)}.get(key, key)
    carry = stack.init(params, x, key=as_key)
    ref = stack.init(params, x, key=jax.random.key(int(key) if not isinstance(key, str) else 7))
    for a, b in zip(jax.tree_util.tree_leaves(carry), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
            a.dtype, jax.dtypes.prng_key) else a), np.asarray(jax.random.key_data(b) if jax.dtypes.issubdtype(
                b.dtype, jax.dtypes.prng_key) else b))


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
    assert _max_err(g, ref) < 1e-5


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
    assert _max_err(g, ref) < 1e-5
