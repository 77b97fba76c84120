"""Built-in adjoint passes: numerics against numpy/ml_dtypes references, state threading
through a jitted train step, chain/at_layers/optax composition, error paths."""

import inspect
import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import eae_jax
from eae_jax import passes as P
from eae_jax.passes.base import PassContext
from conftest import needs_gpu

D, DEPTH = 8, 3
NUM_B = DEPTH + 1  # boundaries x0..xL


def _ctx(boundary=0, num=4):
    return PassContext(jnp.int32(boundary), jnp.int32(boundary), jnp.int32(0), num)


def _init(pass_, g, key=0):
    return pass_.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(key))


_UPDATE_CACHE = {}


def _call(pass_, g, state):
    """One jitted ``pass_.update`` at boundary 0 (compiled once per pass)."""
    if pass_ not in _UPDATE_CACHE:
        _UPDATE_CACHE[pass_] = jax.jit(lambda a, s: pass_.update(a, s, _ctx()))
    return _UPDATE_CACHE[pass_](jnp.asarray(g), state)


def _bits(x):
    """Bit pattern of an array (compare states without float semantics: XLA CPU flushes
    subnormals in float compares, and int/key carry leaves are bit-cast floats)."""
    x = np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _trees_bitequal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(la, lb))


# ----------------------------------------------------------------------------- fp8
FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def _fp8_ref(g, scale, fmt):
    """numpy/ml_dtypes quantize-dequantize with a given float32 (dequantization) scale."""
    dtype, fmax = FP8[fmt]
    scale = np.float32(scale)
    q = np.clip(g.astype(np.float32) * (np.float32(1.0) / scale), -fmax, fmax).astype(dtype).astype(np.float32)
    return q * scale


def _amax_scale(amax, fmt, margin=0):
    return np.float32(amax) * np.float32(2.0**margin / FP8[fmt][1])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,scale", [((5,), 1.0), ((2, 8, 16), 1e-4), ((3, 33), 300.0)])
@pytest.mark.parametrize("margin", [0, 2])
def test_fp8_current_scaling_matches_ml_dtypes(fmt, shape, scale, margin):
    g = (np.random.default_rng(0).standard_normal(shape) * scale).astype(np.float32)
    p = P.fp8_quant(fmt, "current", margin=margin)
    out, state = _call(p, g, _init(p, g))
    out = np.asarray(out)
    amax = np.float32(np.max(np.abs(g)))
    s = _amax_scale(amax, fmt, margin)
    assert float(state.scale) == s and float(state.amax_history[0]) == amax
    np.testing.assert_array_equal(out, _fp8_ref(g, s, fmt))
    assert not np.array_equal(out, g)  # the fp8 rounding really happened
    # every output is an fp8 grid value times the scale
    grid = (out / s).astype(FP8[fmt][0]).astype(np.float32)
    np.testing.assert_allclose(out / s, grid, rtol=1e-6)
    assert len(np.unique(np.abs(grid))) <= 256


def test_fp8_e4m3_coarser_than_e5m2_range_and_finer_mantissa():
    g = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    errs = {}
    for fmt in ("e4m3", "e5m2"):
        p = P.fp8_quant(fmt)
        out, _ = _call(p, g, _init(p, g))
        errs[fmt] = float(np.linalg.norm(np.asarray(out) - g) / np.linalg.norm(g))
    # 3 mantissa bits vs 2: relative error about 2**-4 vs 2**-3 (round to nearest)
    assert 0.005 < errs["e4m3"] < 0.04 < errs["e5m2"] < 0.08, errs


def test_fp8_bf16_adjoint_keeps_dtype():
    g = jnp.asarray(np.random.default_rng(2).standard_normal((4, 16)), jnp.bfloat16)
    p = P.fp8_quant("e4m3")
    out, state = _call(p, g, _init(p, g))
    assert out.dtype == jnp.bfloat16
    ref = _fp8_ref(np.asarray(g.astype(jnp.float32)), float(state.scale), "e4m3")
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), ref.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_fp8_zero_adjoint_stays_zero_with_unit_scale():
    g = np.zeros((3, 4), np.float32)
    for scaling in ("current", "delayed"):
        p = P.fp8_quant("e4m3", scaling)
        out, state = _call(p, g, _init(p, g))
        np.testing.assert_array_equal(np.asarray(out), g)
        assert float(state.scale) == 1.0


@pytest.mark.parametrize("hist_len,margin", [(3, 0), (1, 1)])
def test_fp8_delayed_scaling_follows_numpy_reference(hist_len, margin):
    """Delayed scaling: scale from the max of the previous calls' amaxes, history rolled;
    a history of one (the smallest allowed) and a margin too. Once the history holds no
    amax (a zero adjoint after it expired) the state keeps the scale the call used."""
    fmt = "e4m3"
    p = P.fp8_quant(fmt, "delayed", history_len=hist_len, margin=margin)
    rng = np.random.default_rng(3)
    mags = [1.0, 0.01, 5.0, 0.2, 0.2, 0.2, 0.2, 0.0]  # a jump (saturates), a fall (history expires), zero
    g0 = np.zeros((4, 8), np.float32)
    state = _init(p, g0)
    np.testing.assert_array_equal(np.asarray(state.amax_history), np.zeros(hist_len))
    history = np.zeros(hist_len, np.float32)
    update = jax.jit(lambda a, s: p.update(a, s, _ctx()))
    saturated = False
    for mag in mags:
        g = (rng.standard_normal((4, 8)) * mag).astype(np.float32)
        amax = np.float32(np.abs(g).max())
        used = _amax_scale(history.max() if history.max() > 0 else amax, fmt, margin)
        ref = _fp8_ref(g, used, fmt)
        history = np.roll(history, 1)
        history[0] = amax
        out, state = update(jnp.asarray(g), state)
        np.testing.assert_array_equal(np.asarray(out), ref)
        np.testing.assert_array_equal(np.asarray(state.amax_history), history)
        assert float(state.scale) == (_amax_scale(history.max(), fmt, margin) if history.max() > 0 else used)
        saturated |= bool(np.any(np.abs(g / used) > 448.0))
        if np.any(np.abs(g / used) > 448.0):  # clipped to the fp8 range, not NaN
            assert np.all(np.isfinite(np.asarray(out)))
            np.testing.assert_allclose(np.abs(np.asarray(out)).max(), 448.0 * used, rtol=1e-6)
    assert saturated


def test_fp8_current_scaling_takes_each_calls_own_amax():
    """Current scaling keeps no memory: a small adjoint after a large one is scaled by its
    own amax (delayed scaling would use the large one), and a non-finite amax is recorded."""
    p = P.fp8_quant("e4m3", "current")
    rng = np.random.default_rng(5)
    state = _init(p, np.zeros(16, np.float32))
    for mag in (5.0, 0.01):
        g = (rng.standard_normal(16) * mag).astype(np.float32)
        out, state = _call(p, g, state)
        s = _amax_scale(np.abs(g).max(), "e4m3")
        np.testing.assert_array_equal(np.asarray(out), _fp8_ref(g, s, "e4m3"))
        assert float(state.scale) == s and np.asarray(state.amax_history).tolist() == [np.abs(g).max()]
    g[0] = np.inf
    _, state = _call(p, g, state)
    assert float(state.scale) == 1.0 and np.asarray(state.amax_history).tolist() == [np.inf]


def test_fp8_delayed_ignores_nonfinite_amax():
    p = P.fp8_quant("e5m2", "delayed", history_len=2)
    g = np.ones((4,), np.float32)
    state = _init(p, g)
    _, state = _call(p, g, state)
    bad = g.copy()
    bad[0] = np.inf
    out, state = _call(p, bad, state)
    assert np.asarray(state.amax_history).tolist() == [0.0, 1.0]  # inf recorded as 0
    assert float(state.scale) == _amax_scale(1.0, "e5m2")
    assert np.isfinite(np.asarray(out)[1:]).all()


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(format="e3m4"), ValueError, "fp8 format must be one of ['e4m3', 'e5m2'], got 'e3m4'"),
    (dict(scaling="late"), ValueError, "fp8_quant: scaling must be one of ['current', 'delayed'], got 'late'"),
    (dict(history_len=0), ValueError, "fp8_quant: history_len must be >= 1, got 0"),
    (dict(margin=-1), ValueError, "fp8_quant: margin must be >= 0, got -1"),
    (dict(history_len=2.5), TypeError, "fp8_quant: history_len must be a Python int, got 2.5"),
    (dict(margin=True), TypeError, "fp8_quant: margin must be a Python int, got True"),
])
def test_fp8_bad_arguments(kwargs, err, msg):
    with pytest.raises(err) as info:  # the whole message: the pass, the argument and the bound
        P.fp8_quant(**kwargs)
    assert str(info.value) == msg


