"""Whole language models: a transformers LlamaForCausalLM (half-split RoPE) and the real
stories260K llama2.c checkpoint, against their torch references."""


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("eae_runtime")

import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
from eae_jax.models import lm_apply  # noqa: E402
from interop.parity import checkpoint_case, compare, hf_lm_case, run_parity, seed_lm_case  # noqa: E402

from conftest import STORIES, needs_stories  # noqa: E402


def random_llama(tie, kv=2, layers=3, theta=500.0, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=6,
        num_key_value_heads=kv, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=theta,
        tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-init weights make the RoPE convention matter more
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(8.0)
            else:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tie,kv", [(False, 2), (True, 1)], ids=["untied-GQA", "tied-MQA"])
def test_transformers_llama_parity(tie, kv):
    model = random_llama(tie, kv)
    imported = interop.import_hf_model(model)
    assert imported.config.block.rope_style == "half"
    pipelines = ("none", "fp16") if tie else ("none",)
    report = run_parity(hf_lm_case(model, imported.params, imported.config, seq=12), pipelines=pipelines)
    assert report.ok, "\n" + report.table()
    names = {(r.section, r.name) for r in report.rows}
    assert ("forward", "logits") in names and ("forward", "logits(model)") in names and ("grad", "embed") in names
    assert (("grad", "lm_head") in names) == (not tie)


def test_interleaved_rope_would_not_match_transformers():
    """The half-split convention is load-bearing: the same weights run with interleaved RoPE disagree."""
    import dataclasses

    model = random_llama(False)
    imported = interop.import_hf_model(model)
    wrong = dataclasses.replace(imported.config, block=dataclasses.replace(imported.config.block, rope_style="interleaved"))
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens).logits.numpy()
    right = np.asarray(lm_apply(imported.params, jnp.asarray(tokens.numpy()), imported.config))
    bad = np.asarray(lm_apply(imported.params, jnp.asarray(tokens.numpy()), wrong))
    assert compare(right, want)[1] < 1e-5
    assert compare(bad, want)[1] > 1e-2


def test_hf_checkpoint_directory_parity(tmp_path):
    model = random_llama(True, kv=3, layers=2)
    model.save_pretrained(str(tmp_path / "ckpt"))
    report = run_parity(checkpoint_case(str(tmp_path / "ckpt"), seq=8), pipelines=())
    assert report.ok, "\n" + report.table()


@needs_stories
def test_stories260k_parity():
    from interop.reference import seed_lm_from_params

    imported = interop.load_llama2c_bin(STORIES)
    model = seed_lm_from_params(imported.params, imported.config)
    assert model.blocks[0].attn_norm.eps == 1e-5 and model.norm.eps == 1e-5
    report = run_parity(seed_lm_case(model, imported.params, imported.config, seq=32), pipelines=("none", "int8_clip"))
    assert report.ok, "\n" + report.table()
    assert report.worst("forward") < 1e-5 and report.worst("grad") < 1e-5


@needs_stories
def test_stories260k_greedy_generation_matches_torch_reference():
    from interop.generate import greedy_generate_jax, greedy_generate_torch
    from interop.reference import seed_lm_from_params

    imported = interop.load_llama2c_bin(STORIES)
    jax_gen = greedy_generate_jax(imported.params, imported.config, [1], 200)
    torch_gen = greedy_generate_torch(seed_lm_from_params(imported.params, imported.config), [1], 200)
    assert jax_gen.tokens.shape == (201,) and jax_gen.tokens[0] == 1
    np.testing.assert_array_equal(jax_gen.tokens, torch_gen.tokens)
    assert list(jax_gen.tokens[1:3]) == [461, 461]  # as the README records for this file
    _, rel, cos = compare(jax_gen.logits, torch_gen.logits)
    assert rel <= 1e-5 and cos > 1 - 1e-9
    # the full-sequence logits of the generated text agree too
    tokens = jnp.asarray(jax_gen.tokens[None, :-1])
    with torch.no_grad():
        want = seed_lm_from_params(imported.params, imported.config)(torch.from_numpy(np.array(tokens)).long())
    assert compare(np.asarray(lm_apply(imported.params, tokens, imported.config)), want.numpy())[1] <= 1e-5


def test_generation_input_checks():
    model = random_llama(True, layers=1)
    imported = interop.import_hf_model(model)
    from interop.generate import greedy_generate_jax, greedy_generate_torch

    with pytest.raises(ValueError, match="max_seq_len"):
        greedy_generate_jax(imported.params, imported.config, [1], 64)
    with pytest.raises(ValueError, match="prompt ids"):
        greedy_generate_jax(imported.params, imported.config, [96], 4)
    a = greedy_generate_jax(imported.params, imported.config, [1, 5, 7], 10)
    b = greedy_generate_torch(model, [1, 5, 7], 10)
    np.testing.assert_array_equal(a.tokens, b.tokens)
