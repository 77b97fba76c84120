"""eae_jax.models.convert: a model under the other RoPE convention computes the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eae_jax.blocks import BlockConfig
from eae_jax.models import LMConfig, init_lm, lm_apply
from eae_jax.models.convert import to_rope_style


@pytest.mark.parametrize("heads,kv,tied", [(4, 2, False), (2, 2, True)])
def test_both_conventions_compute_the_same_model(heads, kv, tied):
    cfg = LMConfig(vocab_size=40, depth=2, tie_embeddings=tied,
                   block=BlockConfig(dim=32, num_heads=heads, num_kv_heads=kv, ffn_hidden_dim=48, max_seq_len=16))
    params = init_lm(jax.random.key(1), cfg)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 40)
    half, half_cfg = to_rope_style(params, cfg, "half")
    assert half_cfg.block.rope_style == "half" and half_cfg.block.num_kv_heads == kv
    forward = jax.jit(lm_apply, static_argnums=2)
    np.testing.assert_allclose(forward(half, tokens, half_cfg), forward(params, tokens, cfg), atol=2e-5)
    assert not np.array_equal(half["blocks"]["attn"]["wq"], params["blocks"]["attn"]["wq"])
    for name in ("wv", "wo"):
        assert half["blocks"]["attn"][name] is params["blocks"]["attn"][name]
    back, back_cfg = to_rope_style(half, half_cfg, "interleaved")
    assert back_cfg == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)   # a permutation and its inverse: exact
    same, same_cfg = to_rope_style(params, cfg, "interleaved")
    assert same is params and same_cfg is cfg


def test_bad_style_and_params():
    cfg = LMConfig(vocab_size=8, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=8))
    params = init_lm(jax.random.key(0), cfg)
    with pytest.raises(ValueError, match="unknown rope style"):
        to_rope_style(params, cfg, "rotated")
    with pytest.raises(ValueError, match="embed"):
        to_rope_style(dict(params, embed=jnp.zeros((3, 8))), cfg, "half")
