"""eae_jax.fp8.block: decoder blocks with fp8 seams. The high-precision path
is the plain block bit for bit; per-layer gating and calibration (and its
refusals); exact counts per layer under reconstruct and scan; block and step
fallbacks; gradients against bf16 and the branch that ran; gradient and
weight scaling across steps; weights cast once per step; states that donate."""

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
CFG = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128, compute_dtype="bf16", rope_style="half")


@pytest.fixture(scope="module")
def setup():
    params = init_stack(jax.random.key(0), CFG, DEPTH)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64)).astype(jnp.bfloat16)
    cal = jax.random.normal(jax.random.key(2), (2, 16, 64)).astype(jnp.bfloat16)
    return CFG, params, x, fp8.bind_block(CFG, params, [cal, x])


def _detached(state, layers=None):
    def one(s):
        det = np.ones(s.ledger.detached.shape, np.float32) if layers is None else \
            np.isin(np.arange(s.ledger.detached.shape[0]), layers).astype(np.float32)
        return s._replace(ledger=s.ledger._replace(detached=jnp.asarray(det)))
    return {n: one(s) for n, s in state.items()}


def _saturating(state, layer, seam="ffn", by=1e4):
    """States whose ``seam`` input scale at ``layer`` is far too small: that call saturates."""
    s = state[seam]
    return {**state, seam: s._replace(scales=s.scales.at[layer, 0].set(s.scales[layer, 0] / by))}


def _loss_grad(bound, x, ct=None):
    stack = eae_jax.reconstruct(bound.block_fn())
    ct = jax.random.normal(jax.random.key(7), x.shape) if ct is None else ct
    return jax.jit(jax.value_and_grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32) * ct)))


def test_high_precision_path_is_the_plain_block_bit_for_bit(setup):
    cfg, params, x, bound = setup
    ref = jax.jit(lambda p, x: plain_stack(decoder_block(cfg), p, x))(params, x)
    got = jax.jit(lambda p, x: plain_stack(bound.block_fn(), p, x))(bound.params(params, _detached(bound.state)), x)
    chex.assert_trees_all_equal(got, ref)
    none = fp8.fp8_block(cfg, {})  # a block with no seams at all is the plain block too
    chex.assert_trees_all_equal(plain_stack(none, {"params": params, "fp8": {}}, x), ref)


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


def test_gate_names_the_failing_seam_and_layer_and_holds_at_its_threshold(setup):
    cfg, params, x, bound = setup
    broken = np.array(bound.certification["ffn"]["scales"], np.float32)
    broken[1] /= 300.0
    with pytest.raises(fp8.GateRefused, match="ffn at layer 1") as info:
        fp8.bind_block(cfg, params, [x], scales={"ffn": broken})
    assert "layer 0" not in str(info.value) and info.value.worst < 0.999
    one = fp8.bind_block(cfg, params, [x], "ffn", gate_cos=0)
    worst = one.certification["ffn"]["worst_cos"]
    assert worst < 1.0
    fp8.bind_block(cfg, params, [x], "ffn", gate_cos=worst)  # at equality: passes
    with pytest.raises(fp8.GateRefused, match="ffn at layer"):
        fp8.bind_block(cfg, params, [x], "ffn", gate_cos=float(np.nextafter(worst, 2.0)))
    with pytest.raises(ValueError, match="gate_cos must be in"):
        fp8.bind_block(cfg, params, [x], "ffn", gate_cos=1.5)


@pytest.mark.parametrize("inputs, match", [
    ([jnp.zeros((0, 16, 64), jnp.bfloat16)], r"calibration input 0 of shape \(0, 16, 64\) is empty"),
    ([jnp.zeros((2, 16, 64), jnp.bfloat16)], "seam 'qkv' at layer 0: calibration input 0 gives a zero amax at the "
                                             "seam input .*non-empty, non-zero"),
    ([jnp.full((2, 16, 64), jnp.nan, jnp.bfloat16)], "gives a non-finite amax"),
    ([], "at least one calibration input"),
    (lambda x: [x[0]], r"expected \(batch, seq, 64\)"),
])
def test_bind_block_names_calibration_it_cannot_use(setup, inputs, match):
    cfg, params, x, _ = setup
    with pytest.raises(ValueError, match=match):
        fp8.bind_block(cfg, params, inputs(x) if callable(inputs) else inputs)


