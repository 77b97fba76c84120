"""The ledger: exact counts under jit / grad / checkpoint / scan / reconstruct,
detaching, warn-once, report."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import fp8
from eae_jax.blocks import BlockConfig, init_stack, init_swiglu, plain_stack, rms_norm
from eae_jax.fp8 import ledger as L

D, F, ROWS = 32, 64, 16


@pytest.fixture(scope="module")
def ffn():
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(0), D, F))
    xs = jax.random.normal(jax.random.key(1), (2, ROWS, D))
    hs = rms_norm({"scale": jnp.ones((D,))}, xs).astype(jnp.bfloat16)
    return p, hs, fp8.bind(fp8.ffn_seam(), p, [hs[0], hs[1]], gate_cos=0)


def _loss(bound):
    def loss(p, state, x):
        return jnp.sum(bound(state, p, x).astype(jnp.float32) ** 2)

    return loss


def test_counts_via_cotangent_under_jit_grad(ffn):
    p, hs, bound = ffn
    step = jax.jit(jax.grad(_loss(bound), argnums=1))
    state = bound.state
    for i in range(4):
        x = hs[1] * 50.0 if i == 2 else hs[1]  # one saturating call
        state = fp8.fold_state(bound.seam, state, step(p, state, x))
    e = bound.report(state)[0]
    assert (e["calls"], e["fp8_calls"], e["fallbacks"]) == (4, 3, 1)
    assert e["by_reason"] == {"saturation": 1} and e["last_reason"] == "saturation"
    assert e["consecutive"] == 0 and not e["detached"]


def test_checkpoint_recomputation_does_not_double_count(ffn):
    p, hs, bound = ffn
    remat = jax.checkpoint(lambda p, s, x: bound(s, p, x))
    g = jax.jit(jax.grad(lambda p, s, x: jnp.sum(remat(p, s, x).astype(jnp.float32)), argnums=1))(p, bound.state, hs[1])
    assert float(g.ledger.calls) == 1.0 and float(g.ledger.fp8_calls) == 1.0
    assert float(jnp.sum(g.scales ** 2)) == 0.0  # scales are not trained


def test_one_state_used_twice_counts_twice(ffn):
    p, hs, bound = ffn

    def loss(p, s, x):
        return jnp.sum(bound(s, p, x).astype(jnp.float32)) + jnp.sum(bound(s, p, x * 50.0).astype(jnp.float32))

    g = jax.jit(jax.grad(loss, argnums=1))(p, bound.state, hs[1])
    new = fp8.fold_state(bound.seam, bound.state, g)
    e = bound.report(new)[0]
    assert (e["calls"], e["fp8_calls"], e["by_reason"]) == (2, 1, {"saturation": 1})
    assert e["consecutive"] == 0  # a step mixing fp8 and fallback resets the run (documented, conservative)


def test_forward_variant_increments(ffn):
    p, hs, bound = ffn
    fn = jax.jit(bound.apply_with_ledger)
    state = bound.state
    for x in (hs[0], hs[1].at[0, 0].set(jnp.nan), hs[1]):
        _, inc = fn(state, p, x)
        state = fp8.fold_state(bound.seam, state, inc)
    e = bound.report(state)[0]
    assert (e["calls"], e["fallbacks"], e["by_reason"]) == (3, 1, {"nonfinite": 1})
    assert e["amax"][0] > 0


@pytest.fixture(scope="module")
def block():
    cfg = BlockConfig(dim=D, num_heads=4, num_kv_heads=2, ffn_hidden_dim=F, compute_dtype="bf16")
    params = init_stack(jax.random.key(3), cfg, 3)
    x = jax.random.normal(jax.random.key(4), (2, 8, D)).astype(jnp.bfloat16)
    bound = fp8.bind_block(cfg, params, [x], gate_cos=0)
    return cfg, params, x, bound


def _break_layer(state, layer, seam="ffn"):
    """Make one layer's seam saturate on every call (scale 1000x too small)."""
    s = state[seam]
    return {**state, seam: s._replace(scales=s.scales.at[layer].set(s.scales[layer] / 1000.0))}