# ----------------------------------------------------------------------------- cast round trip
@pytest.mark.parametrize("name,np_dtype", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16),
                                           ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_cast_roundtrip_matches_numpy_cast(name, np_dtype):
    g = (np.random.default_rng(4).standard_normal((6, 20)) * 3).astype(np.float32)
    p = P.cast_roundtrip(name)
    out = np.asarray(_call(p, g, _init(p, g))[0])
    np.testing.assert_array_equal(out, g.astype(np_dtype).astype(np.float32))
    assert not np.array_equal(out, g)


@pytest.mark.parametrize("name,adjoint_dtype,narrow", [("fp16", ml_dtypes.bfloat16, np.float16),
                                                       ("bf16", np.float16, ml_dtypes.bfloat16)])
def test_cast_roundtrip_keeps_a_low_precision_adjoints_dtype(name, adjoint_dtype, narrow):
    """The round trip goes back to the adjoint's own dtype, not to float32; the name
    says the narrow format (what ``--passes`` and the events print)."""
    g = np.array([1e-9, 1.0 + 2**-9, 1.0 + 2**-7, -3.0, 6e4], np.float32).astype(adjoint_dtype)
    p = P.cast_roundtrip(name)
    out = _call(p, g, _init(p, g))[0]
    assert out.dtype == jnp.dtype(adjoint_dtype) and p.name == f"cast_roundtrip({name})"
    np.testing.assert_array_equal(np.asarray(out).astype(np.float32), g.astype(narrow).astype(adjoint_dtype).astype(np.float32))
    assert not np.array_equal(np.asarray(out).astype(np.float32), g.astype(np.float32))


def test_cast_roundtrip_bad_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        P.cast_roundtrip("fp12")
    with pytest.raises(ValueError, match="not a floating"):
        P.cast_roundtrip(jnp.int8)


# ----------------------------------------------------------------------------- topk, guard
def test_topk_error_feedback_carries_the_residual():
    p = P.topk_compress(0.75)
    rng = np.random.default_rng(5)
    g_shape = (4, 6)
    state = _init(p, np.zeros(g_shape, np.float32))
    residual = np.zeros(g_shape, np.float32)
    k = P.topk.num_kept(math.prod(g_shape), 0.75)
    assert k == 6
    total_in, total_out = np.zeros(g_shape), np.zeros(g_shape)
    for _ in range(4):
        g = rng.standard_normal(g_shape).astype(np.float32)
        acc = g + residual
        thresh = np.sort(np.abs(acc).ravel())[-k]
        ref = np.where(np.abs(acc) >= thresh, acc, 0).astype(np.float32)
        out, state = _call(p, g, state)
        np.testing.assert_array_equal(np.asarray(out), ref)
        residual = acc - ref
        np.testing.assert_array_equal(np.asarray(state.residual), residual)
        assert int(state.kept) == k
        total_in += g
        total_out += np.asarray(out)
    # nothing is lost: what went out plus what is still pending equals what came in
    np.testing.assert_allclose(total_out + residual, total_in, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("numel,ratio,k", [(0, 0.5, 0), (0, 0.0, 0), (1, 0.9, 1), (1, 0.0, 1), (10, 0.75, 2),
                                         (10, 0.99, 1), (7, 0.0, 7)])
def test_topk_num_kept_is_max_1_int_numel_times_1_minus_ratio(numel, ratio, k):
    """k = max(1, int(numel * (1 - ratio))), and 0 only for an empty adjoint."""
    assert P.topk.num_kept(numel, ratio) == k
    if numel:  # the pass keeps that many (no ties here)
        g = np.arange(1, numel + 1, dtype=np.float32)
        p = P.topk_compress(ratio, error_feedback=False)
        out, state = _call(p, g, _init(p, g))
        assert int(state.kept) == k
        np.testing.assert_array_equal(np.asarray(out), np.where(g > numel - k, g, 0))


@pytest.mark.parametrize("ratio,err", [(1.0, ValueError), (-0.1, ValueError), ("half", TypeError)])
def test_topk_bad_ratio(ratio, err):
    with pytest.raises(err, match="ratio"):
        P.topk_compress(ratio)


@pytest.mark.parametrize("kwargs,err,message", [
    (dict(ratio=1.0), ValueError, "ratio must be < 1.0, got 1.0"),
    (dict(ratio=-0.1), ValueError, "ratio must be >= 0.0, got -0.1"),
    (dict(ratio=0.5, error_feedback=1), TypeError, "error_feedback must be a bool, got 1"),
])
def test_topk_bad_arguments_are_named_in_full(kwargs, err, message):
    with pytest.raises(err) as info:
        P.topk_compress(**kwargs)
    assert str(info.value) == f"topk_compress: {message}"


def _with_nonfinite():
    g = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    g[0, 1], g[2, 3] = np.nan, -np.inf
    return g


def test_nonfinite_guard_zero_and_skip():
    g = _with_nonfinite()
    p = P.nonfinite_guard("zero")
    out, state = _call(p, g, _init(p, g))
    np.testing.assert_array_equal(np.asarray(out), np.where(np.isfinite(g), g, 0))
    assert int(state.count) == 1 and int(state.last_bad) == 2
    out, state = _call(p, np.ones_like(g), state)
    assert int(state.count) == 1 and int(state.last_bad) == 0
    p = P.nonfinite_guard("skip")
    out, state = _call(p, g, _init(p, g))
    np.testing.assert_array_equal(np.asarray(out), np.zeros_like(g))
    out, _ = _call(p, np.ones_like(g), state)
    np.testing.assert_array_equal(np.asarray(out), np.ones_like(g))


def test_nonfinite_guard_raise_names_the_boundary():
    p = P.nonfinite_guard("raise")
    g = _with_nonfinite()
    ok, state = jax.jit(lambda a, s: p.update(a, s, _ctx(2)))(jnp.ones_like(g), _init(p, g))
    jax.block_until_ready(ok)
    with pytest.raises(Exception, match="boundary 2 has 2 non-finite"):
        out, _ = jax.jit(lambda a, s: p.update(a, s, _ctx(2)))(jnp.asarray(g), state)
        jax.block_until_ready(out)
    with pytest.raises(ValueError, match="policy"):
        P.nonfinite_guard("ignore")


# ----------------------------------------------------------------------------- a small model
def _block(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])


def _problem(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = {"w": jax.random.normal(k[0], (DEPTH, D, D)) * 0.6, "b": jax.random.normal(k[1], (DEPTH, D)) * 0.1}
    x = jax.random.normal(k[2], (2, 4, D))
    y = jax.random.normal(k[3], (2, 4, D))
    return params, x, y


def _loss(out, y):
    return jnp.mean((out - y) ** 2)


def _hook(fn, i):
    """Identity forward; backward applies ``fn(g, i)`` (a pass at boundary i)."""

    @jax.custom_vjp
    def h(x):
        return x

    h.defvjp(lambda x: (x, None), lambda _, g: (fn(g, i),))
    return h


def reference_adjoints(params, x, y, fn=None):
    """See `_reference`; jitted once per ``fn``."""
    if fn not in _REF_CACHE:
        _REF_CACHE[fn] = jax.jit(lambda p, x, y: _reference(p, x, y, fn))
    gp, geps = _REF_CACHE[fn](params, x, y)
    return gp, [np.asarray(g) for g in geps]


_REF_CACHE = {}


def _reference(params, x, y, fn=None):
    """Independent plain-jax reference: param grads and the adjoint at every boundary.

    ``fn(g, i)``, if given, is applied to the adjoint at boundary i in the
    backward (the seed semantics: on the output gradient and after every
    block's VJP). Returns (param grads, [adjoint reaching boundary i before
    the pass, for i in 0..L]).
    """
    def f(params, eps):
        h = x
        for i in range(DEPTH):
            if fn is not None:
                h = _hook(fn, i)(h)
            h = h + eps[i]
            h = _block(jax.tree_util.tree_map(lambda a: a[i], params), h)
        if fn is not None:
            h = _hook(fn, DEPTH)(h)
        h = h + eps[DEPTH]
        return _loss(h, y)

    eps = [jnp.zeros_like(x) for _ in range(NUM_B)]
    return jax.grad(f, argnums=(0, 1))(params, eps)


def _per_boundary(state):
    """Single-Scan stack: the state of boundaries 0..L as a list."""
    state = jax.device_get(state)  # slice on the host: cheaper than eager device ops
    seg = state["segments"][0]
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], seg) for i in range(DEPTH)] + [state["top"]]


