"""KV-cached generation (eae_jax.models.decode) against the recomputing loop and lm_apply."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax.blocks import BlockConfig
from eae_jax.models import LMConfig, init_lm, lm_apply
from eae_jax.models.decode import decode_step, forward_cached, generate, init_cache, stream
from eae_jax.models.sampling import Sampling, sample_tokens
from interop.generate import greedy_generate_jax


def tiny(vocab=48, depth=2, kv=1, tied=False, rope_style="interleaved", max_seq_len=40):
    block = BlockConfig(dim=16, num_heads=4, num_kv_heads=kv, ffn_hidden_dim=24, max_seq_len=max_seq_len,
                        rope_style=rope_style)
    cfg = LMConfig(vocab_size=vocab, depth=depth, block=block, tie_embeddings=tied)
    return init_lm(jax.random.key(vocab), cfg), cfg


@pytest.mark.parametrize("kv,tied,rope_style,prompt", [(1, False, "interleaved", [1]),
                                                       (4, True, "half", [3, 9, 27])])
def test_greedy_equals_the_recomputing_loop(kv, tied, rope_style, prompt):
    params, cfg = tiny(kv=kv, tied=tied, rope_style=rope_style)
    ref = greedy_generate_jax(params, cfg, prompt, 30)
    got = generate(params, cfg, prompt, 30, return_logits=True)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logits, ref.logits, atol=1e-4, rtol=1e-5)
    assert list(stream(params, cfg, prompt, 30)) == ref.tokens[len(prompt):].tolist()


def test_chunks_through_the_cache_equal_the_full_forward():
    params, cfg = tiny(max_seq_len=16)
    tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, cfg.vocab_size)
    cache = init_cache(cfg, batch=2, length=16)
    pieces = []
    run = jax.jit(forward_cached, static_argnums=4)       # the position is traced: two chunk shapes, two compilations
    for start, stop in ((0, 5), (5, 6), (6, 11)):
        logits, cache = run(params, tokens[:, start:stop], cache, start, cfg)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), lm_apply(params, tokens, cfg), atol=2e-5)


def test_bf16_compute_follows_lm_apply():
    params, cfg = tiny()
    cfg = LMConfig(cfg.vocab_size, cfg.depth, BlockConfig(**{**cfg.block.__dict__, "compute_dtype": "bf16"}))
    tokens = jnp.array([[5, 7, 11, 13, 17]])
    logits, cache = forward_cached(params, tokens, init_cache(cfg, 1, 8), 0, cfg)
    assert cache.k.dtype == jnp.bfloat16
    want = lm_apply(params, tokens, cfg)
    assert float(jnp.max(jnp.abs(logits - want))) < 0.05 * float(jnp.max(jnp.abs(want)))


def test_the_decode_step_compiles_once():
    params, cfg = tiny(vocab=37)                   # a config no other test uses: its own cache entries
    before = decode_step._cache_size()
    generate(params, cfg, [1, 2], 24, cache_len=32)
    assert decode_step._cache_size() == before + 1
    sampling = Sampling(temperature=0.7, top_k=5)
    generate(params, cfg, [4, 5], 6, cache_len=32)                        # another request, same shapes
    generate(params, cfg, [3], 20, sampling=sampling, key=jax.random.key(0), cache_len=32)
    assert decode_step._cache_size() == before + 2                        # one more for the new sampling


def test_sampled_run_equals_recomputing_with_the_same_keys():
    """Each position's id is drawn with fold_in(key, position) from the recomputed logits."""
    params, cfg = tiny()
    sampling, key, prompt = Sampling(temperature=1.0, top_p=0.9), jax.random.key(42), [1, 2]
    got = generate(params, cfg, prompt, 12, sampling=sampling, key=key).tokens
    forward = jax.jit(lm_apply, static_argnums=2)       # over a fixed buffer: causal, so the tail is unread
    buffer = np.zeros((1, 14), np.int32)
    buffer[0, :2] = prompt
    for pos in range(2, 14):
        row = forward(params, jnp.asarray(buffer), cfg)[0, pos - 1]
        buffer[0, pos] = int(sample_tokens(jax.random.fold_in(key, pos), row, sampling))
    np.testing.assert_array_equal(got, buffer[0])


def test_seeds_reproduce_and_differ():
    params, cfg = tiny()
    sampling = Sampling(temperature=1.0, top_p=0.9)     # the settings above: their compilations are reused
    runs = [generate(params, cfg, [1, 2], 12, sampling=sampling, key=jax.random.key(s)).tokens for s in (0, 0, 1)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=[]), "non-empty"),
    (dict(prompt=[[1, 2]]), "1-D"),
    (dict(prompt=[1.0, 2.5]), "integers"),
    (dict(prompt=[1, 48]), r"\[0, 48\)"),
    (dict(prompt=[-1]), r"\[0, 48\)"),
    (dict(steps=0), "steps"),
    (dict(steps=40), "max_seq_len"),
    (dict(cache_len=4), "cache_len"),
    (dict(sampling=Sampling(temperature=1.0)), "PRNG key"),
])
def test_bad_requests_are_refused_before_any_work(kwargs, match):
    params, cfg = tiny()
    args = dict(prompt=[1], steps=4) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(params, cfg, args.pop("prompt"), args.pop("steps"), **args)


def test_stream_checks_the_request_when_called():
    params, cfg = tiny()
    with pytest.raises(ValueError, match="steps"):
        stream(params, cfg, [1], 0)                     # no next() needed


def test_a_cache_of_another_shape_or_past_its_end_is_refused():
    params, cfg = tiny()
    with pytest.raises(ValueError, match="does not fit this model"):
        forward_cached(params, jnp.array([[1]]), init_cache(cfg, batch=2, length=8), 0, cfg)
    with pytest.raises(ValueError, match="do not fit a cache of 8"):
        forward_cached(params, jnp.array([[1, 2]]), init_cache(cfg, batch=1, length=8), 7, cfg)
    with pytest.raises(ValueError, match="longer than the model's max_seq_len"):
        init_cache(cfg, 1, 41)


def test_non_finite_logits_stop_the_stream():
    params, cfg = tiny()
    clean = generate(params, cfg, [1], 10).tokens
    j = next(j for j in range(2, 11) if clean[j] not in clean[:j])     # the first id new to the sequence ...
    poisoned = dict(params, embed=params["embed"].at[clean[j]].set(jnp.nan))   # ... turns what follows it into NaN
    got = []
    with pytest.raises(FloatingPointError, match=f"position {j + 1} are not finite"):
        for token in stream(poisoned, cfg, [1], 10):
            got.append(token)
    assert got == clean[1:j + 1].tolist()                              # the ids before it came through
