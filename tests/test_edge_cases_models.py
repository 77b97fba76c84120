"""Blocks, models, carry and events edge cases found by probing.

Each test guards one bug that was fixed: a masked ignore-index target made
the loss NaN, out-of-range token ids were read silently (negative ones
wrapping around), integer inputs were truncated through the block, a pass
whose update changed its state's dtype had its bits reinterpreted, bad LM
params raised KeyError/AttributeError, events reported statistics where
the statistics pass never ran and dropped bfloat16 fields, configs took
values that failed much later, and plain_stack refused policy names.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eae_jax
from eae_jax import passes as P
from eae_jax.blocks import BlockConfig, decoder_block, init_block, init_stack, plain_stack, rms_norm
from eae_jax.events import EventBus, EventType, emit_step_events, summarize_state
from eae_jax.models import LMConfig, cross_entropy, init_lm, lm_apply
from eae_jax.models.llama import check_lm_params

CFG = BlockConfig(dim=32, num_heads=4, num_kv_heads=2, ffn_hidden_dim=40, max_seq_len=16)
LM = LMConfig(vocab_size=20, depth=1, block=CFG)


def _log_softmax_nll(logits, targets):
    logits = np.asarray(logits, np.float64)
    z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    return z - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]


@pytest.mark.parametrize("ignored", [-100, 20, 57])
def test_masked_out_targets_may_be_anything(ignored):
    """take_along_axis read NaN for an out-of-range target and NaN * 0 stayed NaN."""
    logits = jax.random.normal(jax.random.key(0), (2, 4, 20))
    targets = jnp.array([[1, 2, 3, ignored], [ignored, 5, 6, 7]])
    mask = targets != ignored
    want = _log_softmax_nll(logits, np.where(np.asarray(mask), np.asarray(targets), 0))[np.asarray(mask)].mean()
    for fn in (cross_entropy, jax.jit(cross_entropy)):
        np.testing.assert_allclose(float(fn(logits, targets, mask)), want, rtol=1e-5)
    g = jax.grad(lambda lg: cross_entropy(lg, targets, mask))(logits)
    assert bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("bad", [20, -1])
def test_out_of_range_token_ids_are_refused(bad):
    params = init_lm(jax.random.key(0), LM)
    tokens = jnp.array([[1, bad, 3, 4]])
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, 20\), got \[{bad}\]"):
        lm_apply(params, tokens, LM)
    with pytest.raises(ValueError, match=rf"targets must lie in \[0, 20\), got \[{bad}\]"):
        cross_entropy(jnp.zeros((1, 4, 20)), tokens)


def test_integer_inputs_are_refused_not_truncated():
    x = (jax.random.normal(jax.random.key(1), (1, 4, 32)) * 3).astype(jnp.int32)
    with pytest.raises(TypeError, match="floating point, got dtype int32"):
        decoder_block(CFG)(init_block(jax.random.key(0), CFG), x)
    with pytest.raises(TypeError, match="floating point"):
        rms_norm({"scale": jnp.ones((32,))}, x)


def test_block_params_of_another_config_are_named():
    other = BlockConfig(dim=32, num_heads=2, num_kv_heads=2, ffn_hidden_dim=40)
    with pytest.raises(ValueError, match=r"attn/wk: shape \(16, 32\), expected \(32, 32\)"):
        decoder_block(other)(init_block(jax.random.key(0), CFG), jnp.ones((1, 4, 32)))


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


@pytest.mark.parametrize("change, match", [
    (lambda p: dict(p, final_norm={}), r"final_norm: expected \{'scale'"),
    (lambda p: dict(p, embed=[1, 2]), "embed: expected an array of shape"),
])
def test_bad_lm_params_get_value_errors(change, match):
    params = init_lm(jax.random.key(0), LM)
    with pytest.raises(ValueError, match=match):
        check_lm_params(change(params), LM)


def test_adjoint_modified_only_where_statistics_ran():
    """at_layers(statistics(), [-1]) reported zero statistics at every other boundary."""
    stack = eae_jax.reconstruct(lambda w, x: x + jnp.tanh(x @ w),
                                passes=P.chain(P.at_layers(P.statistics(), [-1]), P.clip_by_norm(10.0)))
    params, x = jnp.stack([jnp.eye(3) * 0.1] * 4), jnp.ones((2, 3))
    carry = stack.init(params, x, jax.random.key(0))
    carry, stats = stack.update(carry, jax.grad(lambda c: jnp.sum(stack(params, x, c)))(carry))
    events = emit_step_events(EventBus(), stack, stats, carry)
    modified = [e for e in events if e.type == EventType.ADJOINT_MODIFIED]
    assert [e.payload["layer_id"] for e in modified] == [4]
    np.testing.assert_allclose(modified[0].payload["norm"], float(stats["adjoint_norm"][4]), rtol=1e-5)
    applied = [e for e in events if e.type == EventType.PASS_APPLIED]
    assert len(applied) == 2 * 5  # PassApplied still at every boundary, for both passes


def test_summarize_state_keeps_bfloat16_fields():
    class S(NamedTuple):
        a: jax.Array
        b: jax.Array

    out = summarize_state(S(jnp.full((4,), 2.0, jnp.bfloat16), jnp.full((4,), 2.0, jnp.float16)))
    assert out == {"a_norm": 4.0, "b_norm": 4.0}


@pytest.mark.parametrize("kw, match", [
    (dict(ffn_hidden_dim=0), "ffn_hidden_dim must be a positive int"),
    (dict(multiple_of=0), "multiple_of must be a positive int"),
    (dict(max_seq_len=0), "max_seq_len must be a positive int"),
    (dict(dim=32.0), "dim must be a positive int"),
    (dict(norm_eps=-1.0), "norm_eps must be a finite number >= 0"),
    (dict(norm_eps=float("nan")), "norm_eps must be a finite number"),
    (dict(rope_theta=0.0), "rope_theta must be a finite number > 1"),
])
def test_block_config_values_are_checked_when_made(kw, match):
    with pytest.raises(ValueError, match=match):
        BlockConfig(**{**dict(dim=32, num_heads=4), **kw})


@pytest.mark.parametrize("kw, err", [(dict(vocab_size=20.5), ValueError), (dict(block={"dim": 32}), TypeError)])
def test_lm_config_values_are_checked_when_made(kw, err):
    with pytest.raises(err):
        LMConfig(**{**dict(vocab_size=20, depth=1, block=CFG), **kw})


@pytest.mark.parametrize("policy", ["dots", "boundaries", jax.checkpoint_policies.nothing_saveable])
def test_plain_stack_takes_policy_names(policy):
    params = init_stack(jax.random.key(0), CFG, depth=2)
    x = jax.random.normal(jax.random.key(1), (1, 4, 32))
    block = decoder_block(CFG)

    def loss(p, pol):
        return jnp.sum(plain_stack(block, p, x, remat_policy=pol) ** 2)

    want = jax.grad(loss)(params, "none")
    got = jax.grad(loss)(params, policy)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown policy"):
        loss(params, "dotz")
