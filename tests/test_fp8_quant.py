"""fp8 arithmetic: scales, quantization, the fp8 GEMM forward and backward, and
that the graph really multiplies fp8 operands."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eae_jax import fp8
from eae_jax.fp8 import quant
from jaxpr_walk import all_eqns, ancestors, reads


def _rand(key, shape, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


def test_fp8_max_and_bad_format():
    assert fp8.fp8_max(jnp.float8_e4m3fn) == 448.0
    assert fp8.fp8_max(jnp.float8_e5m2) == 57344.0
    with pytest.raises(ValueError, match="not an fp8 format"):
        fp8.fp8_max(jnp.bfloat16)


def test_scale_from_amax():
    amax = jnp.array([448.0, 4.48, 0.0, jnp.nan, jnp.inf])
    s = np.asarray(fp8.scale_from_amax(amax))
    np.testing.assert_allclose(s[:2], [1.0, 0.01], rtol=1e-6)
    np.testing.assert_array_equal(s[2:], [1.0, 1.0, 1.0])  # nothing to scale / nothing trustworthy
    np.testing.assert_allclose(fp8.scale_from_amax(jnp.array(448.0), margin=1.0), 2.0)
    np.testing.assert_allclose(fp8.scale_from_amax(jnp.array(57344.0), jnp.float8_e5m2), 1.0)


@pytest.mark.parametrize("dtype,ml", [(jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn), (jnp.float8_e5m2, ml_dtypes.float8_e5m2)])
def test_quantize_matches_numpy_cast_and_saturates(dtype, ml):
    x = np.array([0.0, 1.0, -3.3, 1e-3, 500.0, -1e6, np.nan], np.float32)
    scale = np.float32(0.5)
    q = np.asarray(fp8.quantize(jnp.asarray(x), scale, dtype).astype(jnp.float32))
    fmax = float(ml_dtypes.finfo(ml).max)
    expect = np.clip(x / scale, -fmax, fmax).astype(ml).astype(np.float32)
    np.testing.assert_array_equal(q, expect)
    assert q[4] == (448.0 if fmax == 448.0 else 1024.0)  # 1000 saturates in e4m3, rounds to 1024 in e5m2
    assert q[5] == -fmax  # saturated, not NaN
    assert np.isnan(q[6])


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 2e-6), (jnp.bfloat16, 8e-3)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("weight_scaling", ["channel", "tensor"])
def test_fp8_linear_forward_matches_float64_reference(dtype, rtol, per_row, weight_scaling):
    x = _rand(0, (24, 48), 2.0, dtype)
    # output channels 15 binades apart: a per-tensor scale pushes the small
    # ones into e4m3's subnormals, a per-channel one does not
    w = (_rand(1, (40, 48), 0.1) * jnp.geomspace(1e-4, 3.0, 40)[:, None]).astype(dtype)
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else fp8.scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))))
    y = fp8.fp8_linear(x, w, xs, weight_scaling=weight_scaling)
    assert y.dtype == dtype and y.shape == (24, 40)
    ref = quant.reference_linear(x, w, xs, weight_scaling)
    col_max = np.abs(ref).max(axis=0, keepdims=True)  # tolerance per output channel
    other = quant.reference_linear(x, w, xs, {"channel": "tensor", "tensor": "channel"}[weight_scaling])
    assert (np.abs(other - ref) / col_max).max() > 10 * rtol  # the two scalings are distinguishable
    err = np.abs(np.asarray(y, np.float64) - ref) / col_max
    assert err.max() <= 2 * rtol, err.max()
    # and it is an fp8 approximation of the real product, not the product itself
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    err = np.linalg.norm(np.asarray(y, np.float64) - exact) / np.linalg.norm(exact)
    assert 1e-3 < err < 0.08


@pytest.mark.parametrize("rows", [(40,), (16, 24), (8, 16, 16)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("weight_scaling", ["channel", "tensor"])
def test_weight_blocks_are_their_concatenation_bit_for_bit(rows, per_row, weight_scaling):
    # Row blocks (gate and up; q, k and v) are quantized apart and joined as
    # fp8 bytes: forward, dx and the blocks' gradients equal those of the
    # concatenated weight exactly, as every scale involved is per row of the
    # weight (forward) or per column over all blocks (dgrad).
    x = _rand(0, (24, 48), 2.0, jnp.bfloat16)
    blocks = tuple(_rand(10 + i, (n, 48), 0.1 * (i + 1), jnp.bfloat16) for i, n in enumerate(rows))
    whole = jnp.concatenate(blocks, axis=0)
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.02)
    g = _rand(3, (24, sum(rows)), 1e-2, jnp.bfloat16)
    y_b, vjp_b = jax.vjp(lambda x_, ws: fp8.fp8_linear(x_, ws, xs, weight_scaling=weight_scaling), x, blocks)
    y_w, vjp_w = jax.vjp(lambda x_, w_: fp8.fp8_linear(x_, w_, xs, weight_scaling=weight_scaling), x, whole)
    np.testing.assert_array_equal(np.asarray(y_b, np.float32), np.asarray(y_w, np.float32))
    (dx_b, dws_b), (dx_w, dw_w) = vjp_b(g), vjp_w(g)
    np.testing.assert_array_equal(np.asarray(dx_b, np.float32), np.asarray(dx_w, np.float32))
    assert isinstance(dws_b, tuple) and [d.shape for d in dws_b] == [b.shape for b in blocks]
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(dws_b), np.float32), np.asarray(dw_w, np.float32))
    if weight_scaling == "tensor":
        return  # one scale spans the blocks: they are joined as the quantizing pass's operand
    # the high-precision concatenation is never built
    jaxpr = jax.make_jaxpr(lambda x_, ws: jax.vjp(lambda a, b: fp8.fp8_linear(a, b, xs), x_, ws)[1](g))(x, blocks)
    concats = _concatenations(jaxpr.jaxpr)
    assert (sum(rows), 48, "bfloat16") not in concats and (48, sum(rows), "bfloat16") not in concats
    if len(rows) > 1:  # the fp8 bytes are what is joined (forward and dgrad layouts)
        assert {(sum(rows), 48, "float8_e4m3fn"), (48, sum(rows), "float8_e4m3fn")} <= concats


def _concatenations(jaxpr):
    """``(*shape, dtype)`` of every concatenate in a jaxpr, nested ones included."""
    return {tuple(eqn.outvars[0].aval.shape) + (str(eqn.outvars[0].aval.dtype),)
            for eqn in all_eqns(jaxpr) if eqn.primitive.name == "concatenate"}


def test_weight_blocks_bad_inputs():
    x = _rand(0, (4, 8))
    with pytest.raises(ValueError, match="do not fit weight"):
        fp8.fp8_linear(x, (_rand(1, (3, 8)), _rand(2, (3, 9))), jnp.float32(1.0))
    with pytest.raises(ValueError, match="one dtype"):
        fp8.fp8_linear(x, (_rand(1, (3, 8)), _rand(2, (3, 8), dtype=jnp.bfloat16)), jnp.float32(1.0))
    with pytest.raises(ValueError, match="one or more"):
        fp8.fp8_linear(x, (), jnp.float32(1.0))


def _q64(x, scale, dtype=jnp.float8_e4m3fn):
    return np.asarray(fp8.quantize(x, scale, dtype).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_linear_backward_matches_reference_of_same_quantization(per_row):
    x = _rand(0, (32, 48), 1.5)
    w = _rand(1, (16, 48), 0.2)
    g = _rand(2, (32, 16), 1e-3)
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.01)
    _, vjp = jax.vjp(lambda x, w: fp8.fp8_linear(x, w, xs), x, w)
    dx, dw = vjp(g)
    # reference, float64 products of the same fp8 values: one e5m2 gradient
    # (per-tensor scale); dgrad against w^T quantized per input channel;
    # wgrad against the e4m3 activations, a per-row x scale folded into g.
    gmax = jnp.max(jnp.abs(g))
    s_g = fp8.scale_from_amax(gmax, jnp.float8_e5m2)
    gq = _q64(g, s_g, jnp.float8_e5m2)
    s_wt = fp8.scale_from_amax(quant.row_amax(w.T)[:, 0])
    wtq = _q64(w.T, s_wt[:, None])
    xq = _q64(x, xs)
    np.testing.assert_allclose(np.asarray(dx), (gq @ wtq.T) * float(s_g) * np.asarray(s_wt, np.float64)[None, :],
                               rtol=1e-5, atol=1e-9)
    if per_row:
        s2 = fp8.scale_from_amax(gmax * jnp.max(xs), jnp.float8_e5m2)
        ref_dw = (_q64(g * xs, s2, jnp.float8_e5m2).T @ xq) * float(s2)
    else:
        ref_dw = (gq.T @ xq) * float(s_g) * float(xs)
    np.testing.assert_allclose(np.asarray(dw), ref_dw, rtol=1e-5, atol=1e-9)
    # close to the true gradients (e5m2 has 2 mantissa bits)
    for got, exact in ((dx, np.asarray(g, np.float64) @ np.asarray(w, np.float64)),
                       (dw, np.asarray(g, np.float64).T @ np.asarray(x, np.float64))):
        got = np.asarray(got, np.float64)
        assert np.sum(exact * got) / np.linalg.norm(exact) / np.linalg.norm(got) > 0.99


@pytest.mark.parametrize("per_row", [False, True])
def test_per_tensor_weight_backward_reads_the_forward_fp8_weight(per_row):
    # dgrad multiplies the e5m2 gradient with the forward's e4m3 weight (one
    # scale), not with a requantization per input channel; wgrad as always.
    x = _rand(0, (32, 48), 1.5)
    w = _rand(1, (16, 48), 0.2) * jnp.linspace(0.1, 2.0, 48)[None, :]  # columns differ: the two dgrads differ
    g = _rand(2, (32, 16), 1e-3)
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.01)
    _, vjp = jax.vjp(lambda x, w: fp8.fp8_linear(x, w, xs, weight_scaling="tensor"), x, w)
    dx, dw = vjp(g)
    s_g = fp8.scale_from_amax(jnp.max(jnp.abs(g)), jnp.float8_e5m2)
    gq = _q64(g, s_g, jnp.float8_e5m2)
    s_w = fp8.scale_from_amax(jnp.max(jnp.abs(w)))
    ref_dx = (gq @ _q64(w, s_w)) * float(s_g) * float(s_w)
    np.testing.assert_allclose(np.asarray(dx), ref_dx, rtol=1e-5, atol=1e-9)
    _, vjp_c = jax.vjp(lambda x, w: fp8.fp8_linear(x, w, xs), x, w)
    dx_c, dw_c = vjp_c(g)
    assert np.abs(np.asarray(dx_c) - ref_dx).max() > 1e-3 * np.abs(ref_dx).max()
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_c))  # wgrad does not involve the weight
    exact = np.asarray(g, np.float64) @ np.asarray(w, np.float64)
    got = np.asarray(dx, np.float64)
    assert np.sum(exact * got) / np.linalg.norm(exact) / np.linalg.norm(got) > 0.99


def test_unknown_weight_scaling_is_refused():
    with pytest.raises(ValueError, match="unknown weight_scaling 'row'.*channel.*tensor"):
        fp8.fp8_linear(_rand(0, (4, 8)), _rand(1, (3, 8)), jnp.float32(1.0), weight_scaling="row")
    with pytest.raises(ValueError, match="unknown weight_scaling"):
        fp8.SeamConfig(weight_scaling="per-row")


def test_frozen_weight_backward_folds_its_channel_scale_into_the_gradient():
    x = _rand(0, (32, 48), 1.5)
    w = _rand(1, (16, 48), 0.2)
    g = _rand(2, (32, 16), 1e-3)
    xs = jnp.float32(0.01)
    frozen = fp8.quantize_weight(w)
    dx = jax.vjp(lambda x: fp8.fp8_linear(x, frozen, xs), x)[1](g)[0]
    ws = frozen.scale
    s1 = fp8.scale_from_amax(jnp.max(jnp.abs(g)) * jnp.max(ws), jnp.float8_e5m2)
    g1 = _q64(g * ws[None, :], s1, jnp.float8_e5m2)
    wq = np.asarray(frozen.q.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(dx), (g1 @ wq) * float(s1), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("per_row,frozen", [(False, False), (True, False), (False, True)])
def test_delayed_grad_scale_equal_to_current_gives_identical_gradients(per_row, frozen):
    """Delayed scaling with the scale current scaling would derive computes
    exactly what current scaling computes; the scale handle's cotangent is
    the observed gradient amax, with or without delayed scaling."""
    x = _rand(0, (32, 48), 1.5)
    w = _rand(1, (16, 48), 0.2)
    g = _rand(2, (32, 16), 1e-3)
    xs = fp8.scale_from_amax(quant.row_amax(x)) if per_row else jnp.float32(0.01)
    wt = fp8.quantize_weight(w) if frozen else w
    gmax = jnp.max(jnp.abs(g))
    current = jax.vjp(lambda x_, w_: fp8.fp8_linear(x_, wt if frozen else w_, xs), x, w)[1](g)
    for delayed in (False, True):
        gs = fp8.scale_from_amax(gmax, jnp.float8_e5m2)

        def f(x_, w_, s_):
            return fp8.fp8_linear(x_, wt if frozen else w_, xs, grad_scale=s_, delayed_grad=delayed)

        dx, dw, ds = jax.vjp(f, x, w, gs)[1](g)
        if per_row or frozen:
            # A folded gradient's scale is (gmax / 57344) * max(fold) here and
            # gmax * max(fold) / 57344 under current scaling: equal up to
            # float32 rounding, which may move an element across an e5m2
            # rounding boundary.
            def check(a, b):
                assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)
        else:
            check = np.testing.assert_array_equal
        check(np.asarray(dx), np.asarray(current[0]))
        if not frozen:
            check(np.asarray(dw), np.asarray(current[1]))
        np.testing.assert_allclose(float(ds), float(gmax), rtol=1e-7)


def test_delayed_grad_scale_is_used_and_saturates_beyond_its_range():
    x = _rand(0, (32, 48), 1.5)
    w = _rand(1, (16, 48), 0.2)
    g = _rand(2, (32, 16), 1e-3)
    xs = jnp.float32(0.01)
    gmax = float(jnp.max(jnp.abs(g)))
    small = jnp.float32(gmax / 4 / 57344.0)  # the range ends at a quarter of the gradient's amax
    dx = jax.vjp(lambda x_: fp8.fp8_linear(x_, w, xs, grad_scale=small, delayed_grad=True), x)[1](g)[0]
    gq = _q64(jnp.clip(g, -gmax / 4, gmax / 4), small, jnp.float8_e5m2)
    s_wt = fp8.scale_from_amax(quant.row_amax(w.T)[:, 0])
    wtq = _q64(w.T, s_wt[:, None])
    np.testing.assert_allclose(np.asarray(dx), (gq @ wtq.T) * float(small) * np.asarray(s_wt, np.float64)[None, :],
                               rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="delayed_grad needs a grad_scale"):
        fp8.fp8_linear(x, w, xs, delayed_grad=True)
    with pytest.raises(ValueError, match="grad_scale must be a float32 scalar"):
        fp8.fp8_linear(x, w, xs, grad_scale=jnp.ones((2,)), delayed_grad=True)


@pytest.mark.parametrize("delayed", [False, True])
def test_delayed_gradient_quantization_does_not_wait_for_the_gradient_amax(delayed):
    """What delayed scaling buys: the e5m2 quantization of the gradient does
    not depend on a reduction over that gradient (XLA can then quantize in
    the gradient's producer and observe the amax in the same pass); under
    current scaling it does."""
    x, w, g = _rand(0, (16, 32)), _rand(1, (8, 32), 0.1), _rand(2, (16, 8))

    def bwd(x_, w_, g_):
        f = lambda a, b: fp8.fp8_linear(a, b, jnp.float32(0.01), grad_scale=jnp.float32(1e-4), delayed_grad=delayed)
        return jax.vjp(f, x_, w_)[1](g_)

    jaxpr = jax.make_jaxpr(bwd)(x, w, g).jaxpr
    g_var = jaxpr.invars[2]
    e5m2 = [v for e in jaxpr.eqns for v in e.outvars if v.aval.dtype == jnp.float8_e5m2]
    assert e5m2, "no e5m2 gradient in the backward"
    for v in e5m2:
        seen = ancestors(jaxpr, v)
        waits = [e for e in seen if e.primitive.name == "reduce_max" and reads(jaxpr, e, g_var)]
        assert bool(waits) == (not delayed), [e.primitive.name for e in seen]


@pytest.mark.parametrize("fast_accum,n_highest", [((True, True), 0), ((True, False), 2), ((False, False), 3)])
def test_fast_accum_flags_set_the_dot_precision(fast_accum, n_highest):
    """The flags reach the lowered dots: fast -> default precision, else HIGHEST
    (on GPU that toggles cuBLASLt's fp8 fast accumulation)."""
    x = _rand(0, (8, 32), 1.0, jnp.bfloat16)
    w = _rand(1, (16, 32), 0.3, jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(fp8.fp8_linear(x, w, jnp.float32(0.01), fast_accum).astype(jnp.float32))

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = [ln for ln in text.splitlines() if "dot_general" in ln and "f8E" in ln]
    assert len(dots) == 3
    assert sum("HIGHEST" in ln for ln in dots) == n_highest


def test_scale_gets_zero_cotangent_and_frozen_equals_live():
    x = _rand(0, (8, 32), 1.0, jnp.bfloat16)
    w = _rand(1, (16, 32), 0.3, jnp.bfloat16)
    xs = jnp.float32(0.01)
    g_scale = jax.grad(lambda s: jnp.sum(fp8.fp8_linear(x, w, s).astype(jnp.float32)))(xs)
    assert float(g_scale) == 0.0
    frozen = fp8.quantize_weight(w)
    np.testing.assert_array_equal(np.asarray(fp8.fp8_linear(x, frozen, xs)), np.asarray(fp8.fp8_linear(x, w, xs)))


def test_fp8_linear_rejects_bad_shapes():
    with pytest.raises(ValueError, match="do not fit weight"):
        fp8.fp8_linear(jnp.ones((4, 8)), jnp.ones((3, 9)), 1.0)
    with pytest.raises(ValueError, match="2-D activations"):
        fp8.fp8_linear(jnp.ones((2, 4, 8)), jnp.ones((3, 8)), 1.0)
    with pytest.raises(ValueError, match="x_scale"):
        fp8.fp8_linear(jnp.ones((4, 8)), jnp.ones((3, 8)), jnp.ones((3,)))
    with pytest.raises(ValueError, match="fp8 operands"):
        fp8.fp8_matmul(jnp.ones((4, 8)), jnp.ones((3, 8)), jnp.float32)


def _dot_operand_types(text):
    """(lhs, rhs) element types of every stablehlo.dot_general in lowered text."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            types = re.findall(r"tensor<[0-9x]*x?([a-zA-Z0-9]+)>", line.split(":")[-1])
            out.append(tuple(types[:2]))
    return out


def test_output_scale_is_bf16_exact_and_never_shrinks_the_range():
    rng = np.random.default_rng(0)
    xs = np.exp(rng.uniform(-12, 4, 400)).astype(np.float32)
    ws = np.exp(rng.uniform(-14, 2, 400)).astype(np.float32)
    xs[:3], ws[:3] = [2.0 ** -5, 0.25, 1.0], [2.0 ** -9, 3.0, 0.0078125]  # already exact products
    for x_s, w_s in zip(xs, ws):
        c, xq_s = (np.float64(v) for v in quant.output_scale(jnp.float32(x_s), jnp.float32(w_s), jnp.bfloat16))
        exact = np.float64(np.float32(x_s) * np.float32(w_s))
        assert np.float32(c) == np.float32(ml_dtypes.bfloat16(c)), (x_s, w_s, c)  # bf16-representable
        assert exact <= c <= exact * (1 + 2.0 ** -7), (x_s, w_s, c)
        assert x_s <= xq_s <= x_s * (1 + 2.0 ** -7)
        np.testing.assert_allclose(xq_s * w_s, c, rtol=1e-6)
        if c == exact:
            assert xq_s == x_s  # nothing to adjust: the same quantization as before
    # per-row / per-channel scales and non-bf16 outputs are left alone
    rows = jnp.full((4, 1), 0.3, jnp.float32)
    c, used = quant.output_scale(rows, jnp.float32(0.7), jnp.bfloat16)
    assert used is rows or np.array_equal(used, rows)
    np.testing.assert_allclose(c, rows * np.float32(0.7))
    c, used = quant.output_scale(jnp.float32(0.3), jnp.float32(0.7), jnp.float32)
    assert float(used) == np.float32(0.3) and float(c) == float(jnp.float32(0.3) * jnp.float32(0.7))


@pytest.mark.parametrize("weight_scaling,bf16_scaled", [("tensor", True), ("delayed", True), ("channel", False)])
def test_per_tensor_gemm_output_is_scaled_in_bf16(weight_scaling, bf16_scaled):
    """With per-tensor scales the fp8 GEMM's bf16 output is multiplied by a
    bf16 scalar directly (the form XLA folds into cuBLASLt's fp8 GEMM);
    per-channel weight scales need the float32 multiply after it."""
    x = _rand(0, (16, 32), 1.0, jnp.bfloat16)
    w = _rand(1, (24, 32), 0.1, jnp.float32)
    kw = {"weight_scale": jnp.float32(0.1 / 448)} if weight_scaling == "delayed" else {}
    jaxpr = jax.make_jaxpr(lambda x: fp8.fp8_linear(x, w, jnp.float32(0.01), weight_scaling=weight_scaling, **kw))(x)
    eqns = list(all_eqns(jaxpr.jaxpr))
    dot = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dot) == 1
    out = dot[0].outvars[0]
    users = [e for e in eqns if any(v is out for v in e.invars)]
    assert len(users) == 1
    if bf16_scaled:
        assert users[0].primitive.name == "mul" and users[0].outvars[0].aval.dtype == jnp.bfloat16, users[0]
    else:
        assert users[0].primitive.name == "convert_element_type", users[0]


@pytest.mark.parametrize("weight_dtype,per_row,user", [
    (jnp.bfloat16, False, ("mul", jnp.bfloat16)),
    (jnp.float32, False, ("mul", jnp.float32)),  # a float32 GEMM output, multiplied in float32
    (jnp.bfloat16, True, ("convert_element_type", jnp.float32)),  # the folded per-row scale is not bf16-exact
])
@pytest.mark.parametrize("weight_scaling", ["channel", "delayed"])
def test_wgrad_output_is_scaled_in_bf16(weight_scaling, weight_dtype, per_row, user):
    """With a per-tensor activation scale each wgrad GEMM's bf16 output is
    multiplied by a bf16 scalar (the gradient scale nudged so that its
    product with the activation scale is exact), the form XLA folds into the
    GEMM; float32 weights, and per-row activation scales, keep the float32
    multiply. One GEMM per block."""
    x = _rand(0, (16, 32), 1.0, jnp.bfloat16)
    x_scale = jnp.linspace(0.005, 0.02, 16, dtype=jnp.float32)[:, None] if per_row else jnp.float32(0.01)
    blocks = (_rand(1, (24, 32), 0.1, weight_dtype), _rand(2, (8, 32), 0.1, weight_dtype))
    kw = {"weight_scale": jnp.float32(0.1 / 448)} if weight_scaling == "delayed" else {}

    def loss(ws):
        y = fp8.fp8_linear(x, ws, x_scale, grad_scale=jnp.float32(1e-4), delayed_grad=True,
                           weight_scaling=weight_scaling, **kw)
        return jnp.sum(y.astype(jnp.float32))
    grads = jax.grad(loss)(blocks)
    assert [g.shape for g in grads] == [(24, 32), (8, 32)]
    eqns = list(all_eqns(jax.make_jaxpr(jax.grad(loss))(blocks).jaxpr))
    wgrads = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape in ((24, 32), (8, 32))]
    assert len(wgrads) == 2, [e.outvars[0].aval for e in wgrads]
    for e in wgrads:
        users = [u for u in eqns if any(v is e.outvars[0] for v in u.invars)]
        assert len(users) == 1
        assert (users[0].primitive.name, users[0].outvars[0].aval.dtype) == user, users[0]


@pytest.mark.parametrize("weight_scaling", ["channel", "tensor", "delayed"])
def test_graph_multiplies_fp8_operands_forward_and_backward(weight_scaling):
    """The seam's jaxpr/StableHLO has dot_generals whose operands ARE fp8 (not
    quantize -> dequantize -> bf16 dots), forward and backward."""
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16),
                               __import__("eae_jax").blocks.init_swiglu(jax.random.key(0), 64, 128))
    x = _rand(1, (32, 64), 1.0, jnp.bfloat16)
    seam = fp8.ffn_seam(check_values=False, weight_scaling=weight_scaling)
    state = fp8.init_state(seam, [0.01, 0.01], p)

    def loss(p, x):
        return jnp.sum(fp8.apply(seam, state, p, x).astype(jnp.float32) * 0.5)  # no dot in the loss

    fwd = _dot_operand_types(jax.jit(lambda p, x: fp8.apply(seam, state, p, x)).lower(p, x).as_text())
    assert fwd == [("f8E4M3FN", "f8E4M3FN")] * 2, fwd
    both = _dot_operand_types(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(p, x).as_text())
    # backward: dgrad of down and of gate|up, wgrad of down, and one wgrad
    # per block of gate|up (each lands in its block's own buffer)
    assert len(both) == 7, both
    assert sorted(both) == sorted([("f8E4M3FN", "f8E4M3FN")] * 2 + [("f8E5M2", "f8E4M3FN")] * 5), both
    # the jaxpr agrees: every dot_general has float8 inputs
    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(p, x))
    dot_lines = [l for l in jaxpr.splitlines() if "dot_general" in l and "=" in l]
    assert dot_lines
    for eqn in re.findall(r"dot_general\[[^\]]*\] (\w+) (\w+)", jaxpr):
        for var in eqn:
            decl = re.search(rf"\b{var}:([a-z0-9_]+)\[", jaxpr)
            assert decl and decl.group(1).startswith("f8"), (var, decl and decl.group(1))


def test_guarded_seam_has_fp8_dots_and_only_fallback_dots_in_high_precision():
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16),
                               __import__("eae_jax").blocks.init_swiglu(jax.random.key(0), 64, 128))
    x = _rand(1, (32, 64), 1.0, jnp.bfloat16)
    seam = fp8.ffn_seam()
    state = fp8.init_state(seam, [0.01, 0.01])
    types = _dot_operand_types(jax.jit(lambda p, x: fp8.apply(seam, state, p, x)).lower(p, x).as_text())
    assert types.count(("f8E4M3FN", "f8E4M3FN")) == 2
    assert types.count(("bf16", "bf16")) == 3  # the fallback branch: swiglu's three GEMMs
    assert len(types) == 5


def _has_gpu():
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU (fp8 GEMMs need compute capability >= 8.9)")
@pytest.mark.parametrize("weight_scaling", ["channel", "delayed"])
def test_compiled_hlo_has_cublaslt_fp8_gemm(weight_scaling):
    dev = jax.devices("gpu")[0]
    cc = float(getattr(dev, "compute_capability", "0") or 0)
    if cc < 8.9:
        pytest.skip(f"GPU compute capability {cc} has no fp8 GEMMs")
    # The 1B-like FFN shape: at small shapes XLA may keep a GEMM in bf16.
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16),
                               __import__("eae_jax").blocks.init_swiglu(jax.random.key(0), 2048, 5632))
    x = _rand(1, (8192, 2048), 1.0, jnp.bfloat16)
    seam = fp8.ffn_seam(weight_scaling=weight_scaling)
    state = fp8.init_state(seam, [0.01, 0.01], p)

    def loss(p, x):
        return jnp.sum(fp8.apply(seam, state, p, x).astype(jnp.float32) * 0.5)

    fwd = jax.jit(lambda p, x: fp8.apply(seam, state, p, x)).lower(p, x).compile().as_text()
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(p, x).compile().as_text()
    assert fwd.count("__cublas$lt$matmul$f8") >= 2, "forward fp8 GEMMs missing from the compiled HLO"
    print("fp8 GEMMs forward:", fwd.count("__cublas$lt$matmul$f8"), "forward+backward:",
          both.count("__cublas$lt$matmul$f8"))
    assert both.count("__cublas$lt$matmul$f8") >= 6, "forward+backward fp8 GEMMs missing from the compiled HLO"