def _trainer(passes, lr=0.1):
    """A jitted SGD step through `reconstruct` with the pass state threaded in the carry."""
    stack = eae_jax.reconstruct(_block, passes=passes)

    @jax.jit
    def step(params, carry, x, y):
        loss, (gp, gc) = jax.value_and_grad(lambda p, c: _loss(stack(p, x, c), y), argnums=(0, 1))(params, carry)
        carry, stats = stack.update(carry, gc)
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, gp)
        return params, carry, stats, loss, gp

    return stack, step


def _train(passes, steps=5, lr=0.1, key=0, ys=None, trainer=None):
    params, x, y = _problem()
    stack, step = trainer or _trainer(passes, lr)
    carry = jax.jit(stack.init)(params, x, jax.random.key(key))  # jitted: eager init dispatches op by op
    hist = []
    for t in range(steps):
        yt = y if ys is None else ys[t]
        new_params, carry, stats, loss, gp = step(params, carry, x, yt)
        assert int(stats["step"]) == t and float(stats["calls"]) == 1.0
        hist.append(dict(params=params, y=yt, x=x, stats=stats, grads=gp, loss=float(loss),
                         states=_per_boundary(stack.state(carry))))
        params = new_params
    return hist


def _int8_np(g):
    g = g.astype(np.float32)
    m = np.abs(g).max()
    if m == 0:
        return g, np.float32(0)
    s = np.float32(m / np.float32(127))
    return (np.clip(np.round(g / s), -127, 127) * s).astype(np.float32), s


def _clip_np(g, max_norm):
    n = np.float32(np.sqrt(np.sum(g.astype(np.float32) ** 2, dtype=np.float32)))
    return g * np.float32(max_norm / (n + np.float32(1e-6))) if n > max_norm else g


# (name, pass, jnp reference fn(g, i) for the hooked model, numpy check of (pre, post))
STATELESS_CASES = {
    "int8": (P.int8_fake_quant(), lambda g, i: P.int8_fake_quant().update(g, None, None)[0],
             lambda pre, post: np.testing.assert_array_equal(post, _int8_np(pre)[0])),
    "clip": (P.clip_by_norm(0.05), lambda g, i: P.clip_by_norm(0.05).update(g, None, None)[0],
             lambda pre, post: np.testing.assert_allclose(post, _clip_np(pre, 0.05), rtol=1e-6)),
    "cast_bf16": (P.cast_roundtrip("bf16"), lambda g, i: g.astype(jnp.bfloat16).astype(jnp.float32),
                  lambda pre, post: np.testing.assert_array_equal(post, pre.astype(ml_dtypes.bfloat16).astype(np.float32))),
    "decay": (P.decay(0.25), lambda g, i: g * 0.75,
              lambda pre, post: np.testing.assert_array_equal(post, pre * np.float32(0.75))),
}


@pytest.mark.parametrize("name", list(STATELESS_CASES))
def test_stateless_pass_in_jitted_train_step_matches_hooked_reference(name):
    pass_, ref_fn, check = STATELESS_CASES[name]
    hist = _train(P.chain(P.capture(), pass_, P.capture()))
    for t, h in enumerate(hist):
        gp_ref, pre_ref = reference_adjoints(h["params"], h["x"], h["y"], ref_fn)
        chex_close = dict(rtol=2e-5, atol=1e-7)
        for a, b in zip(jax.tree_util.tree_leaves(h["grads"]), jax.tree_util.tree_leaves(gp_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), **chex_close)
        for i, st in enumerate(h["states"]):
            pre, post = np.asarray(st[0].adjoint), np.asarray(st[2].adjoint)
            np.testing.assert_allclose(pre, pre_ref[i], rtol=2e-5, atol=1e-8, err_msg=f"step {t} boundary {i}")
            check(pre, post)
            np.testing.assert_allclose(float(h["stats"]["adjoint_norm"][i]), np.linalg.norm(pre), rtol=1e-5)
            np.testing.assert_allclose(float(h["stats"]["adjoint_norm_after_passes"][i]), np.linalg.norm(post), rtol=1e-5)
            if name == "int8":
                assert float(st[1].scale) == _int8_np(pre)[1]
            if name == "clip":
                np.testing.assert_allclose(float(st[1].norm), np.linalg.norm(pre), rtol=1e-6)
                assert bool(st[1].clipped) == (np.linalg.norm(pre) > 0.05)


def test_statistics_in_train_step_equal_numpy_on_independent_adjoints():
    hist = _train(P.statistics())
    for t, h in enumerate(hist):
        _, adjoints = reference_adjoints(h["params"], h["x"], h["y"])
        for i, st in enumerate(h["states"]):
            g = adjoints[i].astype(np.float64)
            rms = np.sqrt(np.mean(g**2))
            ref = dict(mean=g.mean(), std=g.std(), min=g.min(), max=g.max(), norm=np.linalg.norm(g))
            for key, value in ref.items():
                np.testing.assert_allclose(float(getattr(st, key)), value, rtol=1e-5, atol=1e-6 * rms,
                                           err_msg=f"step {t} boundary {i} {key}")
            assert int(st.numel) == g.size and not bool(st.has_nan) and not bool(st.has_inf)
    # the model trains, so the statistics change from step to step
    assert float(hist[0]["states"][0].norm) != float(hist[-1]["states"][0].norm)


def test_fp8_delayed_amax_history_evolves_in_train_step():
    hist_len = 3
    hist = _train(P.chain(P.capture(), P.fp8_quant("e4m3", "delayed", history_len=hist_len), P.capture()))
    for i in range(NUM_B):
        amaxes = []
        for t, h in enumerate(hist):
            pre, fp8, post = h["states"][i]
            pre = np.asarray(pre.adjoint)
            amax = np.float32(np.abs(pre).max())
            prev = np.array(amaxes[-hist_len:], np.float32)
            used = _amax_scale(prev.max() if len(prev) else amax, "e4m3")
            np.testing.assert_array_equal(np.asarray(post.adjoint), _fp8_ref(pre, used, "e4m3"))
            amaxes.append(amax)
            expect = np.zeros(hist_len, np.float32)
            recent = amaxes[::-1][:hist_len]
            expect[: len(recent)] = recent
            np.testing.assert_array_equal(np.asarray(fp8.amax_history), expect, err_msg=f"boundary {i} step {t}")
            assert not np.array_equal(np.asarray(post.adjoint), pre)


def test_topk_residual_evolves_in_train_step():
    hist = _train(P.chain(P.capture(), P.topk_compress(0.75), P.capture()))
    for i in range(NUM_B):
        residual = np.zeros((2, 4, D), np.float32)
        for t, h in enumerate(hist):
            pre, topk, post = h["states"][i]
            acc = np.asarray(pre.adjoint) + residual
            k = P.topk.num_kept(acc.size, 0.75)
            thresh = np.sort(np.abs(acc).ravel())[-k]
            np.testing.assert_array_equal(np.asarray(post.adjoint), np.where(np.abs(acc) >= thresh, acc, 0))
            residual = acc - np.asarray(post.adjoint)
            np.testing.assert_array_equal(np.asarray(topk.residual), residual)
            assert int(topk.kept) == k
            assert np.linalg.norm(residual) > 0