@pytest.mark.parametrize("seams,match", [
    (("ffn", "mlp"), r"unknown block seam\(s\) \['mlp'\]"),
    ({"attn": fp8.ffn_seam()}, r"unknown block seam\(s\) \['attn'\]"),
    ({"ffn": "ffn"}, "not Seam objects"),
    ((1, 2), "seam names or a dict"),
])
def test_bind_block_names_bad_seams(setup, seams, match):
    cfg, params, x, _ = setup
    with pytest.raises(ValueError, match=match):
        fp8.bind_block(cfg, params, [x], seams)
    with pytest.raises(ValueError, match="unknown seam"):
        fp8.bind_block(cfg, params, [x], scales={"mlp": np.ones(2)}, gate_cos=0)


@pytest.mark.parametrize("seams,expected", [("ffn", ["ffn"]), (("o", "ffn"), ["o", "ffn"]), (["qkv"], ["qkv"])])
def test_bind_block_takes_seam_names(setup, seams, expected):
    cfg, params, x, _ = setup
    bound = fp8.bind_block(cfg, params, [x], seams, gate_cos=0)
    assert list(bound.seams) == expected and set(bound.certification) == set(expected)


def test_policy_seams():
    assert fp8.policy_seams(eae_jax.DTypePolicy.from_name("bf16")) == {}
    assert list(fp8.policy_seams(eae_jax.DTypePolicy.from_name("fp8_e4m3"), ("ffn",))) == ["ffn"]
    with pytest.raises(ValueError, match="e4m3"):
        fp8.policy_seams(eae_jax.DTypePolicy.from_name("fp8_e5m2"))


def test_block_rejects_bad_params_and_fallbacks(setup):
    cfg, params, x, bound = setup
    blk, one = bound.block_fn(), jax.tree_util.tree_map(lambda a: a[0], params)
    with pytest.raises(ValueError, match="'params'"):
        blk(one, x)
    with pytest.raises(ValueError, match="no state for seam"):
        blk({"params": one, "fp8": {}}, x)
    with pytest.raises(ValueError, match="unknown fallback granularity 'seam'"):
        bound.with_fallback("seam")
    with pytest.raises(ValueError, match=r"expected one of \('block', 'step'\)"):
        fp8.fp8_block(cfg, bound.seams, fallback="layer")


# ---------------------------------------------------------------------- gradients
def test_reconstruct_train_step_matches_bf16_gradients(setup):
    cfg, params, x, bound = setup
    ct = jax.random.normal(jax.random.key(5), x.shape)
    l8, g8 = _loss_grad(bound, x, ct)(bound.params(params))
    stack = eae_jax.reconstruct(decoder_block(cfg))
    l, g = jax.jit(jax.value_and_grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32) * ct)))(params)
    assert abs(float(l8) - float(l)) < 0.02 * abs(float(l)) + 1e-4
    flat = lambda t: jnp.concatenate([a.ravel() for a in jax.tree_util.tree_leaves(t)])
    assert float(fp8.cosine(flat(g8["params"]), flat(g))) > 0.99
    for leaf8, leaf in zip(jax.tree_util.tree_leaves(g8["params"]), jax.tree_util.tree_leaves(g)):
        assert float(fp8.cosine(leaf8, leaf)) > 0.97
    assert all(e["calls"] == 1 and e["fp8_calls"] == 1 for e in bound.report(bound.fold(bound.state, g8["fp8"],
                                                                                        notify=False)))