@pytest.mark.parametrize("fallback", ["block", "seam"])
@pytest.mark.parametrize("engine", ["reconstruct", "reconstruct_dots", "scan_grad"])
def test_counts_exact_per_layer_across_steps(block, engine, fallback):
    cfg, params, x, bound = block
    bound = bound.with_fallback(fallback)
    blk = bound.block_fn()
    if engine == "scan_grad":
        apply = lambda p, x: plain_stack(blk, p, x)
    else:
        apply = eae_jax.reconstruct(blk, policy="dots" if engine == "reconstruct_dots" else None)

    @jax.jit
    def step(p, x):
        g = jax.grad(lambda p, x: jnp.mean(apply(p, x).astype(jnp.float32) ** 2))(p, x)
        return bound.fold(p["fp8"], g["fp8"], notify=False)

    state = _break_layer(bound.state, 1)
    steps = 3
    for _ in range(steps):
        state = step(bound.params(params, state), x)
    rep = {e["seam"]: e for e in bound.report(state)}
    for seam in ("qkv", "o", "ffn"):
        for layer in range(3):
            e = rep[f"{seam}[{layer}]"]
            assert e["calls"] == steps, (engine, e)  # forward + recomputation, counted once
            broken = seam == "ffn" and layer == 1
            # per block: the broken seam's block mates fall back with it, counted as 'block'
            mate = fallback == "block" and layer == 1 and not broken
            assert e["fallbacks"] == (steps if broken or mate else 0), e
            assert e["by_reason"] == ({"saturation": steps} if broken else {"block": steps} if mate else {}), e
            assert e["consecutive"] == (steps if broken else 0)


def test_detach_after_n_consecutive_and_warn_once(block):
    cfg, params, x, bound = block
    seams = {n: s.replace(detach_after=3) for n, s in bound.seams.items()}
    bound = fp8.BoundBlock(cfg, seams, bound.state, bound.certification)
    stack = eae_jax.reconstruct(bound.block_fn())

    @jax.jit
    def step(p, x):
        g = jax.grad(lambda p, x: jnp.mean(stack(p, x).astype(jnp.float32) ** 2))(p, x)
        return bound.fold(p["fp8"], g["fp8"])

    state = _break_layer(bound.state, 0)
    with pytest.warns(fp8.Fp8FallbackWarning) as record:
        for i in range(5):
            state = step(bound.params(params, state), x)
            jax.effects_barrier()
            e = {r["seam"]: r for r in bound.report(state)}["ffn[0]"]
            assert e["detached"] == (i >= 2), (i, e)
    messages = [str(w.message) for w in record if issubclass(w.category, fp8.Fp8FallbackWarning)]
    assert sum("fell back to high precision (saturation)" in m for m in messages) == 1
    assert sum("detached itself" in m for m in messages) == 1
    e = {r["seam"]: r for r in bound.report(state)}
    assert e["ffn[0]"]["by_reason"] == {"saturation": 3, "detached": 2}
    assert e["ffn[0]"]["last_reason"] == "detached" and e["ffn[0]"]["calls"] == 5
    assert not e["ffn[1]"]["detached"] and e["ffn[1]"]["fallbacks"] == 0 and e["ffn[1]"]["calls"] == 5


def test_fold_rules():
    led = L.init_ledger(2)
    ok = L.increments(jnp.int32(-1), jnp.array([1.0, 2.0]))
    bad = L.increments(jnp.int32(L.reason_index("saturation")), jnp.array([3.0, jnp.nan]))
    for _ in range(2):
        led = L.fold(led, bad, detach_after=3)
    assert float(led.consecutive) == 2 and float(led.detached) == 0
    np.testing.assert_allclose(np.asarray(led.amax), [3.0, 0.0])  # non-finite amax not recorded
    led = L.fold(led, ok, detach_after=3)
    assert float(led.consecutive) == 0 and float(led.last_reason) == L.reason_index("saturation")
    np.testing.assert_allclose(np.asarray(led.amax), [1.0, 2.0])
    for _ in range(3):
        led = L.fold(led, bad, detach_after=3)
    assert float(led.detached) == 1
    led = L.fold(led, ok, detach_after=3)
    assert float(led.detached) == 1  # for good
    never = L.init_ledger(1)
    for _ in range(5):
        never = L.fold(never, L.increments(jnp.int32(0), jnp.zeros(1)), detach_after=None)
    assert float(never.detached) == 0 and float(never.calls) == 5
    with pytest.raises(ValueError, match="shape"):
        L.fold(L.init_ledger(2), L.increments(jnp.int32(-1), jnp.zeros(1)))


def test_report_shapes_and_names():
    led = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), L.init_ledger(1))
    rep = L.report(led, "o")
    assert [r["seam"] for r in rep] == ["o[0]", "o[1]"]
    assert rep[0] == {"seam": "o[0]", "calls": 0, "fp8_calls": 0, "fallbacks": 0, "by_reason": {},
                      "last_reason": None, "consecutive": 0, "detached": False, "amax": [0.0]}
    assert L.report(L.init_ledger(2), "ffn")[0]["seam"] == "ffn"
    with pytest.raises(ValueError, match="unknown fallback reason"):
        L.reason_index("cosmic rays")