def test_gaussian_noise_accepts_raw_uint32_keys():
    p = P.gaussian_noise(0.1)
    g = np.ones((2, 3), np.float32)
    raw = p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.PRNGKey(5))
    typed = p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(5))
    assert _trees_bitequal(raw, typed)
    with pytest.raises(TypeError, match="PRNG key"):
        p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None)
    # the state holds a typed key either way (NoiseState's docstring); errors name the pass
    assert jax.dtypes.issubdtype(raw.key.dtype, jax.dtypes.prng_key) and raw.key.shape == ()
    with pytest.raises(TypeError) as err:
        p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None)
    assert str(err.value) == "gaussian_noise(0.1): init needs a PRNG key (jax.random.key)"
    with pytest.raises(TypeError) as err:
        p.init(jax.ShapeDtypeStruct((3,), jnp.int32), jax.random.key(5))
    assert str(err.value) == "gaussian_noise(0.1): adjoints are floating arrays; got dtype int32"


@pytest.mark.parametrize("std", [0.5, optax.constant_schedule(0.5)], ids=["fixed", "schedule"])
def test_gaussian_noise_keeps_a_bfloat16_adjoint_in_bfloat16(std):
    """The noise is drawn in the adjoint's dtype and scaled by std in it (a schedule's too)."""
    p = P.gaussian_noise(std)
    g = jnp.asarray([1.0, -2.0, 0.5, 3.0, 0.25, -1.5], jnp.bfloat16)
    state = _init(p, g, key=3)
    out, new = _call(p, g, state)
    key, sub = jax.random.split(state.key)
    noise = np.asarray(jax.random.normal(sub, g.shape, jnp.bfloat16), np.float32)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(g, np.float32) + 0.5 * noise, rtol=2**-8, atol=2**-8)
    assert _trees_bitequal(new.key, key)


def test_gaussian_noise_key_evolves_and_run_is_reproducible():
    trainer = _trainer(P.chain(P.capture(), P.gaussian_noise(0.01), P.capture()))
    run1 = _train(None, key=7, trainer=trainer)
    run2 = _train(None, key=7, trainer=trainer)
    run3 = _train(None, key=8, trainer=trainer)
    for i in range(NUM_B):
        keys = [np.asarray(jax.random.key_data(h["states"][i][1].key)).tolist() for h in run1]
        assert len({tuple(k) for k in keys}) == 5  # split on every step
        noises = [np.asarray(h["states"][i][2].adjoint) - np.asarray(h["states"][i][0].adjoint) for h in run1]
        assert all(0.003 < n.std() < 0.03 for n in noises)
        assert not np.array_equal(noises[0], noises[1])
    for a, b, c in zip(run1, run2, run3):
        assert _trees_bitequal(a["grads"], b["grads"]) and _trees_bitequal(a["states"], b["states"])
        assert not _trees_bitequal(a["grads"], c["grads"])
    # boundaries draw independent noise
    n0 = np.asarray(run1[0]["states"][0][2].adjoint) - np.asarray(run1[0]["states"][0][0].adjoint)
    n1 = np.asarray(run1[0]["states"][1][2].adjoint) - np.asarray(run1[0]["states"][1][0].adjoint)
    assert not np.allclose(n0, n1)


def test_synthetic_gradient_learns_in_train_step():
    # lr=0 for the model: the true adjoints stay fixed until the synthetic ones replace
    # them (after 3 calls), so during warmup every predictor's loss must fall; the output
    # boundary's target (the loss gradient) stays fixed throughout.
    warmup = 3
    # explicit initial predictor (shared by the boundaries): keeps the jitted init cheap
    predictor = P.init_predictor(jax.random.key(4), 4 * D, 16)
    hist = _train(P.chain(P.capture(), P.synthetic_gradient(16, lr=1e-2, warmup_steps=warmup, use_synthetic=True,
                                                            predictor_params=predictor), P.capture()), lr=0.0)
    for i in range(NUM_B):
        losses = [float(h["states"][i][1].loss) for h in hist]
        counts = [int(h["states"][i][1].count) for h in hist]
        assert counts == [1, 2, 3, 4, 5]
        fixed = losses if i == DEPTH else losses[:warmup]
        assert all(b < a for a, b in zip(fixed, fixed[1:])), (i, losses)
        for t, h in enumerate(hist):
            pre, syn, post = h["states"][i]
            if t + 1 > warmup:  # replaced by the (updated) predictor's output
                flat = np.asarray(pre.adjoint).reshape(2, -1)
                pred = np.asarray(P.predictor_apply(syn.params, jnp.asarray(flat))).reshape(pre.adjoint.shape)
                np.testing.assert_allclose(np.asarray(post.adjoint), pred, rtol=1e-5, atol=1e-7)
                assert not np.array_equal(np.asarray(post.adjoint), np.asarray(pre.adjoint))
            else:
                np.testing.assert_array_equal(np.asarray(post.adjoint), np.asarray(pre.adjoint))
    top_losses = [float(h["states"][DEPTH][1].loss) for h in hist]
    assert top_losses[-1] < 0.5 * top_losses[0], top_losses
    # after warmup the param grads come from synthetic adjoints, not the true ones
    gp_true, _ = reference_adjoints(hist[-1]["params"], hist[-1]["x"], hist[-1]["y"])
    assert not np.allclose(np.asarray(hist[-1]["grads"]["w"]), np.asarray(gp_true["w"]), rtol=1e-3)
    np.testing.assert_allclose(np.asarray(hist[0]["grads"]["w"]), np.asarray(gp_true["w"]), rtol=1e-5, atol=1e-8)


def test_synthetic_gradient_predictor_params_validation():
    good = P.init_predictor(jax.random.key(0), 12, 4)
    p = P.synthetic_gradient(4, predictor_params=good)
    spec = jax.ShapeDtypeStruct((3, 12), jnp.float32)
    state = p.init(spec, jax.random.key(1))
    assert _trees_bitequal(state.params, good)
    # bfloat16 params are widened to the documented float32, value for value
    bf16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), good)
    widened = P.synthetic_gradient(4, predictor_params=bf16).init(spec, None).params
    assert _trees_bitequal(widened, jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), bf16))
    want = "{'fc1': {'w': (4, %d), 'b': (4,)}, 'fc2': {'w': (%d, 4), 'b': (%d,)}}"
    with pytest.raises(ValueError) as err:
        p.init(jax.ShapeDtypeStruct((3, 10), jnp.float32), jax.random.key(1))
    assert str(err.value) == (f"synthetic_gradient: predictor_params shapes {want % (12, 12, 12)} do not match "
                              f"the adjoint's predictor {want % (10, 10, 10)}")
    with pytest.raises(ValueError) as err:
        P.synthetic_gradient(4, predictor_params={"w": 1}).init(spec, None)
    assert str(err.value) == f"synthetic_gradient: predictor_params must be {want % (12, 12, 12)} (shapes), got {{'w': 1}}"
    with pytest.raises(TypeError) as err:
        p.init(jax.ShapeDtypeStruct((3, 12), jnp.int32), jax.random.key(1))
    assert str(err.value) == "synthetic_gradient: adjoints are floating arrays; got dtype int32"
    with pytest.raises(TypeError) as err:
        P.synthetic_gradient(4).init(spec, None)
    assert str(err.value) == "synthetic_gradient: init needs a PRNG key to draw the predictor (or give predictor_params)"
    for bad, msg in [(dict(hidden_dim=0), "hidden_dim must be >= 1, got 0"), (dict(lr=-1.0), "lr must be >= 0.0, got -1.0"),
                     (dict(warmup_steps=-1), "warmup_steps must be >= 0, got -1"),
                     (dict(hidden_dim=2.0), "hidden_dim must be a Python int, got 2.0"),
                     (dict(warmup_steps=1.0), "warmup_steps must be a Python int, got 1.0"),
                     (dict(lr="1"), "lr must be a Python number, got '1'")]:
        with pytest.raises((ValueError, TypeError)) as err:
            P.synthetic_gradient(**bad)
        assert str(err.value) == "synthetic_gradient: " + msg
    with pytest.raises(TypeError) as err:
        P.synthetic_gradient(use_synthetic=1)
    assert str(err.value) == "synthetic_gradient: use_synthetic must be a bool, got 1"
    # the bounds met exactly are accepted
    edge = P.synthetic_gradient(hidden_dim=1, lr=0.0, warmup_steps=0)
    assert edge.name == "synthetic_gradient"
    assert edge.init(spec, jax.random.key(0)).params["fc1"]["w"].shape == (1, 12)