def test_block_fallback_vjp_is_autodiff_on_both_branches():
    # float32, so that no bf16 rounding of differently fused programs blurs "the same gradient"
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128, rope_style="half")
    params = init_stack(jax.random.key(0), cfg, 1)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    bound = fp8.bind_block(cfg, params, [x], gate_cos=0)
    one = jax.tree_util.tree_map(lambda a: a[0], params)
    state = jax.tree_util.tree_map(lambda a: a[0], bound.state)
    ct = jax.random.normal(jax.random.key(9), x.shape)

    def grads(block, p_of):
        return jax.jit(jax.grad(lambda p, xx: jnp.sum(block(p_of(p), xx).astype(jnp.float32) * ct),
                                argnums=(0, 1)))(one, x)

    # Nothing fails: the cond passes the fp8 attempt's VJP, the step guard's (no cond) autodiff.
    got = grads(bound.block_fn(), lambda p: {"params": p, "fp8": state})
    chex.assert_trees_all_close(got, grads(bound.with_fallback("step").block_fn(),
                                           lambda p: {"params": p, "fp8": state}), rtol=1e-6, atol=1e-9)
    # Every seam detached: the high-precision branch's VJP is autodiff of the plain block.
    hp = grads(decoder_block(cfg), lambda p: p)
    chex.assert_trees_all_close(grads(bound.block_fn(), lambda p: {"params": p, "fp8": _detached(state)}), hp,
                                rtol=1e-6, atol=1e-9)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                            jax.tree_util.tree_leaves(hp))) > 1e-4  # fp8 differs


def test_block_and_step_outputs_agree_without_failures(setup):
    cfg, params, x, bound = setup
    outs = [plain_stack(bound.with_fallback(f).block_fn(), bound.params(params), x) for f in fp8.FALLBACKS]
    chex.assert_trees_all_equal(*outs)


# ---------------------------------------------------------------------- counts and fallbacks
@pytest.mark.parametrize("fallback", ["block", "step"])
@pytest.mark.parametrize("engine", ["reconstruct", "reconstruct_dots", "scan_grad"])
def test_counts_exact_per_layer_across_steps(setup, engine, fallback):
    cfg, params, x, bound = setup
    bound = bound.with_fallback(fallback)
    blk = bound.block_fn()
    apply = (lambda p, x: plain_stack(blk, p, x)) if engine == "scan_grad" else \
        eae_jax.reconstruct(blk, policy="dots" if engine == "reconstruct_dots" else None)

    @jax.jit
    def step(p, x):
        g = jax.grad(lambda p, x: jnp.mean(apply(p, x).astype(jnp.float32) ** 2))(p, x)
        return bound.fold(p["fp8"], g["fp8"], notify=False)

    state = _saturating(bound.state, 1, by=1e3)
    steps = 3
    for _ in range(steps):
        state = step(bound.params(params, state), x)
    rep = {e["seam"]: e for e in bound.report(state)}
    for seam in ("qkv", "o", "ffn"):
        for layer in range(DEPTH):
            e = rep[f"{seam}[{layer}]"]
            assert e["calls"] == steps  # forward + recomputation, counted once
            broken = seam == "ffn" and layer == 1
            # block: the broken seam's block mates fall back with it, counted as 'block';
            # step (folded as one, not per step here): each seam counts its own outcome
            mate = fallback == "block" and layer == 1 and not broken
            assert e["fallbacks"] == (steps if broken or mate else 0), e
            assert e["by_reason"] == ({"saturation": steps} if broken else {"block": steps} if mate else {}), e
            assert e["consecutive"] == (steps if broken else 0)


def test_saturating_seam_falls_back_with_its_block_under_reconstruct(setup):
    cfg, params, x, bound = setup
    layer, state = 1, _saturating(bound.state, 1)
    l8, g8 = _loss_grad(bound, x)(bound.params(params, state))
    new = bound.fold(state, g8["fp8"], notify=False)
    rep = {e["seam"]: e for e in bound.report(new)}
    assert rep[f"ffn[{layer}]"]["by_reason"] == {"saturation": 1} and rep[f"ffn[{layer}]"]["consecutive"] == 1
    for name in ("qkv", "o"):
        e = rep[f"{name}[{layer}]"]
        assert e["by_reason"] == {"block": 1} and e["fp8_calls"] == 0 and e["consecutive"] == 0
    for i in (0, 2):
        assert all(rep[f"{n}[{i}]"]["fp8_calls"] == 1 for n in ("qkv", "o", "ffn"))
    # a call that ran fp8 observed its gradients; a fallen-back one did not
    for e in bound.report(new):
        assert (min(e["grad_scales"]) > 0) == (e["fp8_calls"] == 1), e
    # The forward-returning variant (inference) counts the same.
    blk = bound.block_fn_with_ledger()
    _, obs = jax.jit(lambda p, x: jax.lax.scan(lambda h, pi: blk(pi, h), x, p))(bound.params(params, state), x)
    counts = lambda rep: [{k: v for k, v in e.items() if not k.startswith("grad_")} for e in rep]
    assert counts(bound.report(bound.fold(state, obs, notify=False))) == counts(bound.report(new))
    # Layer 1 is the high-precision block, bit for bit, forward and gradients.
    l_ref, g_ref = _loss_grad(bound, x)(bound.params(params, _detached(state, [layer])))
    assert float(l8) == float(l_ref)
    chex.assert_trees_all_equal(g8["params"], g_ref["params"])


