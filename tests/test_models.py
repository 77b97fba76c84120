"""Language models and their blocks: the loss, token checks, block and model configs and
params, plain_stack's policies (bad inputs get errors naming the problem)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax.blocks import BlockConfig, decoder_block, init_block, init_stack, plain_stack, rms_norm
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


@pytest.mark.parametrize("change, match", [
    (lambda p: dict(p, final_norm={}), r"final_norm: expected \{'scale'"),
    (lambda p: dict(p, embed=[1, 2]), "embed: expected an array of shape"),
])
def test_bad_lm_params_get_value_errors(change, match):
    params = init_lm(jax.random.key(0), LM)
    with pytest.raises(ValueError, match=match):
        check_lm_params(change(params), LM)


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
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown policy"):
        loss(params, "dotz")