@pytest.mark.parametrize("kwargs,msg", [(dict(feature_dim=0, hidden_dim=4), "feature_dim must be >= 1, got 0"),
                                        (dict(feature_dim=4, hidden_dim=0), "hidden_dim must be >= 1, got 0")])
def test_init_predictor_bad_sizes_are_named_in_full(kwargs, msg):
    with pytest.raises(ValueError) as err:
        P.init_predictor(jax.random.key(0), **kwargs)
    assert str(err.value) == "init_predictor: " + msg


def test_init_predictor_draws_every_tensor_from_torchs_linear_bounds():
    """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` per tensor (fc1's fan_in is F, fc2's is H): every
    draw inside, both ends nearly reached, no two equal; sizes of 1 are accepted."""
    feature, hidden = 40, 30
    params = P.init_predictor(jax.random.key(3), feature, hidden)
    for layer, fan_in in (("fc1", feature), ("fc2", hidden)):
        bound = 1.0 / math.sqrt(fan_in)
        for leaf in ("w", "b"):
            v = np.asarray(params[layer][leaf], np.float64)
            assert params[layer][leaf].dtype == jnp.float32
            assert np.abs(v).max() <= bound and v.min() < -0.8 * bound and v.max() > 0.8 * bound, (layer, leaf)
            assert len(np.unique(v)) == v.size
    tiny = P.init_predictor(jax.random.key(3), 1, 1)
    assert [tiny[l][p].shape for l in ("fc1", "fc2") for p in ("w", "b")] == [(1, 1), (1,), (1, 1), (1,)]


def test_synthetic_gradient_defaults_train_64_wide_at_lr_1e3_and_keep_the_adjoint():
    """The defaults: H = 64, Adam at lr 1e-3 (its first step moves each weight by lr times the
    gradient's sign, to 1e-6), warmup 0 and the adjoint kept; with use_synthetic the first
    call already replaces it (count 1 > warmup 0)."""
    g = jnp.asarray(np.random.default_rng(8).standard_normal((2, 3)), jnp.float32)
    p = P.synthetic_gradient()
    state0 = _init(p, g)
    assert state0.params["fc1"]["w"].shape == (64, 3)
    for got, want in ((state0.count, np.int32(0)), (state0.loss, np.float32(0.0))):  # the documented carry
        assert np.asarray(got).dtype == want.dtype and np.asarray(got).shape == () and got == want
    out, state1 = _call(p, g, state0)
    chex.assert_trees_all_equal_shapes_and_dtypes(state1, state0)  # a scan's carry in and out
    np.testing.assert_array_equal(np.asarray(out), np.asarray(g))
    grads = jax.grad(lambda q: jnp.mean(jnp.square(P.predictor_apply(q, g) - g)))(state0.params)
    for a, b, d in zip(jax.tree_util.tree_leaves(state0.params), jax.tree_util.tree_leaves(state1.params),
                       jax.tree_util.tree_leaves(grads)):
        step = np.asarray(b, np.float64) - np.asarray(a, np.float64)
        moved = np.abs(np.asarray(d)) > 1e-4  # |grad| >> Adam's eps: the step is lr * sign(grad)
        np.testing.assert_allclose(step[moved], -1e-3 * np.sign(np.asarray(d)[moved]), rtol=0, atol=1e-6)
    syn = P.synthetic_gradient(use_synthetic=True)
    out, state1 = _call(syn, g, _init(syn, g))
    np.testing.assert_allclose(np.asarray(out), np.asarray(P.predictor_apply(state1.params, g)), rtol=1e-6)
    half = g.astype(jnp.bfloat16)  # the replacement keeps a bfloat16 adjoint's dtype
    out, state1 = _call(syn, half, _init(syn, half))
    assert out.dtype == jnp.bfloat16
    want = P.predictor_apply(state1.params, half.astype(jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=2**-7)


def test_nonfinite_guard_in_train_step_counts_and_protects():
    params, x, y = _problem()
    y_bad = y.at[0, 0, 0].set(jnp.inf)  # makes the output adjoint -inf there
    ys = [y, y, y_bad, y, y_bad]
    hist = _train(P.chain(P.nonfinite_guard("zero"), P.capture()), ys=ys)
    for t, h in enumerate(hist):
        n_bad = sum(1 for yy in ys[: t + 1] if yy is y_bad)
        top = h["states"][DEPTH]
        assert int(top[0].count) == n_bad and int(top[0].last_bad) == (1 if ys[t] is y_bad else 0)
        assert all(int(h["states"][i][0].count) == 0 for i in range(DEPTH))  # nothing non-finite below
        assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(h["grads"]))
        if ys[t] is y_bad:
            assert float(np.asarray(top[1].adjoint)[0, 0, 0]) == 0.0


def test_nonfinite_guard_raise_in_train_step():
    params, x, y = _problem()
    stack, step = _trainer(P.nonfinite_guard("raise"))
    carry = stack.init(params, x)
    out = step(params, carry, x, y)
    jax.block_until_ready(out)
    with pytest.raises(Exception, match=f"boundary {DEPTH} has 1 non-finite"):
        jax.block_until_ready(step(params, carry, x, y.at[0, 0, 0].set(jnp.nan)))
    # inside the scan over blocks: poison boundary 1 only
    poison = P.at_layers(P.stateless(lambda g, ctx: g.at[0, 0, :2].set(jnp.inf), "poison"), [1])
    stack, step = _trainer(P.chain(poison, P.nonfinite_guard("raise")))
    with pytest.raises(Exception, match="boundary 1 has 2 non-finite"):
        jax.block_until_ready(step(params, stack.init(params, x), x, y))