def test_step_fallback_decides_once_per_step_from_the_counts(setup):
    """fallback='step': every call runs fp8 (no cond) and counts its own
    outcome; fold_step flags the step when any call failed, counts every other
    call with reason 'step', and drops the step's gradient observations."""
    cfg, params, x, bound = setup
    bound = bound.with_fallback("step")
    run = lambda state: bound.fold_step(state, _loss_grad(bound, x)(bound.params(params, state))[1]["fp8"],
                                        notify=False)
    clean, bad = run(bound.state)
    assert not bool(bad) and all(e["fp8_calls"] == 1 and e["fallbacks"] == 0 for e in bound.report(clean))
    new, bad = run(_saturating(bound.state, 1))
    assert bool(bad)
    rep = {e["seam"]: e for e in bound.report(new)}
    assert rep["ffn[1]"]["by_reason"] == {"saturation": 1} and rep["ffn[1]"]["consecutive"] == 1
    others = [e for name, e in rep.items() if name != "ffn[1]"]
    assert len(others) == 3 * DEPTH - 1
    assert all(e["by_reason"] == {"step": 1} and e["fp8_calls"] == 0 and e["consecutive"] == 0 for e in others)
    assert all(min(e["grad_scales"]) == 0 for e in rep.values())


def test_detach_after_n_consecutive_and_warn_once(setup):
    cfg, params, x, bound = setup
    bound = bound.with_recipe(detach_after=3)
    stack = eae_jax.reconstruct(bound.block_fn())

    @jax.jit
    def step(p, x):
        g = jax.grad(lambda p, x: jnp.mean(stack(p, x).astype(jnp.float32) ** 2))(p, x)
        return bound.fold(p["fp8"], g["fp8"])

    state = _saturating(bound.state, 0, by=1e3)
    with pytest.warns(fp8.Fp8FallbackWarning) as record:
        for i in range(5):
            state = step(bound.params(params, state), x)
            jax.effects_barrier()
            assert {r["seam"]: r for r in bound.report(state)}["ffn[0]"]["detached"] == (i >= 2)
    messages = [str(w.message) for w in record if issubclass(w.category, fp8.Fp8FallbackWarning)]
    assert sum("fell back to high precision (saturation)" in m for m in messages) == 1
    assert sum("detached itself" in m for m in messages) == 1
    e = {r["seam"]: r for r in bound.report(state)}
    assert e["ffn[0]"]["by_reason"] == {"saturation": 3, "detached": 2}
    assert e["ffn[0]"]["last_reason"] == "detached" and e["ffn[0]"]["calls"] == 5
    assert not e["ffn[1]"]["detached"] and e["ffn[1]"]["fallbacks"] == 0 and e["ffn[1]"]["calls"] == 5


def test_block_fallback_takes_two_conditionals_per_layer(setup):
    cfg, params, x, bound = setup
    ct = jax.random.normal(jax.random.key(7), x.shape)

    def conds(b):
        stack8 = eae_jax.reconstruct(b.block_fn())
        step = jax.grad(lambda p: jnp.mean(stack8(p, x).astype(jnp.float32) * ct))
        return jax.jit(step).lower(bound.params(params)).compile().as_text().count(" conditional(")

    # one cond per decision in the forward scan body and one in the reverse
    # scan body, where the recomputation's cond is dead code (seams._decide_once)
    assert conds(bound) == 2 and conds(bound.with_fallback("step")) == 0


