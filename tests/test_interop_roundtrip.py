"""torch -> JAX -> torch round trips reproduce every tensor bit for bit, for all three formats."""

import json
import os

import chex
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("eae_runtime")
pytest.importorskip("safetensors")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
from eae_jax.blocks import decoder_block, plain_stack  # noqa: E402
from eae_jax.models import check_lm_params, lm_apply  # noqa: E402

from conftest import STORIES, hf_config_dict, hf_params, needs_stories, small_llama2c_bytes  # noqa: E402
from eae_jax.blocks import BlockConfig  # noqa: E402
from eae_jax.models import LMConfig, init_lm  # noqa: E402
from interop.hf_llama import hf_config_from_lm, hf_state_dict, lm_config_from_hf  # noqa: E402
from interop.errors import UnsupportedConfigError  # noqa: E402
from interop.llama2c import llama2c_state_dict  # noqa: E402
from interop.torch_blocks import infer_rope_theta  # noqa: E402


def assert_bit_equal_state_dicts(a, b):
    """Same keys, same dtype, same shape, same bits."""
    assert list(a) == list(b) or sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype, (k, x.dtype, y.dtype)
        assert tuple(x.shape) == tuple(y.shape), (k, x.shape, y.shape)
        xb = x.contiguous().view(torch.uint8) if x.element_size() == 1 else x.contiguous().view(
            {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
        yb = y.contiguous().view(xb.dtype)
        assert torch.equal(xb, yb), k


def seed_stack(depth, heads, kv, dim=32, ffn=48, eps=1e-6, seed=0):
    from eae_runtime.contrib import PreNormTransformerBlock

    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList([
        PreNormTransformerBlock(dim, heads, num_kv_heads=kv, max_seq_len=64, ffn_hidden_dim=ffn, norm_eps=eps)
        for _ in range(depth)])
    # Random norm gains, so a swapped attn_norm / ffn_norm would show.
    with torch.no_grad():
        for b in blocks:
            b.attn_norm.weight.uniform_(0.5, 1.5)
            b.ffn_norm.weight.uniform_(0.5, 1.5)
    return blocks.eval()


# ----------------------------------------------------------------------------- seed blocks
@pytest.mark.parametrize("heads,kv,depth", [(4, 4, 1), (4, 2, 3), (4, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seed_blocks_module_roundtrip(heads, kv, depth, dtype):
    blocks = seed_stack(depth, heads, kv).to(dtype)
    imported = interop.import_seed_blocks(blocks)
    cfg = imported.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_dim, cfg.norm_eps, cfg.max_seq_len) == (heads, kv, 48, 1e-6, 64)
    assert cfg.rope_style == "interleaved" and cfg.rope_theta == 10000.0
    assert imported.params["attn"]["wq"].dtype == jnp.dtype(jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32)
    # No transposes: the JAX leaf is the torch weight as stored.
    np.testing.assert_array_equal(np.asarray(imported.params["attn"]["wk"][depth - 1]).astype(np.float32),
                                  blocks[depth - 1].attn.k_proj.weight.float().detach().numpy())
    back = interop.export_seed_blocks(imported.params, cfg)
    assert_bit_equal_state_dicts(blocks.state_dict(), back.state_dict())
    assert_bit_equal_state_dicts(blocks.state_dict(), interop.seed_state_dict(imported.params, cfg))


def test_seed_blocks_state_dict_and_file_roundtrip(tmp_path):
    blocks = seed_stack(3, 4, 2, eps=1e-5)
    cfg = interop.import_seed_blocks(blocks).config
    from_sd = interop.import_seed_blocks(blocks.state_dict(), cfg)
    assert_bit_equal_state_dicts(blocks.state_dict(), interop.seed_state_dict(from_sd.params, from_sd.config))
    path = str(tmp_path / "stack.pt")
    torch.save(blocks, path)  # a whole ModuleList, read back with the weights-only unpickler
    from_file = interop.import_seed_blocks(path)
    assert from_file.config == cfg
    out = str(tmp_path / "out.pt")
    interop.save_seed_blocks(out, from_file.params, from_file.config)
    written = interop.load_torch_file(out, allow_modules=True)
    assert isinstance(written, torch.nn.ModuleList)
    assert_bit_equal_state_dicts(blocks.state_dict(), written.state_dict())
    # A bare state dict in a .pt: loads with the config given.
    sd_path = str(tmp_path / "sd.pt")
    torch.save(blocks.state_dict(), sd_path)
    got = interop.load_checkpoint(sd_path, config=cfg)
    assert_bit_equal_state_dicts(blocks.state_dict(), interop.seed_state_dict(got.params, got.config))


def test_seed_blocks_rope_theta_is_read_from_buffers():
    from eae_runtime.contrib import RotaryPositionalEmbedding

    blocks = seed_stack(2, 4, 2)
    for b in blocks:
        b.attn.rope = RotaryPositionalEmbedding(8, 64, base=500000.0)
    imported = interop.import_seed_blocks(blocks)
    assert imported.config.rope_theta == 500000.0
    back = interop.export_seed_blocks(imported.params, imported.config)
    assert torch.equal(back[0].attn.rope.cos_cached, blocks[0].attn.rope.cos_cached)
    # and the JAX blocks compute what the torch blocks compute with that base
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        want = blocks[1](blocks[0](x)).numpy()
    got = plain_stack(decoder_block(imported.config), imported.params, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5)


def test_dtype_conversion_on_request():
    blocks = seed_stack(2, 4, 2)
    imported = interop.import_seed_blocks(blocks, dtype="bf16")
    leaves = jax.tree_util.tree_leaves(imported.params)
    assert {l.dtype for l in leaves} == {jnp.dtype(jnp.bfloat16)}
    want = blocks[0].attn.q_proj.weight.detach().to(torch.bfloat16)
    got = interop.seed_state_dict(imported.params, imported.config)["0.attn.q_proj.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# ----------------------------------------------------------------------------- Hugging Face
def hf_model(tie, dtype=torch.float32, layers=2, kv=2, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return model.to(dtype)


def read_safetensors(path):
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_hf_roundtrip(tmp_path, tie, weights):
    model = hf_model(tie)
    src = str(tmp_path / "src")
    model.save_pretrained(src)
    if weights == "bin":  # the older pickle layout: same config.json, weights as pytorch_model.bin
        os.remove(os.path.join(src, "model.safetensors"))
        sd = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
        torch.save(sd, os.path.join(src, "pytorch_model.bin"))
    imported = interop.load_hf(src)
    cfg = imported.config
    assert cfg.block.rope_style == "half" and cfg.block.rope_theta == 500.0 and cfg.block.norm_eps == 1e-5
    assert cfg.tie_embeddings == tie and cfg.block.num_kv_heads == 2 and cfg.depth == 2
    check_lm_params(imported.params, cfg)
    dst = str(tmp_path / "dst")
    interop.save_hf(dst, imported.params, cfg, weights=weights, base_config=imported.meta["config"])
    if weights == "safetensors":
        assert_bit_equal_state_dicts(read_safetensors(os.path.join(src, "model.safetensors")),
                                     read_safetensors(os.path.join(dst, "model.safetensors")))
    else:
        assert_bit_equal_state_dicts(torch.load(os.path.join(src, "pytorch_model.bin"), weights_only=True),
                                     torch.load(os.path.join(dst, "pytorch_model.bin"), weights_only=True))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json")) as g:
        assert json.load(f) == json.load(g)
    # The live model's state_dict (which carries lm_head even when tied) round-trips too.
    sd = model.state_dict()
    again = interop.hf_state_dict(interop.import_hf_model(model).params, cfg, tied_head=tie)
    assert_bit_equal_state_dicts(sd, again)


def test_hf_bf16_roundtrip_and_transformers_rebuild(tmp_path):
    model = hf_model(False, torch.bfloat16, layers=3, kv=1)
    src = str(tmp_path / "src")
    model.save_pretrained(src)
    imported = interop.load_hf(src)
    assert imported.params["blocks"]["attn"]["wq"].dtype == jnp.bfloat16
    dst = str(tmp_path / "dst")
    interop.save_hf(dst, imported.params, imported.config, base_config=imported.meta["config"])
    assert_bit_equal_state_dicts(read_safetensors(os.path.join(src, "model.safetensors")),
                                 read_safetensors(os.path.join(dst, "model.safetensors")))
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    rebuilt = interop.to_transformers(imported.params, imported.config, imported.meta["config"])
    assert_bit_equal_state_dicts(model.state_dict(), rebuilt.state_dict())


def test_hf_export_loads_in_transformers_and_matches(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = hf_model(True, layers=2)
    imported = interop.import_hf_model(model)
    dst = str(tmp_path / "fresh")
    interop.save_hf(dst, imported.params, imported.config)  # config written from scratch
    reloaded = transformers.LlamaForCausalLM.from_pretrained(dst).eval()
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy())
    jax_logits = lm_apply(imported.params, jnp.asarray(tokens.numpy()), imported.config)
    np.testing.assert_allclose(np.asarray(jax_logits), model(tokens).logits.detach().numpy(), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- llama2.c
def llama2c_checkpoint(tie=True, dim=32, layers=2, heads=4, kv=2, hidden=None, vocab=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden_dim = hidden or 96
    hd = dim // heads
    sd = {"tok_embeddings.weight": torch.randn(vocab, dim, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attention.wq.weight"] = torch.randn(heads * hd, dim, generator=g)
        sd[p + "attention.wk.weight"] = torch.randn(kv * hd, dim, generator=g)
        sd[p + "attention.wv.weight"] = torch.randn(kv * hd, dim, generator=g)
        sd[p + "attention.wo.weight"] = torch.randn(dim, heads * hd, generator=g)
        sd[p + "feed_forward.w1.weight"] = torch.randn(hidden_dim, dim, generator=g)
        sd[p + "feed_forward.w2.weight"] = torch.randn(dim, hidden_dim, generator=g)
        sd[p + "feed_forward.w3.weight"] = torch.randn(hidden_dim, dim, generator=g)
        sd[p + "attention_norm.weight"] = torch.rand(dim, generator=g) + 0.5
        sd[p + "ffn_norm.weight"] = torch.rand(dim, generator=g) + 0.5
    sd["norm.weight"] = torch.rand(dim, generator=g) + 0.5
    sd["output.weight"] = sd["tok_embeddings.weight"] if tie else torch.randn(vocab, dim, generator=g)
    args = dict(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=vocab, hidden_dim=hidden,
                multiple_of=32, norm_eps=1e-5, max_seq_len=64, dropout=0.0)
    return {"model_args": args, "model": sd, "iter_num": 7}


@pytest.mark.parametrize("tie", [True, False])
def test_llama2c_pt_roundtrip(tmp_path, tie):
    ckpt = llama2c_checkpoint(tie=tie, hidden=96)
    src = str(tmp_path / "ckpt.pt")
    torch.save(ckpt, src)
    imported = interop.load_llama2c(src)
    assert imported.config.tie_embeddings == tie and imported.meta["other_entries"] == ["iter_num"]
    dst = str(tmp_path / "out.pt")
    interop.save_llama2c_pt(dst, imported.params, imported.config, model_args=imported.meta["model_args"])
    out = torch.load(dst, weights_only=True)
    assert out["model_args"] == ckpt["model_args"]
    assert_bit_equal_state_dicts(ckpt["model"], out["model"])
    if tie:  # llama2.c's tie: both names, one tensor
        assert out["model"]["output.weight"].data_ptr() == out["model"]["tok_embeddings.weight"].data_ptr()


def test_llama2c_hidden_dim_from_multiple_of_and_compile_prefix(tmp_path):
    ckpt = llama2c_checkpoint(hidden=None, dim=32)  # rule: 32 * ceil(int(2*128/3)=85 / 32) = 96
    ckpt["model"] = {"_orig_mod." + k: v for k, v in ckpt["model"].items()}
    imported = interop.import_llama2c_checkpoint(ckpt)
    assert imported.config.block.ffn_hidden_dim == 96


@pytest.mark.parametrize("tie,version", [(True, 0), (False, 0), (True, 1), (False, 1)])
def test_llama2c_bin_roundtrip_synthetic(tmp_path, tie, version):
    ckpt = llama2c_checkpoint(tie=tie, hidden=96)
    imported = interop.import_llama2c_checkpoint(ckpt)
    a = str(tmp_path / "a.bin")
    interop.save_llama2c_bin(a, imported.params, imported.config, version=version)
    back = interop.load_llama2c_bin(a)
    assert back.config.tie_embeddings == tie and back.meta["format"] == f"llama2c_bin_v{version}"
    sd = interop.llama2c_state_dict(back.params, back.config)
    assert_bit_equal_state_dicts(ckpt["model"], sd)
    b = str(tmp_path / "b.bin")
    interop.save_llama2c_bin(b, back.params, back.config, version=version, rope_tables=back.meta.get("rope_tables"))
    assert open(a, "rb").read() == open(b, "rb").read()


@needs_stories
def test_stories260k_bin_roundtrip_is_byte_exact(tmp_path):
    imported = interop.load_checkpoint(STORIES)
    cfg = imported.config
    assert (cfg.vocab_size, cfg.depth, cfg.dim, cfg.block.num_heads, cfg.block.num_kv_heads,
            cfg.block.ffn_hidden_dim, cfg.block.norm_eps, cfg.tie_embeddings) == (512, 5, 64, 8, 4, 172, 1e-5, True)
    assert imported.meta["sha256"] == "9414d5a285453a7eab631713d171753232c978f6f97654211469aff8be93c8d6"
    original = open(STORIES, "rb").read()
    for tables in (imported.meta["rope_tables"], None):  # stored tables, and tables recomputed like llama2.c
        out = str(tmp_path / "out.bin")
        interop.save_llama2c_bin(out, imported.params, cfg, rope_tables=tables)
        assert open(out, "rb").read() == original
    # and through the .pt format
    pt = str(tmp_path / "stories.pt")
    interop.save_llama2c_pt(pt, imported.params, cfg, model_args=imported.meta["model_args"])
    again = interop.load_checkpoint(pt)
    for x, y in zip(jax.tree_util.tree_leaves(imported.params), jax.tree_util.tree_leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- found by probing: RoPE bases, arrays, exports
@pytest.mark.parametrize("head_dim,seq,theta,dtype", [
    (32, 128, 10000.0, torch.bfloat16),   # was refused ("not the standard tables of any base near 10739")
    (16, 64, 10000.0, torch.bfloat16),    # was read as 10011
    (64, 4096, 1e6, torch.bfloat16),      # was refused
    (8, 4096, 1234.5, torch.float32),     # non-integer base, long table: was refused
    (8, 4096, 1234.5, torch.bfloat16),
])
def test_rope_theta_recovered_from_low_precision_and_long_tables(head_dim, seq, theta, dtype):
    from eae_runtime.contrib import RotaryPositionalEmbedding

    rope = RotaryPositionalEmbedding(head_dim, seq, base=theta)
    assert infer_rope_theta(rope.cos_cached.to(dtype), rope.sin_cached.to(dtype), head_dim) == theta


def test_bf16_reference_blocks_import_with_their_rope_base():
    from eae_runtime.contrib import PreNormTransformerBlock

    blocks = torch.nn.ModuleList([PreNormTransformerBlock(64, 2, num_kv_heads=1, max_seq_len=128, ffn_hidden_dim=48)
                                  for _ in range(2)]).to(torch.bfloat16)
    cfg = interop.import_seed_blocks(blocks).config
    assert cfg.rope_theta == 10000.0 and cfg.head_dim == 32


@pytest.mark.parametrize("theta", [500000.0, 1234.5])
def test_one_row_rope_table_imports(theta):
    """max_seq_len=1: only position 0 exists, every base gives the same tables (was refused)."""
    from eae_runtime.contrib import PreNormTransformerBlock, RotaryPositionalEmbedding

    block = PreNormTransformerBlock(16, 2, max_seq_len=1, ffn_hidden_dim=24)
    block.attn.rope = RotaryPositionalEmbedding(8, 1, base=theta)
    imported = interop.import_seed_blocks(torch.nn.ModuleList([block]))
    back = interop.export_seed_blocks(imported.params, imported.config)
    assert torch.equal(back[0].attn.rope.cos_cached, block.attn.rope.cos_cached)
    assert torch.equal(back[0].attn.rope.sin_cached, block.attn.rope.sin_cached)


def test_hf_config_base_without_rope_base_records_it():
    params, lm = hf_params(hf_config_dict())
    out = hf_config_from_lm(lm, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert lm_config_from_hf(out).block.rope_theta == 500.0


@pytest.mark.parametrize("kind", ["numpy+torch", "jax"])
def test_hf_state_dict_of_arrays_imports_bit_exact(kind):
    """Only all-numpy or all-torch state dicts were accepted; JAX arrays were 'not tensors'."""
    params, lm = hf_params(hf_config_dict())
    sd = hf_state_dict(params, lm)
    if kind == "jax":
        sd = {k: jnp.asarray(v.numpy()) for k, v in sd.items()}
    else:
        sd = {k: (v.numpy() if i % 2 else v) for i, (k, v) in enumerate(sd.items())}
    got = interop.import_hf_state_dict(sd, hf_config_dict()).params
    chex.assert_trees_all_equal_dtypes(params, got)
    chex.assert_trees_all_equal(params, got)


@pytest.mark.parametrize("version", [0, 1])
def test_failed_llama2c_export_keeps_the_earlier_file(tmp_path, version):
    """A shape error halfway used to leave a partial .bin under the real name."""
    good = small_llama2c_bytes(tmp_path, version)
    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=7), tie_embeddings=True)
    path = tmp_path / f"m{version}.bin"
    bad_tables = (np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="nothing written"):
        interop.save_llama2c_bin(str(path), init_lm(jax.random.key(1), lm), lm, version=0, rope_tables=bad_tables)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left behind


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_hf_export_replaces_files_whole(tmp_path, weights):
    cfg = hf_config_dict()
    params, lm = hf_params(cfg)
    interop.save_hf(str(tmp_path), params, lm, weights=weights, base_config=cfg)
    interop.save_hf(str(tmp_path), params, lm, weights=weights, base_config=cfg)  # over an earlier export
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    back = interop.load_hf(str(tmp_path))
    chex.assert_trees_all_equal(back.params, params)


@pytest.mark.parametrize("dim,heads", [(128, 4), (640, 5)])
def test_llama2c_v0_dim_whose_first_byte_is_a_pickle_opcode(tmp_path, dim, heads):
    """dim 128 + 256k starts the file with 0x80 (640 with 0x80 0x02, a protocol-2
    pickle's first bytes): the library's own v0 export was read as a damaged pickle."""
    lm = LMConfig(13, 1, BlockConfig(dim, heads, 1, 24, norm_eps=1e-5, max_seq_len=4), tie_embeddings=True)
    params = init_lm(jax.random.key(0), lm)
    path = str(tmp_path / "m.bin")
    interop.save_llama2c_bin(path, params, lm, version=0)
    assert open(path, "rb").read(1) == b"\x80"
    assert interop.detect_format(path) == "llama2c_bin_v0"
    back = interop.load_checkpoint(path)
    chex.assert_trees_all_equal(params, back.params)


@pytest.mark.parametrize("earlier", ["model.safetensors", "model.safetensors.index.json",
                                     "pytorch_model.bin.index.json"])
def test_hf_bin_export_refuses_files_that_would_shadow_it(tmp_path, earlier):
    """Loaders read model.safetensors and the indexes before pytorch_model.bin:
    a 'bin' export beside them silently reloaded the earlier weights."""
    cfg = hf_config_dict()
    params, lm = hf_params(cfg)
    (tmp_path / earlier).write_bytes(b"earlier")
    with pytest.raises(interop.InteropError, match=f"already holds.*{earlier}.*shadowed"):
        interop.save_hf(str(tmp_path), params, lm, weights="bin", base_config=cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [earlier]  # nothing written, nothing removed
    assert (tmp_path / earlier).read_bytes() == b"earlier"


def test_hf_safetensors_export_over_a_bin_export_reloads_the_new_weights(tmp_path):
    cfg = hf_config_dict()
    params, lm = hf_params(cfg)
    other = jax.tree_util.tree_map(lambda a: a + 1, params)
    interop.save_hf(str(tmp_path), params, lm, weights="bin", base_config=cfg)
    interop.save_hf(str(tmp_path), other, lm, weights="safetensors", base_config=cfg)
    back = interop.load_hf(str(tmp_path)).params
    chex.assert_trees_all_equal(other, back)


def test_tied_head_stored_in_fortran_order_is_recognised():
    """A tied head held as a transposed-back (Fortran-ordered) copy raised
    numpy's 'last axis must be contiguous' instead of importing."""
    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=8), tie_embeddings=True)
    sd = {k: v.numpy() for k, v in llama2c_state_dict(init_lm(jax.random.key(0), lm), lm).items()}
    sd["output.weight"] = np.asfortranarray(sd["tok_embeddings.weight"])
    args = {"dim": 16, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 11, "hidden_dim": 20,
            "max_seq_len": 8}
    assert interop.import_llama2c_checkpoint({"model_args": args, "model": sd}).config.tie_embeddings
    hf_cfg = hf_config_dict(tie_word_embeddings=True)
    params, hf_lm = hf_params(hf_cfg)
    hsd = {k: v.numpy() for k, v in hf_state_dict(params, hf_lm).items()}
    hsd["lm_head.weight"] = np.asfortranarray(hsd["model.embed_tokens.weight"])
    assert interop.import_hf_state_dict(hsd, hf_cfg).config.tie_embeddings


def test_exports_get_the_usual_file_mode(tmp_path):
    """Atomic writes went through mkstemp and left every export 0600."""
    import os

    umask = os.umask(0o022)
    try:
        lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=8), tie_embeddings=True)
        path = tmp_path / "m.bin"
        interop.save_llama2c_bin(str(path), init_lm(jax.random.key(0), lm), lm)
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o640)  # a replaced file keeps its mode
        interop.save_llama2c_bin(str(path), init_lm(jax.random.key(1), lm), lm)
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)


def test_llama2c_bin_rope_check_needs_no_torch_and_keeps_long_tables(tmp_path, monkeypatch):
    """Reading a .bin computed its reference RoPE tables with torch (no torch: no .bin); the check
    now allows the float32 rounding of the angles, which long tables need, and still refuses another base."""
    from interop.llama2c import llama2c_rope_tables, load_llama2c_bin, rope_tables_error

    long_cos, long_sin = llama2c_rope_tables(128, 4096)        # as llama2.c's export computes them
    assert rope_tables_error(long_cos, long_sin, 128) <= 1e-5
    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=64), tie_embeddings=True)
    params = init_lm(jax.random.key(0), lm)
    good, bad = str(tmp_path / "good.bin"), str(tmp_path / "bad.bin")
    interop.save_llama2c_bin(good, params, lm)
    interop.save_llama2c_bin(bad, params, lm, rope_tables=llama2c_rope_tables(4, 64, theta=10001.0))
    monkeypatch.setitem(__import__("sys").modules, "torch", None)     # as if torch were not installed
    assert load_llama2c_bin(good).meta["rope_tables_max_abs_diff"] <= 1e-5
    with pytest.raises(UnsupportedConfigError, match="base-10000"):
        load_llama2c_bin(bad)