# ----------------------------------------------------------------------------- capture
def test_capture_continues_backprop_into_an_embedding():
    V = 11
    params, _, y = _problem()
    embed = jax.random.normal(jax.random.key(9), (V, D))
    tokens = jax.random.randint(jax.random.key(10), (2, 4), 0, V)
    stack = eae_jax.reconstruct(_block, passes=P.at_layers(P.capture(), [0]))
    carry = stack.init(params, embed[tokens])

    @jax.jit
    def step(embed, params, carry):
        # The stack's input is computed outside and not differentiated here.
        x = jax.lax.stop_gradient(embed[tokens])
        gp, gc = jax.grad(lambda p, c: _loss(stack(p, x, c), y), argnums=(0, 1))(params, carry)
        carry, _ = stack.update(carry, gc)
        adjoint_x0 = stack.state(carry)["segments"][0].adjoint[0]
        (g_embed,) = jax.vjp(lambda e: e[tokens], embed)[1](adjoint_x0)
        return gp, g_embed, carry

    gp, g_embed, carry = step(embed, params, carry)

    def full(embed, params):
        h = embed[tokens]
        for i in range(DEPTH):
            h = _block(jax.tree_util.tree_map(lambda a: a[i], params), h)
        return _loss(h, y)

    g_embed_ref, gp_ref = jax.jit(jax.grad(full, argnums=(0, 1)))(embed, params)
    np.testing.assert_allclose(np.asarray(g_embed), np.asarray(g_embed_ref), rtol=1e-5, atol=1e-8)
    assert float(jnp.abs(g_embed).max()) > 0
    for a, b in zip(jax.tree_util.tree_leaves(gp), jax.tree_util.tree_leaves(gp_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
    # only boundary 0 captured: the others still hold their zero initial state
    state = stack.state(carry)
    assert np.all(np.asarray(state["segments"][0].adjoint[1:]) == 0) and np.all(np.asarray(state["top"].adjoint) == 0)


# ----------------------------------------------------------------------------- at_layers
def test_at_layers_acts_only_on_chosen_boundaries():
    chosen = [1, -1]  # boundary 1 and the output boundary L
    hist = _train(P.chain(P.at_layers(P.chain(P.decay(0.5), P.int8_fake_quant()), chosen), P.capture()), steps=2)
    active = {1, DEPTH}

    def ref_fn(g, i):
        if i in active:
            return P.int8_fake_quant().update(g * 0.5, None, None)[0]
        return g

    for h in hist:
        gp_ref, _ = reference_adjoints(h["params"], h["x"], h["y"], ref_fn)
        for a, b in zip(jax.tree_util.tree_leaves(h["grads"]), jax.tree_util.tree_leaves(gp_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-8)
        before = np.asarray(h["stats"]["adjoint_norm"])
        after = np.asarray(h["stats"]["adjoint_norm_after_passes"])
        for i in range(NUM_B):
            scale = float(h["states"][i][0][1].scale)
            if i in active:
                assert scale > 0 and abs(after[i] / before[i] - 0.5) < 0.02
            else:
                assert scale == 0.0 and after[i] == pytest.approx(before[i], rel=1e-6)


def test_every_n_steps_runs_the_pass_on_multiples_of_n():
    hist = _train(P.every_n_steps(P.chain(P.decay(0.5), P.int8_fake_quant()), 2), steps=4)
    scales = [float(h["states"][0][1].scale) for h in hist]
    assert scales[0] > 0 and scales[1] == scales[0] and scales[2] != scales[1] and scales[3] == scales[2]
    for t, h in enumerate(hist):
        ratio = np.asarray(h["stats"]["adjoint_norm_after_passes"]) / np.asarray(h["stats"]["adjoint_norm"])
        if t % 2:
            np.testing.assert_allclose(ratio, np.ones(NUM_B), rtol=1e-6)  # the norms are two reductions
        else:
            np.testing.assert_allclose(ratio, 0.5, rtol=0.02)


def test_at_layers_across_segments():
    """Boundaries are numbered across segments (a plain block, a Scan, a plain block)."""
    params, x, y = _problem()
    one = lambda i: jax.tree_util.tree_map(lambda a: a[i], params)  # noqa: E731
    plist = [one(0), jax.tree_util.tree_map(lambda a: a[1:2], params), one(2)]
    blocks = [_block, eae_jax.Scan(_block), _block]
    for chosen in ([0, 2], [1, -1]):  # plain segments; the Scan and the output boundary
        stack = eae_jax.reconstruct(blocks, passes=P.at_layers(P.decay(0.5), chosen))
        carry = stack.init(plist, x)
        gc = jax.jit(jax.grad(lambda c: _loss(stack(plist, x, c), y)))(carry)
        _, stats = stack.update(carry, gc)
        chosen = [c % NUM_B for c in chosen]
        ratio = np.asarray(stats["adjoint_norm_after_passes"]) / np.asarray(stats["adjoint_norm"])
        np.testing.assert_allclose(ratio, [0.5 if i in chosen else 1.0 for i in range(NUM_B)], rtol=1e-6)


# ----------------------------------------------------------------------------- chain / optax
def test_nested_chain_equals_flat_chain():
    a, b, c = P.int8_fake_quant(), P.gaussian_noise(0.1), P.topk_compress(0.5)
    nested, flat = P.chain(a, P.chain(b, c)), P.chain(a, b, c)
    assert nested.name == flat.name and len(nested.members) == 3
    g = np.random.default_rng(6).standard_normal((4, 8)).astype(np.float32)
    s_nested, s_flat = _init(nested, g, 3), _init(flat, g, 3)
    assert _trees_bitequal(s_nested, s_flat)
    for _ in range(3):
        o1, s_nested = _call(nested, g, s_nested)
        o2, s_flat = _call(flat, g, s_flat)
        np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
        assert _trees_bitequal(s_nested, s_flat)
    # and the chain is the members applied in order
    s = _init(flat, g, 3)

    @jax.jit
    def by_hand(g, s):
        for member, ms in zip(flat.members, s):
            g, _ = member.update(g, ms, _ctx())
        return g

    np.testing.assert_array_equal(np.asarray(_call(flat, g, s)[0]), np.asarray(by_hand(jnp.asarray(g), s)))


def test_optax_transforms_work_as_passes():
    g = (np.random.default_rng(7).standard_normal((4, 8)) * 3).astype(np.float32)
    p = P.chain(optax.clip_by_global_norm(1.0), optax.scale(0.5), P.statistics())
    out, state = _call(p, g, _init(p, g))
    ref = g * min(1.0, 1.0 / np.linalg.norm(g)) * 0.5
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6)
    np.testing.assert_allclose(float(state[2].norm), 0.5, rtol=1e-6)
    # directly as the stack's passes: alone (an optax transform is a NamedTuple, not a
    # list of passes) and in a list with a built-in pass
    int8 = P.int8_fake_quant()
    for passes, fn in ((optax.scale(0.5), lambda g, i: g * 0.5),
                       ([int8, optax.scale(0.5)], lambda g, i: int8.update(g, None, None)[0] * 0.5)):
        hist = _train(passes, steps=1)
        gp_ref, _ = reference_adjoints(hist[0]["params"], hist[0]["x"], hist[0]["y"], fn)
        for a, b in zip(jax.tree_util.tree_leaves(hist[0]["grads"]), jax.tree_util.tree_leaves(gp_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-8)
    with pytest.raises(TypeError, match="not an adjoint pass"):
        P.chain(lambda g: g)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad,what", [
    (lambda g, ctx: g[..., :-1], "shape"),
    (lambda g, ctx: g.astype(jnp.bfloat16), "dtype"),
])
def test_wrong_shape_or_dtype_fails_at_trace_time_naming_the_pass(bad, what):
    params, x, y = _problem()
    bad_pass = P.stateless(bad, f"my_bad_{what}_pass")
    for passes in (bad_pass, P.chain(P.int8_fake_quant(), bad_pass)):
        stack, step = _trainer(passes)
        carry = stack.init(params, x)
        with pytest.raises(TypeError, match=f"my_bad_{what}_pass.*must return the same"):
            step.lower(params, carry, x, y)  # tracing alone raises: nothing runs


def test_pass_returning_non_tuple_is_named():
    params, x, y = _problem()
    bad = P.AdjointTransformation(lambda s, k: P.EmptyState(), lambda g, s, c: g, "no_tuple_pass")
    stack, step = _trainer(bad)
    with pytest.raises(TypeError, match="no_tuple_pass.*must return \\(adjoint, state\\)"):
        step.lower(params, stack.init(params, x), x, y)


@pytest.mark.parametrize("factory,arg", [(P.clip_by_norm, 0.0), (P.clip_by_norm, -1.0), (P.gaussian_noise, -0.1),
                                         (P.decay, float("inf")), (P.clip_by_norm, float("nan"))])
def test_bad_hyperparameters_raise_value_error(factory, arg):
    with pytest.raises(ValueError, match=factory.__name__):
        factory(arg)


@pytest.mark.parametrize("arg,message", [(0.0, "max_norm must be > 0.0, got 0.0"),
                                         (-1.0, "max_norm must be > 0.0, got -1.0"),
                                         (float("nan"), "max_norm must not be NaN")])
def test_clip_by_norm_names_itself_and_the_bound_it_refuses(arg, message):
    """The whole message: the pass, the argument and the rule (0 itself is refused: the bound is open)."""
    with pytest.raises(ValueError) as err:
        P.clip_by_norm(arg)
    assert str(err.value) == f"clip_by_norm: {message}"
    assert P.clip_by_norm(0.5).name == "clip_by_norm(0.5)"


def test_clip_by_norm_leaves_an_adjoint_exactly_at_the_bound_alone():
    """norm == max_norm is not clipped (the rule is norm > max_norm); the integer spec is refused by name."""
    g = jnp.array([3.0, 4.0], jnp.float32)  # norm exactly 5 in float32
    clip = P.clip_by_norm(5.0)
    ctx = P.PassContext(boundary=jnp.int32(1), block=jnp.int32(1), step=jnp.int32(0), num_boundaries=2)
    out, state = clip.update(g, clip.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), ctx)
    assert not bool(state.clipped) and float(state.norm) == 5.0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(g))
    out, state = P.clip_by_norm(4.0).update(g, state, ctx)
    assert bool(state.clipped)
    with pytest.raises(TypeError, match="^clip_by_norm: "):
        clip.init(jax.ShapeDtypeStruct((3,), jnp.int32), None)