def test_attempt_residuals_never_enter_a_cond():
    # Operands of a cond are materialised: the attempt's autodiff residuals
    # (float32 norm and SwiGLU intermediates) must stay outside it. The FFN
    # width differs from every projection width so that a SwiGLU residual
    # cannot pass for one.
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=160, compute_dtype="bf16")
    params = init_stack(jax.random.key(0), cfg, 2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64)).astype(jnp.bfloat16)
    bound = fp8.bind_block(cfg, params, [x])
    stack8 = eae_jax.reconstruct(bound.block_fn())
    ct = jax.random.normal(jax.random.key(7), x.shape)
    step = jax.grad(lambda q: jnp.mean(stack8(q, x).astype(jnp.float32) * ct))
    operands = [v.aval for e in all_eqns(jax.make_jaxpr(step)(bound.params(params)).jaxpr)
                if e.primitive.name == "cond" for v in e.invars[1:]]
    assert operands
    weights = {leaf.shape[1:] for leaf in jax.tree_util.tree_leaves(params)}
    qkv = cfg.dim + 2 * (cfg.dim // cfg.num_heads) * cfg.num_kv_heads
    activations = {(*lead, w) for lead in (x.shape[:-1], (x.shape[0] * x.shape[1],)) for w in (cfg.dim, qkv)}
    hidden = [a for a in operands
              if not (a.shape in weights or a.shape == () or (a.shape in activations and a.dtype == x.dtype))]
    assert not hidden, f"attempt residuals inside a cond: {sorted({(a.shape, str(a.dtype)) for a in hidden})}"


# ---------------------------------------------------------------------- gradient and weight scaling over steps
_STEPS = {}


def _sgd_steps(bound, params, x, ct, steps, cast=False, grow=1.0):
    """``steps`` reconstruct SGD steps (folded per the bound fallback); returns
    (params, state, grads). Compiled once per seams / fallback / variant."""
    key = (bound.cfg, tuple(bound.seams.items()), bound.fallback, cast, grow, x.shape)
    if key not in _STEPS:
        stack = eae_jax.reconstruct(bound.block_fn())

        @jax.jit
        def step(params, state, x, ct):
            used = bound.cast_weights(state, params) if cast else state
            g = jax.grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32) * ct))(bound.params(params, used))
            new = bound.fold_step(used, g["fp8"], notify=False)[0] if bound.fallback == "step" else \
                bound.fold(used, g["fp8"], notify=False)
            return jax.tree_util.tree_map(lambda p, d: grow * p - 0.5 * d, params, g["params"]), new, g["params"]

        _STEPS[key] = step
    state, grads = bound.state, []
    for _ in range(steps):
        params, state, g = _STEPS[key](params, state, x, ct)
        grads.append(g)
    return params, state, grads


