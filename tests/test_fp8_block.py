"""Decoder blocks with fp8 seams: parity of the high-precision path with the
plain block, per-layer gating, and a reconstruct train step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import fp8
from eae_jax.blocks import BlockConfig, decoder_block, init_stack, plain_stack
from jaxpr_walk import all_eqns

DEPTH = 3


@pytest.fixture(scope="module")
def setup():
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128, compute_dtype="bf16",
                      rope_style="half")
    params = init_stack(jax.random.key(0), cfg, DEPTH)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64)).astype(jnp.bfloat16)
    cal = jax.random.normal(jax.random.key(2), (2, 16, 64)).astype(jnp.bfloat16)
    return cfg, params, x, fp8.bind_block(cfg, params, [cal, x])


def _detached(state):
    return {n: s._replace(ledger=s.ledger._replace(detached=jnp.ones_like(s.ledger.detached)))
            for n, s in state.items()}


def test_high_precision_path_is_the_plain_block_bit_for_bit(setup):
    cfg, params, x, bound = setup
    ref = jax.jit(lambda p, x: plain_stack(decoder_block(cfg), p, x))(params, x)
    got = jax.jit(lambda p, x: plain_stack(bound.block_fn(), p, x))(bound.params(params, _detached(bound.state)), x)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    # a block with no seams at all is the plain block too
    none = fp8.fp8_block(cfg, {})
    got = plain_stack(none, {"params": params, "fp8": {}}, x)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))


def test_certification_per_seam_and_layer(setup):
    cfg, params, x, bound = setup
    assert set(bound.certification) == {"qkv", "o", "ffn"}
    ffn = bound.certification["ffn"]
    assert ffn["dims"] == {"D": 64, "F": 128} and ffn["depth"] == DEPTH and ffn["samples"] == 2
    assert np.asarray(ffn["scales"]).shape == (DEPTH, 2)
    assert bound.certification["qkv"]["dims"] == {"K": 64, "N": (64, 32, 32)}
    for c in bound.certification.values():
        assert len(c["worst_cos_per_layer"]) == DEPTH and c["worst_cos"] >= 0.999
        assert c["gate_boundary"] == "block boundary (incl. residual)"
        assert all(b <= w + 1e-6 for b, w in zip(c["bare_cos_per_layer"], c["worst_cos_per_layer"]))
    assert bound.state["ffn"].scales.shape == (DEPTH, 2)
    assert bound.state["o"].ledger.reasons.shape == (DEPTH, len(fp8.REASONS))


def test_gate_names_the_failing_seam_and_layer(setup):
    cfg, params, x, bound = setup
    broken = np.array(bound.certification["ffn"]["scales"], np.float32)
    broken[1] /= 300.0
    with pytest.raises(fp8.GateRefused, match="ffn at layer 1") as info:
        fp8.bind_block(cfg, params, [x], scales={"ffn": broken})
    assert "layer 0" not in str(info.value) and info.value.worst < 0.999
    with pytest.raises(ValueError, match="unknown seam"):
        fp8.bind_block(cfg, params, [x], scales={"mlp": broken})
    with pytest.raises(ValueError, match="unknown block seam"):
        fp8.block_seams(("qkv", "mlp"))
    with pytest.raises(ValueError, match="expected \\(batch, seq, 64\\)"):
        fp8.bind_block(cfg, params, [x[0]])


def test_reconstruct_train_step_matches_bf16_gradients(setup):
    cfg, params, x, bound = setup
    ct = jax.random.normal(jax.random.key(5), x.shape)
    stack8 = eae_jax.reconstruct(bound.block_fn())
    stack = eae_jax.reconstruct(decoder_block(cfg))

    @jax.jit
    def grads(params, state):
        l8, g8 = jax.value_and_grad(lambda p: jnp.mean(stack8(p, x).astype(jnp.float32) * ct))(
            bound.params(params, state))
        l, g = jax.value_and_grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32) * ct))(params)
        return l8, g8, l, g

    l8, g8, l, g = grads(params, bound.state)
    assert abs(float(l8) - float(l)) < 0.02 * abs(float(l)) + 1e-4
    flat8 = jnp.concatenate([a.ravel() for a in jax.tree_util.tree_leaves(g8["params"])])
    flat = jnp.concatenate([a.ravel() for a in jax.tree_util.tree_leaves(g)])
    assert float(fp8.cosine(flat8, flat)) > 0.99
    for leaf8, leaf in zip(jax.tree_util.tree_leaves(g8["params"]), jax.tree_util.tree_leaves(g)):
        assert float(fp8.cosine(leaf8, leaf)) > 0.97
    new = bound.fold(bound.state, g8["fp8"], notify=False)
    assert all(e["calls"] == 1 and e["fp8_calls"] == 1 for e in bound.report(new))


def test_forward_variant_in_a_scan(setup):
    cfg, params, x, bound = setup
    blk = bound.block_fn_with_ledger()

    @jax.jit
    def run(p, x):
        def body(h, pi):
            y, inc = blk(pi, h)
            return y, inc

        return jax.lax.scan(body, x, p)

    y, incs = run(bound.params(params), x)
    new = bound.fold(bound.state, incs, notify=False)
    assert all(e["calls"] == 1 and e["fallbacks"] == 0 for e in bound.report(new))
    ref = plain_stack(decoder_block(cfg), params, x)
    assert float(fp8.cosine(y, ref)) > 0.999
    y2 = plain_stack(bound.block_fn(), bound.params(params), x)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(y2.astype(jnp.float32)))


def test_block_rejects_bad_params(setup):
    cfg, params, x, bound = setup
    blk = bound.block_fn()
    one = jax.tree_util.tree_map(lambda a: a[0], params)
    with pytest.raises(ValueError, match="'params'"):
        blk(one, x)
    with pytest.raises(ValueError, match="no state for seam"):
        blk({"params": one, "fp8": {}}, x)


def test_policy_seams():
    assert fp8.policy_seams(eae_jax.DTypePolicy.from_name("bf16")) == {}
    assert list(fp8.policy_seams(eae_jax.DTypePolicy.from_name("fp8_e4m3"), ("ffn",))) == ["ffn"]
    with pytest.raises(ValueError, match="e4m3"):
        fp8.policy_seams(eae_jax.DTypePolicy.from_name("fp8_e5m2"))


# ---------------------------------------------------------------------- block-level fallback
def _saturating_ffn(bound, layer):
    """States whose FFN input scale at ``layer`` is far too small: that call saturates."""
    scales = np.array(bound.state["ffn"].scales)
    scales[layer, 0] /= 1e4
    state = dict(bound.state)
    state["ffn"] = state["ffn"]._replace(scales=jnp.asarray(scales))
    return state


def _count_conditionals(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().as_text().count(" conditional(")


def test_block_fallback_without_failures_equals_seam_fallback(setup):
    cfg, params, x, bound = setup
    assert bound.fallback == "block"  # the default
    seam_mode = plain_stack(bound.with_fallback("seam").block_fn(), bound.params(params), x)
    block_mode = plain_stack(bound.with_fallback("block").block_fn(), bound.params(params), x)
    np.testing.assert_array_equal(np.asarray(block_mode.astype(jnp.float32)),
                                  np.asarray(seam_mode.astype(jnp.float32)))


@pytest.mark.parametrize("fallback", ["seam", "block"])
def test_saturating_seam_falls_back_at_its_granularity_under_reconstruct(setup, fallback):
    cfg, params, x, bound = setup
    bound = bound.with_fallback(fallback)
    layer = 1
    state = _saturating_ffn(bound, layer)
    ct = jax.random.normal(jax.random.key(7), x.shape)
    stack8 = eae_jax.reconstruct(bound.block_fn())

    def loss8(p):
        return jnp.mean(stack8(p, x).astype(jnp.float32) * ct)

    l8, g8 = jax.jit(jax.value_and_grad(loss8))(bound.params(params, state))
    new = bound.fold(state, g8["fp8"], notify=False)
    rep = {e["seam"]: e for e in bound.report(new)}
    assert rep[f"ffn[{layer}]"]["by_reason"] == {"saturation": 1}
    assert rep[f"ffn[{layer}]"]["consecutive"] == 1
    for name in ("qkv", "o"):
        e = rep[f"{name}[{layer}]"]
        if fallback == "block":
            assert e["by_reason"] == {"block": 1} and e["fp8_calls"] == 0
            assert e["consecutive"] == 0 and e["last_reason"] == "block"
        else:
            assert e["fallbacks"] == 0 and e["fp8_calls"] == 1
    for i in (0, 2):
        assert all(rep[f"{n}[{i}]"]["fp8_calls"] == 1 for n in ("qkv", "o", "ffn"))

    # The forward-returning variant (inference) counts the same.
    blk = bound.block_fn_with_ledger()
    _, incs = jax.jit(lambda p, x: jax.lax.scan(lambda h, pi: blk(pi, h), x, p))(bound.params(params, state), x)
    # (gradient scales come from a backward only)
    def counts(rep):
        return [{k: v for k, v in e.items() if not k.startswith("grad_")} for e in rep]
    assert counts(bound.report(bound.fold(state, incs, notify=False))) == counts(bound.report(new))
    # A call that ran fp8 observed its gradients; a fallen-back one did not.
    for e in bound.report(new):
        assert (min(e["grad_scales"]) > 0) == (e["fp8_calls"] == 1), e

    # Block-level: layer 1 is the high-precision block, bit for bit, in the
    # forward and in its gradients (the other layers stay fp8 in both runs).
    if fallback == "block":
        hp_layer = {n: s for n, s in state.items()}
        for n in hp_layer:
            det = np.array(hp_layer[n].ledger.detached)
            det[layer] = 1.0
            hp_layer[n] = hp_layer[n]._replace(ledger=hp_layer[n].ledger._replace(detached=jnp.asarray(det)))
        l_ref, g_ref = jax.jit(jax.value_and_grad(loss8))(bound.params(params, hp_layer))
        assert float(l8) == float(l_ref)
        for a, b in zip(jax.tree_util.tree_leaves(g8["params"]), jax.tree_util.tree_leaves(g_ref["params"])):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_block_fallback_takes_two_conditionals_per_layer(setup):
    cfg, params, x, bound = setup
    ct = jax.random.normal(jax.random.key(7), x.shape)

    def step_of(b):
        stack8 = eae_jax.reconstruct(b.block_fn())
        return jax.grad(lambda p: jnp.mean(stack8(p, x).astype(jnp.float32) * ct))

    p = bound.params(params)
    per_seam = _count_conditionals(step_of(bound.with_fallback("seam")), p)
    per_block = _count_conditionals(step_of(bound.with_fallback("block")), p)
    # One cond per decision in the forward scan body and one in the reverse
    # scan body, where the recomputation's cond is dead code (seams.decide_once)
    # unless its output feeds the rest of the block: per seam, qkv's and o's
    # do (3 forward + 2 recomputed + 3 backward).
    assert per_block == 2 and per_seam == 8
    assert _count_conditionals(step_of(bound.with_fallback("step")), p) == 0


def test_step_fallback_decides_once_per_step_from_the_counts(setup):
    """fallback='step': every call runs fp8 (no cond) and counts its own
    outcome; fold_step flags the step when any call failed and then counts
    every other call of the step with reason 'step'."""
    cfg, params, x, bound = setup
    bound = bound.with_fallback("step")
    ct = jax.random.normal(jax.random.key(7), x.shape)
    stack8 = eae_jax.reconstruct(bound.block_fn())

    def run(state):
        g = jax.jit(jax.grad(lambda p: jnp.mean(stack8(p, x).astype(jnp.float32) * ct)))(bound.params(params, state))
        return bound.fold_step(state, g["fp8"], notify=False)

    clean, bad = run(bound.state)
    assert not bool(bad)
    assert all(e["fp8_calls"] == 1 and e["fallbacks"] == 0 for e in bound.report(clean))
    layer = 1
    new, bad = run(_saturating_ffn(bound, layer))
    assert bool(bad)
    rep = {e["seam"]: e for e in bound.report(new)}
    assert rep[f"ffn[{layer}]"]["by_reason"] == {"saturation": 1} and rep[f"ffn[{layer}]"]["consecutive"] == 1
    others = [e for name, e in rep.items() if name != f"ffn[{layer}]"]
    assert len(others) == 3 * DEPTH - 1
    assert all(e["by_reason"] == {"step": 1} and e["fp8_calls"] == 0 and e["consecutive"] == 0 for e in others)
    # A dropped step's gradient observations are not kept.
    assert all(min(e["grad_scales"]) == 0 for e in rep.values())


def _cond_operands(jaxpr):
    """Avals of every operand of every ``cond`` in a jaxpr, nested ones included."""
    return [v.aval for eqn in all_eqns(jaxpr) if eqn.primitive.name == "cond" for v in eqn.invars[1:]]


@pytest.mark.parametrize("fallback", ["seam", "block"])
def test_attempt_residuals_never_enter_a_cond(fallback):
    # Operands of a cond are materialised: the attempt's autodiff residuals
    # (float32 norm and SwiGLU intermediates) must stay outside it, so only
    # gradients, weights, seam inputs and outputs in the activation dtype,
    # cotangents and scalars cross. The FFN width differs from every
    # projection width so that a SwiGLU residual cannot pass for one.
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=160, compute_dtype="bf16")
    params = init_stack(jax.random.key(0), cfg, 2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64)).astype(jnp.bfloat16)
    bound = fp8.bind_block(cfg, params, [x], fallback=fallback)
    stack8 = eae_jax.reconstruct(bound.block_fn())
    ct = jax.random.normal(jax.random.key(7), x.shape)
    step = jax.grad(lambda q: jnp.mean(stack8(q, x).astype(jnp.float32) * ct))
    operands = _cond_operands(jax.make_jaxpr(step)(bound.params(params)).jaxpr)
    assert operands
    weights = {leaf.shape[1:] for leaf in jax.tree_util.tree_leaves(params)}
    qkv = cfg.dim + 2 * (cfg.dim // cfg.num_heads) * cfg.num_kv_heads
    activations = {(*lead, w) for lead in (x.shape[:-1], (x.shape[0] * x.shape[1],)) for w in (cfg.dim, qkv)}
    hidden = [a for a in operands
              if not (a.shape in weights or a.shape == () or (a.shape in activations and a.dtype == x.dtype))]
    assert not hidden, f"attempt residuals inside a cond: {sorted({(a.shape, str(a.dtype)) for a in hidden})}"


def test_block_reason_never_detaches_an_innocent_seam():
    ledger = fp8.init_ledger(1)
    block = fp8.ledger.increments(jnp.int32(fp8.ledger.BLOCK_REASON), jnp.ones((1,)))
    own = fp8.ledger.increments(jnp.int32(fp8.REASONS.index("saturation")), jnp.ones((1,)))
    innocent, guilty = ledger, ledger
    for _ in range(5):
        innocent = fp8.fold(innocent, block, detach_after=3)
        guilty = fp8.fold(guilty, own, detach_after=3)
    assert float(innocent.consecutive) == 0 and float(innocent.detached) == 0
    assert float(innocent.calls) == 5 and float(innocent.fp8_calls) == 0
    assert float(guilty.consecutive) == 5 and float(guilty.detached) == 1


def test_unknown_fallback_granularity_is_named(setup):
    cfg, params, x, bound = setup
    with pytest.raises(ValueError, match="unknown fallback granularity 'layer'"):
        bound.with_fallback("layer")
    with pytest.raises(ValueError, match="expected one of \\('seam', 'block', 'step'\\)"):
        fp8.fp8_block(cfg, bound.seams, fallback="layer")


@pytest.mark.parametrize("seams,expected", [("ffn", ["ffn"]), (("o", "ffn"), ["o", "ffn"]), (["qkv"], ["qkv"])])
def test_bind_block_takes_seam_names(setup, seams, expected):
    cfg, params, x, _ = setup
    bound = fp8.bind_block(cfg, params, [x], seams, gate_cos=0)
    assert list(bound.seams) == expected and set(bound.certification) == set(expected)


@pytest.mark.parametrize("seams,match", [
    (("ffn", "mlp"), "unknown block seam\(s\) \['mlp'\]"),
    ({"attn": fp8.ffn_seam()}, "unknown block seam\(s\) \['attn'\]"),
    ({"ffn": "ffn"}, "not Seam objects"),
    ((1, 2), "seam names or a dict"),
])
def test_bind_block_names_bad_seams(setup, seams, match):
    cfg, params, x, _ = setup
    with pytest.raises(ValueError, match=match):
        fp8.bind_block(cfg, params, [x], seams)


def test_block_fallback_vjp_is_autodiff_on_both_branches(setup):
    cfg, params, x, bound = setup
    one = jax.tree_util.tree_map(lambda a: a[0], params)
    state = jax.tree_util.tree_map(lambda a: a[0], bound.state)
    ct = jax.random.normal(jax.random.key(9), x.shape)

    def grads(block, p_of):
        return jax.jit(jax.grad(lambda p, xx: jnp.sum(block(p_of(p), xx).astype(jnp.float32) * ct),
                                argnums=(0, 1)))(one, x)

    blk = bound.with_fallback("block").block_fn()
    # Nothing fails: the fp8 branch's VJP is autodiff through the seams (the per-seam block).
    got = grads(blk, lambda p: {"params": p, "fp8": state})
    want = grads(bound.block_fn(), lambda p: {"params": p, "fp8": state})
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-9)
    # Every seam detached: the high-precision branch's VJP is autodiff of the plain block.
    got = grads(blk, lambda p: {"params": p, "fp8": _detached(state)})
    want = grads(decoder_block(cfg), lambda p: p)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-9)