# The documented initial state of each stateful pass (its State docstring) for a (3,)
# bfloat16 adjoint; update must return the same tree of shapes and dtypes, or the
# boundary carry of a scan breaks.
_BF16_3 = ml_dtypes.bfloat16
_INIT_STATES = {
    "capture": (P.capture, P.CaptureState(np.zeros(3, _BF16_3))),
    "clip_by_norm(1)": (lambda: P.clip_by_norm(1.0), P.ClipState(np.float32(0.0), np.bool_(False))),
    "int8_fake_quant": (P.int8_fake_quant, P.Int8State(np.float32(0.0))),
    "fp8_quant(e4m3, current)": (lambda: P.fp8_quant("e4m3"), P.Fp8State(np.float32(0.0), np.zeros(1, np.float32))),
    "fp8_quant(e5m2, delayed)": (lambda: P.fp8_quant("e5m2", "delayed", history_len=3),
                                 P.Fp8State(np.float32(0.0), np.zeros(3, np.float32))),
    "nonfinite_guard(zero)": (P.nonfinite_guard, P.GuardState(np.int32(0), np.int32(0))),
    "statistics": (P.statistics, P.StatsState(*[np.float32(0.0)] * 5, np.int32(0), np.bool_(False), np.bool_(False))),
    "topk_compress(0.5, ef)": (lambda: P.topk_compress(0.5), P.TopKState(np.zeros(3, np.float32), np.int32(0))),
    "topk_compress(0.5)": (lambda: P.topk_compress(0.5, error_feedback=False), P.TopKState(None, np.int32(0))),
}


@pytest.mark.parametrize("name", list(_INIT_STATES))
def test_init_state_is_the_documented_one_and_the_carry_update_returns(name):
    make, want = _INIT_STATES[name]
    p = make()
    assert p.name == name
    g = jnp.array([3.0, -4.0, 0.5], jnp.bfloat16)
    state0 = _init(p, g)
    assert jax.tree_util.tree_structure(state0) == jax.tree_util.tree_structure(want)
    for got, ref in zip(jax.tree_util.tree_leaves(state0), jax.tree_util.tree_leaves(want)):
        assert np.asarray(got).dtype == np.asarray(ref).dtype and np.shape(got) == np.shape(ref)
        np.testing.assert_array_equal(np.asarray(got), ref)
    _, state1 = _call(p, g, state0)
    chex.assert_trees_all_equal_shapes_and_dtypes(state1, state0)
    with pytest.raises(TypeError) as err:  # the whole message, naming the pass
        p.init(jax.ShapeDtypeStruct((3,), jnp.int32), None)
    assert str(err.value).startswith(name.split("(")[0])
    assert str(err.value).endswith(": adjoints are floating arrays; got dtype int32")


@pytest.mark.parametrize("g,max_norm", [([6e-6, -8e-6], 1e-6), ([6e-6, -8e-6], 2e-6), ([0.3, 0.4, 1.2], 0.5)],
                         ids=["norm1e-5", "norm1e-5-bound2e-6", "norm1.3"])
def test_clip_by_norm_factor_is_max_norm_over_norm_plus_1e6(g, max_norm):
    """The factor ``max_norm / (norm + 1e-6)`` (the seed's ``ClipPass``), checked in float64
    at a norm of 1e-5 (the 1e-6 is a tenth of it) and of 1.3 (it moves the factor by 8 ulps)."""
    g = np.asarray(g, np.float32)
    clip = P.clip_by_norm(max_norm)
    out, state = _call(clip, g, _init(clip, g))
    norm = np.linalg.norm(g.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out), g.astype(np.float64) * (max_norm / (norm + 1e-6)), rtol=2e-7)
    assert bool(state.clipped)
    np.testing.assert_allclose(float(state.norm), norm, rtol=2e-7)


def test_pass_init_rejects_integer_adjoint_spec():
    with pytest.raises(TypeError, match="floating"):
        P.int8_fake_quant().init(jax.ShapeDtypeStruct((3,), jnp.int32), jax.random.key(0))


# ----------------------------------------------------------------------------- the carry, called twice
# int counters, a PRNG key, float residuals and amax histories in one carry
STATEFUL = P.chain(P.gaussian_noise(0.1), P.topk_compress(0.5), P.nonfinite_guard(), P.fp8_quant("e4m3", "delayed"))


def _twice_step(stack, strict):
    def loss(p, c, x, y):  # the same carry used by two calls of the stack
        return _loss(stack(p, x, c), y) + _loss(stack(p, 2 * x, c), y)

    @jax.jit
    def step(params, carry, x, y):
        gp, gc = jax.grad(loss, argnums=(0, 1))(params, carry, x, y)
        return stack.update(carry, gc, strict=strict)

    return step


def test_calling_the_stack_twice_with_one_carry_keeps_state_when_not_strict():
    params, x, y = _problem()
    stack = eae_jax.reconstruct(_block, passes=STATEFUL)
    carry = stack.init(params, x)
    # one good step first, so the state is not the initial one
    _, step_once = _trainer(STATEFUL)
    _, carry, _, _, _ = step_once(params, carry, x, y)
    new, stats = _twice_step(stack, strict=False)(params, carry, x, y)
    assert float(stats["calls"]) == 2.0
    assert _trees_bitequal(stack.state(new), stack.state(carry))
    noise_key = stack.state(carry)["top"][0].key
    assert not _trees_bitequal(noise_key, jax.random.key(0))  # the kept state is the evolved one


def test_calling_the_stack_twice_with_one_carry_raises_when_strict():
    params, x, y = _problem()
    stack = eae_jax.reconstruct(_block, passes=STATEFUL)
    carry = stack.init(params, x)
    with pytest.raises(Exception, match="ran 2 times with one carry"):
        jax.block_until_ready(_twice_step(stack, strict=True)(params, carry, x, y))


def test_separate_carries_for_two_calls_both_update():
    params, x, y = _problem()
    stack = eae_jax.reconstruct(_block, passes=P.nonfinite_guard())
    c1, c2 = stack.init(params, x), stack.init(params, 2 * x)

    @jax.jit
    def step(params, c1, c2):
        f = lambda p, a, b: _loss(stack(p, x, a), y) + _loss(stack(p, 2 * x, b), y)  # noqa: E731
        _, g1, g2 = jax.grad(f, argnums=(0, 1, 2))(params, c1, c2)
        return stack.update(c1, g1), stack.update(c2, g2)

    (n1, s1), (n2, s2) = step(params, c1, c2)
    assert float(s1["calls"]) == float(s2["calls"]) == 1.0
    assert not np.allclose(np.asarray(s1["adjoint_norm"]), np.asarray(s2["adjoint_norm"]))


def test_carry_without_backward_raises_when_strict():
    params, x, y = _problem()
    stack = eae_jax.reconstruct(_block, passes=P.statistics())
    carry = stack.init(params, x)
    gc = jax.grad(lambda c: 0.0 * jnp.sum(jnp.asarray(c.calls)))(carry)  # the stack never ran
    with pytest.raises(Exception, match="holds no update"):
        jax.block_until_ready(stack.update(carry, gc))


# ----------------------------------------------------------------------------- GPU
@needs_gpu[0]
@needs_gpu[1]
def test_casts_really_round_on_gpu():
    """On GPU XLA allows excess precision and may drop down-then-up casts; ours must not."""
    g = np.random.default_rng(8).standard_normal((64, 256)).astype(np.float32)
    gpu = jax.devices("gpu")[0]
    cases = [(P.cast_roundtrip("bf16"), g.astype(ml_dtypes.bfloat16).astype(np.float32)),
             (P.cast_roundtrip("fp16"), g.astype(np.float16).astype(np.float32)),
             (P.int8_fake_quant(), _int8_np(g)[0])]
    for fmt in ("e4m3", "e5m2"):
        cases.append((P.fp8_quant(fmt), _fp8_ref(g, _amax_scale(np.abs(g).max(), fmt), fmt)))
    for p, ref in cases:
        gd = jax.device_put(jnp.asarray(g), gpu)
        out = jax.jit(lambda a, s: p.update(a, s, _ctx()))(gd, _init(p, gd))[0]
        if p.name.startswith("fp8_quant"):
            # The fp8 rounding must happen (values on the scaled fp8 grid); the
            # dequantizing multiply may differ from numpy's by an ulp on GPU.
            np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=0, err_msg=p.name)
        else:
            np.testing.assert_array_equal(np.asarray(out), ref, err_msg=p.name)
        assert not np.allclose(np.asarray(out), g, rtol=1e-4), p.name