def test_two_phase_gradient_scaling_under_reconstruct():
    """What a train loop does: a current-scaling step records every seam's and
    layer's gradient scales, then delayed steps use them; counts stay exact
    and gradients close to the current-scaling ones."""
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128)
    params = init_stack(jax.random.key(0), cfg, 2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    bound = fp8.bind_block(cfg, params, [x])
    delayed = bound.with_recipe(gradient="delayed")
    with pytest.raises(ValueError, match=r"seam 'qkv': gradient scales never observed at \(0, 0\), \(1, 0\)"):
        delayed.require_grad_scales(bound.state)
    _, state, (g_cur,) = _sgd_steps(bound, params, x, ct, 1)
    delayed.require_grad_scales(state)
    _, state2, (g_del,) = _sgd_steps(fp8.BoundBlock(cfg, delayed.seams, state, bound.certification), params, x, ct, 1)
    for a, b in zip(jax.tree_util.tree_leaves(g_del), jax.tree_util.tree_leaves(g_cur)):
        assert float(fp8.cosine(a, b)) > 0.995
    rep = delayed.report(state2)
    assert len(rep) == 3 * 2 and all(e["calls"] == 2 and e["fp8_calls"] == 2 and not any(e["grad_clipped"])
                                     for e in rep)
    with pytest.raises(ValueError, match="unknown gradient scaling 'sometimes'"):
        bound.with_recipe(gradient="sometimes")


@pytest.mark.parametrize("fallback", ["block", "step"])
def test_delayed_weights_track_the_weights_over_steps(fallback):
    """Two SGD steps with delayed weight scales: every layer's scales follow its
    weights (the recomputation observes once) and counts are exact; the first
    step equals the live per-tensor weight at the weights' own amax, which is
    what bind starts from."""
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128)
    params = init_stack(jax.random.key(0), cfg, 2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    bound = fp8.bind_block(cfg, params, [x], fp8.block_seams(weight="delayed"), fallback=fallback)
    amax = lambda *ws: max(float(np.abs(np.asarray(w, np.float64)).max()) for w in ws)
    for layer in range(2):
        lp = jax.tree_util.tree_map(lambda a: a[layer], params)
        np.testing.assert_allclose(np.asarray(bound.state["ffn"].weight_scales[layer]),
                                   [amax(lp["ffn"]["w_gate"], lp["ffn"]["w_up"]) / 448, amax(lp["ffn"]["w_down"]) / 448],
                                   rtol=1e-6)
    params2, state, _ = _sgd_steps(bound, params, x, ct, 1)
    params3, state, _ = _sgd_steps(fp8.BoundBlock(cfg, bound.seams, state, bound.certification, fallback=fallback),
                                   params2, x, ct, 1)
    for layer in range(2):
        lp = jax.tree_util.tree_map(lambda a: a[layer], params2)
        np.testing.assert_allclose(np.asarray(state["ffn"].weight_scales[layer]),
                                   [amax(lp["ffn"]["w_gate"], lp["ffn"]["w_up"]) / 448, amax(lp["ffn"]["w_down"]) / 448],
                                   rtol=1e-6)
        np.testing.assert_allclose(float(state["qkv"].weight_scales[layer, 0]),
                                   amax(lp["attn"]["wq"], lp["attn"]["wk"], lp["attn"]["wv"]) / 448, rtol=1e-6)
    assert all(e["calls"] == 2 and e["fp8_calls"] == 2 for e in bound.report(state))


def test_step_guard_drops_the_weight_observations_of_a_rejected_step():
    cfg = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128)
    params = init_stack(jax.random.key(0), cfg, 2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    bound = fp8.bind_block(cfg, params, [x], fp8.block_seams(weight="delayed"), fallback="step")
    stack = eae_jax.reconstruct(bound.block_fn())
    smaller = jax.tree_util.tree_map(lambda a: a * 0.5, params)  # activations stay inside their static scales
    grads = lambda xin: jax.jit(jax.grad(lambda p: jnp.sum(stack(p, xin))))(bound.params(smaller))["fp8"]
    good, bad = bound.fold_step(bound.state, grads(x), notify=False)
    assert not bool(bad)
    np.testing.assert_allclose(np.asarray(good["ffn"].weight_scales), 0.5 * np.asarray(bound.state["ffn"].weight_scales),
                               rtol=1e-6)
    dropped, bad = bound.fold_step(bound.state, grads(x.at[0, 0, 0].set(jnp.nan)), notify=False)
    assert bool(bad)
    for n in bound.seams:
        chex.assert_trees_all_equal(dropped[n].weight_scales, bound.state[n].weight_scales)


# ---------------------------------------------------------------------- weights cast once per step
def _cast_bound(fallback, saturation_threshold=1e-3):
    params = init_stack(jax.random.key(0), CFG, 2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64)).astype(jnp.bfloat16)
    seams = fp8.block_seams(weight="delayed", saturation_threshold=saturation_threshold)
    return fp8.bind_block(CFG, params, [x], seams, fallback=fallback, gate_cos=0), params, x


