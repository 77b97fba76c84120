"""Regression tests for interop edge cases found by probing inputs the other tests do not pick.

Each test guards one bug that was fixed in interop/: RoPE-base recovery from
low-precision / long / one-row tables, rope_scaling next to rope_parameters,
non-float weights, array state dicts, structural HF config errors, llama2.c
headers that are truncated, invalid or followed by trailing bytes, a
config.json base without a RoPE base, exports that fail halfway (the earlier
file stays whole), sharded indexes with duplicate or escaping shard names,
and hidden_act 'swish'.
"""

import dataclasses
import json
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="interop needs torch")
pytest.importorskip("eae_runtime", reason="the reference blocks come from eae_runtime")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
from eae_jax.blocks import BlockConfig  # noqa: E402
from eae_jax.models import LMConfig, init_lm  # noqa: E402
from interop.errors import CheckpointMismatchError, CorruptCheckpointError, UnsupportedConfigError  # noqa: E402
from interop.hf_llama import hf_config_from_lm, hf_state_dict, lm_config_from_hf  # noqa: E402
from interop.llama2c import llama2c_state_dict  # noqa: E402
from interop.torch_blocks import infer_rope_theta  # noqa: E402


def _hf_config(**kw):
    """A transformers-5 style config.json dict (rope_parameters), no transformers needed."""
    cfg = {"model_type": "llama", "vocab_size": 37, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "attention_bias": False,
           "mlp_bias": False, "head_dim": 8}
    cfg.update(kw)
    return cfg


def _hf_params(cfg):
    lm = lm_config_from_hf(cfg)
    return init_lm(jax.random.key(0), lm), lm


# ----------------------------------------------------------------------------- seed blocks: RoPE base
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


# ----------------------------------------------------------------------------- Hugging Face config
@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_rope_scaling_next_to_rope_parameters_is_refused(scaling):
    """transformers 5 applies ``rope_scaling or rope_parameters``; the scaling was silently dropped."""
    with pytest.raises(UnsupportedConfigError, match="only unscaled RoPE"):
        lm_config_from_hf(_hf_config(rope_scaling=scaling))


@pytest.mark.parametrize("scaling", [None, {}, {"rope_type": "default"}])
def test_unscaled_rope_scaling_keeps_rope_parameters_theta(scaling):
    assert lm_config_from_hf(_hf_config(rope_scaling=scaling)).block.rope_theta == 500.0


@pytest.mark.parametrize("changes,match", [
    ({"hidden_size": 30, "head_dim": 8}, "not a multiple of num_attention_heads"),
    ({"num_key_value_heads": 3}, "divisible by num_kv_heads"),
    ({"hidden_size": 12, "head_dim": 3}, "even head_dim"),
])
def test_structural_hf_config_problems_are_unsupported(changes, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        lm_config_from_hf(_hf_config(**changes))


def test_hf_config_base_without_rope_base_records_it():
    params, lm = _hf_params(_hf_config())
    out = hf_config_from_lm(lm, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert lm_config_from_hf(out).block.rope_theta == 500.0


# ----------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("bad_dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("fmt", ["hf", "llama2c"])
def test_non_float_weight_is_named(fmt, bad_dtype):
    """An integer / bool tensor in a weight's place was imported as is."""
    if fmt == "hf":
        params, lm = _hf_params(_hf_config())
        sd = hf_state_dict(params, lm)
        key = "model.layers.1.post_attention_layernorm.weight"
    else:
        lm = LMConfig(11, 2, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=8), tie_embeddings=True)
        sd = llama2c_state_dict(init_lm(jax.random.key(0), lm), lm)
        key = "norm.weight"
    sd[key] = sd[key].to(bad_dtype)
    with pytest.raises(CheckpointMismatchError, match=rf"{key}: dtype {str(bad_dtype).split('.')[1]}"):
        if fmt == "hf":
            interop.import_hf_state_dict(sd, _hf_config())
        else:
            interop.import_llama2c_checkpoint({"model_args": {"dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                                              "vocab_size": 11, "hidden_dim": 20, "max_seq_len": 8},
                                               "model": sd}, dtype="float32")


@pytest.mark.parametrize("kind", ["numpy+torch", "jax"])
def test_hf_state_dict_of_arrays_imports_bit_exact(kind):
    """Only all-numpy or all-torch state dicts were accepted; JAX arrays were 'not tensors'."""
    params, lm = _hf_params(_hf_config())
    sd = hf_state_dict(params, lm)
    if kind == "jax":
        sd = {k: jnp.asarray(v.numpy()) for k, v in sd.items()}
    else:
        sd = {k: (v.numpy() if i % 2 else v) for i, (k, v) in enumerate(sd.items())}
    got = interop.import_hf_state_dict(sd, _hf_config()).params
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(got)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- llama2.c headers
def _small_llama2c(tmp_path, version, shared=True):
    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=7), tie_embeddings=shared)
    path = str(tmp_path / f"m{version}.bin")
    interop.save_llama2c_bin(path, init_lm(jax.random.key(0), lm), lm, version=version)
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("cut", [20, 36, 255])
def test_llama2c_v1_truncated_header(tmp_path, cut):
    """A v1 file cut inside its header raised struct.error (not an interop error)."""
    data = _small_llama2c(tmp_path, 1)
    path = tmp_path / "cut.bin"
    path.write_bytes(data[:cut])
    for load in (interop.load_checkpoint, interop.load_llama2c):
        with pytest.raises(CorruptCheckpointError, match="header is truncated"):
            load(str(path))