# ----------------------------------------------------------------------------- empty adjoints
def _empty_expected(p, g):
    """The state each pass records for the empty adjoint ``g`` (numpy refs: an empty
    adjoint counts as all-zero, amax = max over no magnitudes = 0, norm = 0)."""
    amax = np.max(np.abs(g.astype(np.float32)), initial=np.float32(0))
    norm = np.float32(np.linalg.norm(g.astype(np.float32)))
    if p.name.startswith("fp8_quant"):  # amax 0: the scale falls back to 1, a 0 is recorded
        hist = 16 if "delayed" in p.name else 1
        return P.Fp8State(np.float32(1.0), np.full(hist, amax, np.float32))
    if p.name == "int8_fake_quant":
        return P.Int8State(np.float32(amax / np.float32(127)))
    if p.name.startswith("clip_by_norm"):
        return P.ClipState(norm, np.bool_(norm > 1.0))
    if p.name == "statistics":
        z = np.float32(0)
        return P.StatsState(z, z, z, z, norm, np.int32(g.size), np.bool_(np.isnan(g).any()),
                            np.bool_(np.isinf(g).any()))
    if p.name.startswith("topk_compress"):
        return P.TopKState(np.zeros(g.shape, np.float32) if ", ef" in p.name else None, np.int32(0))
    return None  # synthetic_gradient: the state is unchanged (no Adam step on nothing)


_EMPTY_PASSES = [lambda: P.fp8_quant("e4m3"), lambda: P.fp8_quant("e5m2", "delayed"), P.int8_fake_quant,
                 lambda: P.clip_by_norm(1.0), P.statistics, lambda: P.topk_compress(0.5),
                 lambda: P.topk_compress(0.5, error_feedback=False), lambda: P.synthetic_gradient(hidden_dim=4)]


@pytest.mark.parametrize("shape,dtype", [((0,), np.float32), ((0, 8), ml_dtypes.bfloat16), ((3, 0, 4), np.float16)],
                         ids=["0", "0x8-bf16", "3x0x4-f16"])
def test_empty_adjoint_passes_through_under_jit(shape, dtype):
    """A size-0 adjoint is legal: init accepts it (statistics/topk/synthetic raised), update
    returns it unchanged (fp8/int8/clip gave jnp.max's raw zero-size error) with a defined state."""
    g = np.zeros(shape, dtype)
    for make in _EMPTY_PASSES:
        p = make()
        state0 = _init(p, g)
        out, state = _call(p, g, state0)
        assert out.shape == shape and out.dtype == jnp.dtype(dtype), p.name
        want = _empty_expected(p, g)
        if want is None:
            assert _trees_bitequal(state, state0), p.name
            continue
        assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(want), p.name
        for got, ref in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(got), ref, err_msg=p.name)
            assert np.asarray(got).dtype == np.asarray(ref).dtype, p.name
    # All chained, under jit, twice (the second call sees the recorded states).
    c = P.chain(*(make() for make in _EMPTY_PASSES))
    s = _init(c, g)
    for _ in range(2):
        out, s = _call(c, g, s)
    assert out.shape == shape and out.dtype == jnp.dtype(dtype)
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree_util.tree_leaves(s)
               if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key))


# ----------------------------------------------------------------------------- donation: no aliased state
from eae_jax.buffers import aliased_leaves, unalias  # noqa: E402
from eae_jax.passes.spec import PASSES  # noqa: E402

#: A value for every required hyper-parameter of the table's passes (a new one fails the test below).
REQUIRED_EXAMPLES = {"dtype": "bf16", "strength": 0.1, "std": 0.01, "ratio": 0.5}


def _every_pass():
    """Every pass of the library: each entry of the parsing table (its factory with defaults
    and the examples above), the combinators around one, and an optax transform."""
    out = {}
    for name, entry in PASSES.items():
        if name != entry.factory.__name__ and not entry.fixed:
            continue  # a short alias of a factory already in
        kwargs = {p.name: REQUIRED_EXAMPLES[p.name] for p in entry.params if p.default is inspect.Parameter.empty}
        out[name] = entry.build([], {k: str(v) for k, v in kwargs.items()}, name)
    out["at_layers"] = P.at_layers(P.statistics(), [0, -1])
    out["every_n_steps"] = P.every_n_steps(P.statistics(), 2)
    out["from_optax"] = P.from_optax(optax.chain(optax.add_noise(0.1, 0.5, 0), optax.scale_by_adam()))
    out["chain_of_all"] = P.chain(*(p for n, p in out.items() if n != "noise"))
    return out


def test_the_table_holds_every_builtin_pass():
    """Every pass factory the package exports is in the parsing table (combinators and
    helpers, which take passes or are not passes, aside)."""
    not_factories = {"as_pass", "at_layers", "chain", "every_n_steps", "from_optax", "stateless", "to_optax",
                     "fp8_format_max", "init_predictor", "predictor_apply"}
    exported = {n for n in P.__all__ if n[0].islower()} - not_factories
    assert exported == {e.factory.__name__ for e in PASSES.values()}


@pytest.mark.parametrize("name", list(_every_pass()))
def test_pass_state_has_no_aliased_buffers_and_can_be_donated(name):
    """statistics' state reused one zero array for five fields: a donated carry
    ('Attempt to donate the same buffer twice') crashed `eae-jax train --passes stats`."""
    pass_ = _every_pass()[name]
    g = jax.random.normal(jax.random.key(1), (2, 3, 8))
    state = pass_.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0))
    assert aliased_leaves(state) == []
    update = jax.jit(lambda a, s, step: pass_.update(a, s, PassContext(jnp.int32(0), jnp.int32(0), step, 4)),
                     donate_argnums=(1,))
    for step in range(3):  # the initial state, then states the jitted update returned
        out, state = update(g, state, jnp.int32(step))
        assert out.shape == g.shape and aliased_leaves(state) == []


def test_unalias_copies_only_shared_buffers():
    z, w = jnp.zeros(3), jnp.ones(2)
    tree = {"a": z, "b": (z, w), "c": w, "d": 1.0}
    assert aliased_leaves(tree) == ["['b'][0]", "['c']"]
    fresh = unalias(tree)
    assert aliased_leaves(fresh) == [] and fresh["a"] is z and fresh["b"][1] is w and fresh["d"] == 1.0
    chex.assert_trees_all_equal(fresh, tree)
    jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x + 1, t), donate_argnums=0)(fresh)  # donation works


def test_from_optax_unaliases_an_optax_state():
    z = jnp.zeros(())
    tx = optax.GradientTransformation(lambda p: (z, z), lambda u, s, p=None: (u, s))
    state = P.from_optax(tx).init(jax.ShapeDtypeStruct((3,), jnp.float32), None)
    assert aliased_leaves(state) == []


# ----------------------------------------------------------------------------- a pass's state keeps its dtype
def test_pass_changing_its_state_dtype_is_refused():
    """An int32 counter updated with + 1.0 was stored as float bits and read
    back as 1065353216."""
    def init(spec, key):
        return jnp.zeros((), jnp.int32)

    def update(g, count, ctx):
        return g, count + 1.0

    stack = eae_jax.reconstruct(lambda w, x: x + jnp.tanh(x @ w),
                                passes=P.AdjointTransformation(init, update, "counter"))
    params, x = jnp.stack([jnp.eye(3) * 0.1] * 3), jnp.ones((2, 3))
    carry = stack.init(params, x, jax.random.key(0))
    with pytest.raises(ValueError, match="changed dtype from int32 to float32"):
        jax.grad(lambda c: jnp.sum(stack(params, x, c)))(carry)