@pytest.mark.parametrize("fallback,saturation_threshold", [("step", 0.5), ("block", 0.5), ("block", 1e-3)])
def test_training_with_weights_cast_per_step_matches_uncast_training(fallback, saturation_threshold):
    """Three steps whose weights grow 10% a step, casting the weights at the
    start of every step or not: params and states equal bit for bit. With a
    lax threshold the weights outgrow their delayed scales (saturated bytes);
    with the default one the growing activations make calls fall back."""
    bound, params, x = _cast_bound(fallback, saturation_threshold)
    ct = jax.random.normal(jax.random.key(2), x.shape)
    runs = {cast: _sgd_steps(bound, params, x, ct, 3, cast=cast, grow=1.1)[:2] for cast in (False, True)}
    chex.assert_trees_all_equal(runs[False], runs[True])
    state = runs[True][1]
    assert all(st.cast is None for st in state.values())
    rep = bound.report(state)
    assert all(e["calls"] == 3 for e in rep)
    if saturation_threshold == 0.5:
        assert sum(e["fallbacks"] for e in rep) == 0
        assert sum(sum(e["weight_clipped"]) for e in rep) > 0, "the weights were meant to outgrow their scales"
    else:
        assert sum(e["fallbacks"] for e in rep) > 0, "the activations were meant to saturate"


def test_a_step_given_cast_weights_quantizes_no_weight():
    import re

    bound, params, x = _cast_bound("step")
    stack = eae_jax.reconstruct(bound.block_fn())
    grad = jax.jit(jax.grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32))))
    shapes = {(256, 64), (64, 128), (128, 64), (64, 64)}  # gate|up, down, q|k|v, o

    def converts(text):  # converts to e4m3 that produce a weight-shaped array
        return sum((int(a), int(b)) in shapes for a, b in
                   re.findall(r"stablehlo\.convert[^\n]*-> tensor<(\d+)x(\d+)xf8E4M3FN>", text))

    # uncast: every GEMM's weight is quantized in the forward and again in the recomputation
    assert converts(grad.lower(bound.params(params)).as_text()) >= 8
    assert converts(grad.lower(bound.params(params, bound.cast_weights(bound.state, params))).as_text()) == 0


def test_cast_weights_checks_depth_and_keeps_other_seams():
    bound, params, _ = _cast_bound("step")
    with pytest.raises(ValueError, match="params have 3 layer"):
        bound.cast_weights(bound.state, init_stack(jax.random.key(3), CFG, 3))
    mixed = fp8.BoundBlock(bound.cfg, {**bound.seams, "ffn": bound.seams["ffn"].replace(weight="channel")},
                           bound.state, bound.certification)
    cast = mixed.cast_weights(mixed.state, params)
    assert cast["ffn"].cast is None and cast["qkv"].cast.q[0].shape == (2, 128, 64)
    with pytest.raises(ValueError, match="pass the stacked block params"):
        fp8.init_block_state(fp8.block_seams(weight="delayed"), 2)


# ---------------------------------------------------------------------- buffers
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # cast bytes: fold drops them
@pytest.mark.parametrize("fallback,weight", [("block", "channel"), ("step", "delayed")])
def test_block_state_donates(setup, fallback, weight):
    """Every seam state of a bound (or freshly initialised) block holds its own
    buffers: a step donating it runs, twice."""
    cfg, params, x, _ = setup
    bound = fp8.bind_block(cfg, params, [x], fp8.block_seams(weight=weight, activation="delayed"), gate_cos=0,
                           fallback=fallback)
    stack = eae_jax.reconstruct(bound.block_fn())

    def step(state, params):
        used = bound.cast_weights(state, params) if weight == "delayed" else state
        g = jax.grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32) ** 2))(bound.params(params, used))
        return bound.fold_step(used, g["fp8"], notify=False)[0] if fallback == "step" else \
            bound.fold(used, g["fp8"], notify=False)

    step = jax.jit(step, donate_argnums=(0,))
    for state in (bound.state, fp8.init_block_state(bound.seams, DEPTH, params=params)):
        leaves = jax.tree_util.tree_leaves(state)
        assert len({id(a) for a in leaves}) == len(leaves)
        state = step(step(state, params), params)
        assert all(e["calls"] == 2 for e in bound.report(state))