@pytest.mark.parametrize("fields", [(0,) * 7, (16, 20, 1, 0, 0, 11, 7), (16, 20, 1, 4, 2, -11, 7)])
def test_llama2c_v1_invalid_header(tmp_path, fields):
    """A zero n_heads raised ZeroDivisionError."""
    path = tmp_path / "bad.bin"
    header = struct.pack("<Ii7iB", 0x616B3432, 1, *fields, 1)
    path.write_bytes(header + b"\0" * (300 - len(header)))
    with pytest.raises(CorruptCheckpointError, match="version-1 header is invalid"):
        interop.load_checkpoint(str(path))


@pytest.mark.parametrize("shared", [True, False])
def test_llama2c_v0_trailing_bytes(tmp_path, shared):
    """Was 'unknown checkpoint format'; now names the trailing bytes like v1 does."""
    data = _small_llama2c(tmp_path, 0, shared)
    path = tmp_path / "trail.bin"
    path.write_bytes(data + b"\0" * 8)
    for load in (interop.load_checkpoint, interop.load_llama2c_bin):
        with pytest.raises(CorruptCheckpointError, match="8 trailing bytes"):
            load(str(path))


@pytest.mark.parametrize("version", [0, 1])
def test_failed_llama2c_export_keeps_the_earlier_file(tmp_path, version):
    """A shape error halfway used to leave a partial .bin under the real name."""
    good = _small_llama2c(tmp_path, version)
    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=7), tie_embeddings=True)
    path = tmp_path / f"m{version}.bin"
    bad_tables = (np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="nothing written"):
        interop.save_llama2c_bin(str(path), init_lm(jax.random.key(1), lm), lm, version=0, rope_tables=bad_tables)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left behind


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_hf_export_replaces_files_whole(tmp_path, weights):
    cfg = _hf_config()
    params, lm = _hf_params(cfg)
    interop.save_hf(str(tmp_path), params, lm, weights=weights, base_config=cfg)
    interop.save_hf(str(tmp_path), params, lm, weights=weights, base_config=cfg)  # over an earlier export
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    back = interop.load_hf(str(tmp_path))
    for a, b in zip(jax.tree_util.tree_leaves(back.params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _sharded(tmp_path, weight_map, shards):
    from safetensors.numpy import save_file

    cfg = _hf_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(tmp_path)


def test_sharded_index_refuses_duplicates_and_escaping_names(tmp_path):
    cfg = _hf_config()
    params, lm = _hf_params(cfg)
    sd = {k: v.numpy() for k, v in hf_state_dict(params, lm).items()}
    keys = sorted(sd)
    a = {k: sd[k] for k in keys[: len(keys) // 2]}
    b = {k: sd[k] for k in keys[len(keys) // 2 - 1:]}  # one tensor in both shards
    wm = {**{k: "a.safetensors" for k in a}, **{k: "b.safetensors" for k in b}}
    (tmp_path / "dup").mkdir()
    d = _sharded(tmp_path / "dup", wm, {"a.safetensors": a, "b.safetensors": b})
    with pytest.raises(CorruptCheckpointError, match="are in both 'a.safetensors' and 'b.safetensors'"):
        interop.load_hf(d)
    (tmp_path / "esc").mkdir()
    with pytest.raises(CorruptCheckpointError, match="is not a file inside"):
        interop.load_hf(_sharded(tmp_path / "esc", {keys[0]: "../a.safetensors"}, {}))


def test_swish_activation_is_silu():
    assert lm_config_from_hf(_hf_config(hidden_act="swish")) == lm_config_from_hf(_hf_config())
    with pytest.raises(UnsupportedConfigError, match="hidden_act 'gelu'"):
        lm_config_from_hf(_hf_config(hidden_act="gelu"))


# ----------------------------------------------------------------------------- found by probing, 2026-12-06
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
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("zip_format", [True, False])
def test_torch_pickles_are_still_detected(tmp_path, zip_format):
    path = str(tmp_path / "sd.pt")
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=zip_format)
    assert interop.detect_format(path) == "torch_pickle"


@pytest.mark.parametrize("earlier", ["model.safetensors", "model.safetensors.index.json",
                                     "pytorch_model.bin.index.json"])
def test_hf_bin_export_refuses_files_that_would_shadow_it(tmp_path, earlier):
    """Loaders read model.safetensors and the indexes before pytorch_model.bin:
    a 'bin' export beside them silently reloaded the earlier weights."""
    cfg = _hf_config()
    params, lm = _hf_params(cfg)
    (tmp_path / earlier).write_bytes(b"earlier")
    with pytest.raises(interop.InteropError, match=f"already holds.*{earlier}.*shadowed"):
        interop.save_hf(str(tmp_path), params, lm, weights="bin", base_config=cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [earlier]  # nothing written, nothing removed
    assert (tmp_path / earlier).read_bytes() == b"earlier"


def test_hf_safetensors_export_over_a_bin_export_reloads_the_new_weights(tmp_path):
    cfg = _hf_config()
    params, lm = _hf_params(cfg)
    other = jax.tree_util.tree_map(lambda a: a + 1, params)
    interop.save_hf(str(tmp_path), params, lm, weights="bin", base_config=cfg)
    interop.save_hf(str(tmp_path), other, lm, weights="safetensors", base_config=cfg)
    back = interop.load_hf(str(tmp_path)).params
    for a, b in zip(jax.tree_util.tree_leaves(other), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_seed_state_dict_import_refuses_half_rope():
    """The seed block rotates interleaved pairs; a state dict imported under
    rope_style='half' silently became another model."""
    from eae_runtime.contrib import PreNormTransformerBlock

    blocks = torch.nn.ModuleList([PreNormTransformerBlock(16, 4, num_kv_heads=2, max_seq_len=8, ffn_hidden_dim=24)])
    cfg = dataclasses.replace(interop.import_seed_blocks(blocks).config, rope_style="half")
    with pytest.raises(UnsupportedConfigError, match="rope_style='half'"):
        interop.import_seed_blocks(blocks.state_dict(), cfg)
    ok = interop.import_seed_blocks(blocks.state_dict(), dataclasses.replace(cfg, rope_style="interleaved"))
    assert ok.config.rope_style == "interleaved"


def test_float64_checkpoint_error_is_an_interop_error_and_parity_converts(tmp_path):
    """float64 weights raised a bare TypeError, which the parity CLI did not
    catch (a traceback and exit 1, the code for 'over tolerance')."""
    from interop.parity import checkpoint_case

    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=8), tie_embeddings=True)
    sd = {k: v.double() for k, v in llama2c_state_dict(init_lm(jax.random.key(0), lm), lm).items()}
    ckpt = {"model_args": {"dim": 16, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 11,
                           "hidden_dim": 20, "max_seq_len": 8}, "model": sd}
    with pytest.raises(interop.Float64CheckpointError, match="float64") as info:
        interop.import_llama2c_checkpoint(ckpt)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    path = str(tmp_path / "f64.pt")
    torch.save(ckpt, path)
    case = checkpoint_case(path, dtype="float32", batch=1, seq=4)
    assert all(np.asarray(leaf).dtype == np.float32 for leaf in jax.tree_util.tree_leaves(case.jax_params))


def test_tied_head_stored_in_fortran_order_is_recognised():
    """A tied head held as a transposed-back (Fortran-ordered) copy raised
    numpy's 'last axis must be contiguous' instead of importing."""
    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=8), tie_embeddings=True)
    sd = {k: v.numpy() for k, v in llama2c_state_dict(init_lm(jax.random.key(0), lm), lm).items()}
    sd["output.weight"] = np.asfortranarray(sd["tok_embeddings.weight"])
    args = {"dim": 16, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 11, "hidden_dim": 20,
            "max_seq_len": 8}
    assert interop.import_llama2c_checkpoint({"model_args": args, "model": sd}).config.tie_embeddings
    hf_cfg = _hf_config(tie_word_embeddings=True)
    params, hf_lm = _hf_params(hf_cfg)
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
