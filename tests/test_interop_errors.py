"""Bad inputs give clear errors: unsafe pickles, truncated files, missing layers,
wrong shapes, unknown formats, unsupported configurations."""

import dataclasses
import io
import json
import os
import pickle
import struct
import zipfile

import chex
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("eae_runtime")
pytest.importorskip("safetensors")

import interop  # noqa: E402
from interop.errors import (  # noqa: E402
    CheckpointMismatchError,
    CorruptCheckpointError,
    UnknownFormatError,
    UnsafeCheckpointError,
    UnsupportedConfigError,
)

import jax  # noqa: E402

from conftest import STORIES, hf_config_dict, hf_params, needs_stories, small_llama2c_bytes  # noqa: E402
from eae_jax.blocks import BlockConfig  # noqa: E402
from eae_jax.models import LMConfig, init_lm  # noqa: E402
from interop.hf_llama import hf_state_dict, lm_config_from_hf  # noqa: E402
from interop.llama2c import llama2c_state_dict  # noqa: E402


class _CreatesFile:
    """Unpickling this calls ``open(path, 'w')``: it creates ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _RunsCode:
    """Unpickling this calls ``exec`` on a snippet that writes ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('pwned')",))


def seed_blocks(depth=2):
    from eae_runtime.contrib import PreNormTransformerBlock

    torch.manual_seed(0)
    return torch.nn.ModuleList([PreNormTransformerBlock(32, 4, num_kv_heads=2, max_seq_len=64, ffn_hidden_dim=48)
                                for _ in range(depth)])


# ----------------------------------------------------------------------------- security
@pytest.mark.parametrize("payload", [_CreatesFile, _RunsCode])
def test_malicious_torch_zip_is_refused_and_runs_nothing(tmp_path, payload):
    marker = str(tmp_path / "marker.txt")
    path = str(tmp_path / "evil.pt")
    # The payload comes first, so an unrestricted unpickler runs it before anything else.
    torch.save({"x": payload(marker), "model_args": {"dim": 8}, "model": {"w": torch.zeros(2)}}, path)
    assert not os.path.exists(marker)
    for load in (interop.load_torch_file, interop.load_llama2c, interop.load_checkpoint,
                 lambda p: interop.load_torch_file(p, allow_modules=True)):
        with pytest.raises(UnsafeCheckpointError, match="refused to load") as info:
            load(path)
        assert not os.path.exists(marker), "the pickle's code ran"
        assert "Nothing from the file was executed" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert info.value.global_name in ("io.open", "exec")
    assert "weights_only=False" not in str(info.value)  # no advice to switch the protection off
    # The payload is live: a plain unpickler of the file's pickle runs it (and then fails on
    # the tensor records it cannot resolve, which does not matter here).
    with zipfile.ZipFile(path) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            return None

    with pytest.raises(Exception):
        _Unpickler(io.BytesIO(data)).load()
    assert os.path.exists(marker)


def test_malicious_plain_pickle_is_refused(tmp_path):
    marker = str(tmp_path / "marker.txt")
    path = str(tmp_path / "evil.bin")
    with open(path, "wb") as f:
        pickle.dump({"w": _CreatesFile(marker)}, f, protocol=2)
    with pytest.raises(UnsafeCheckpointError):
        interop.load_torch_file(path)
    assert not os.path.exists(marker)


def test_module_classes_need_the_explicit_allowlist(tmp_path):
    path = str(tmp_path / "stack.pt")
    torch.save(seed_blocks(), path)
    with pytest.raises(UnsafeCheckpointError, match="torch.nn.modules.container.ModuleList"):
        interop.load_torch_file(path)
    assert isinstance(interop.load_torch_file(path, allow_modules=True), torch.nn.ModuleList)


def test_other_module_classes_stay_refused(tmp_path):
    path = str(tmp_path / "other.pt")
    torch.save(torch.nn.Sequential(torch.nn.Conv1d(2, 2, 1)), path)
    with pytest.raises(UnsafeCheckpointError, match="Conv1d"):
        interop.load_torch_file(path, allow_modules=True)


# ----------------------------------------------------------------------------- truncated / unknown
def test_truncated_torch_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model_args": {"dim": 8}, "model": {"w": torch.randn(64, 64)}}, path)
    data = open(path, "rb").read()
    cut = str(tmp_path / "cut.pt")
    with open(cut, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        interop.load_llama2c(cut)


def test_truncated_safetensors(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "model.safetensors")
    save_file({"a": torch.randn(32, 32)}, path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated or damaged safetensors"):
        interop.load_safetensors_file(path)


@needs_stories
def test_truncated_llama2c_bin(tmp_path):
    data = open(STORIES, "rb").read()
    cut = str(tmp_path / "cut.bin")
    with open(cut, "wb") as f:
        f.write(data[:-4096])
    with pytest.raises(CorruptCheckpointError, match=r"needs 1056540 bytes, the file has 1052444: it is truncated"):
        interop.load_checkpoint(cut)


def test_truncated_llama2c_bin_synthetic(tmp_path):
    # A valid v1 header promising more tensors than the file holds.
    path = str(tmp_path / "v1.bin")
    header = struct.pack("<Ii7iB", 0x616B3432, 1, 16, 32, 2, 2, 1, 20, 8, 1)
    with open(path, "wb") as f:
        f.write(header + b"\0" * (256 - len(header)) + b"\0" * 400)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        interop.load_llama2c_bin(path)


@pytest.mark.parametrize("content", [b"", b"hello world, not a checkpoint at all" * 4, os.urandom(2048)])
def test_unknown_format(tmp_path, content):
    path = str(tmp_path / "mystery.bin")
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises((UnknownFormatError, CorruptCheckpointError)) as info:
        interop.load_checkpoint(path)
    assert "mystery.bin" in str(info.value)
    if content:
        assert isinstance(info.value, UnknownFormatError) and "unknown checkpoint format" in str(info.value)


def test_garbage_that_looks_like_a_pickle(tmp_path):
    path = str(tmp_path / "garbage.pt")
    with open(path, "wb") as f:
        f.write(b"\x80\x02" + bytes(range(60, 160)))
    with pytest.raises(CorruptCheckpointError, match="not a weights-only torch pickle"):
        interop.load_checkpoint(path)


def test_unknown_objects_and_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        interop.load_checkpoint(str(tmp_path / "absent.pt"))
    with pytest.raises(UnknownFormatError, match="without config.json"):
        interop.load_checkpoint(str(tmp_path))
    path = str(tmp_path / "list.pt")
    torch.save([1, 2, 3], path)
    with pytest.raises(UnknownFormatError, match="list"):
        interop.load_checkpoint(path)
    with pytest.raises(UnknownFormatError, match="PreNormTransformerBlock"):
        interop.import_seed_blocks(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    with pytest.raises(UnknownFormatError, match="model_args"):
        interop.import_llama2c_checkpoint({"model": {}})


def test_llama2c_v2_is_refused(tmp_path):
    path = str(tmp_path / "q80.bin")
    header = struct.pack("<Ii7iBi", 0x616B3432, 2, 16, 32, 2, 2, 1, 20, 8, 1, 16)
    with open(path, "wb") as f:
        f.write(header + b"\0" * 300)
    with pytest.raises(UnknownFormatError, match="version-2"):
        interop.load_llama2c_bin(path)


# ----------------------------------------------------------------------------- strict key / shape checks
def test_missing_layer_unexpected_key_and_wrong_shape_in_one_error():
    blocks = seed_blocks(3)
    cfg = interop.import_seed_blocks(blocks).config
    sd = blocks.state_dict()
    for k in [k for k in sd if k.startswith("1.")]:
        del sd[k]  # layer 1 gone
    sd["2.ffn.up_proj.weight"] = torch.zeros(48, 31)
    sd["2.attn.q_proj.bias"] = torch.zeros(32)
    with pytest.raises(CheckpointMismatchError) as info:
        interop.import_seed_blocks(sd, cfg)
    err = info.value
    assert isinstance(err, ValueError)
    assert sorted(err.missing) == sorted(f"1.{k}" for k in blocks[1].state_dict())
    assert err.unexpected == ["2.attn.q_proj.bias"]
    assert err.shape_mismatches == [("2.ffn.up_proj.weight", (48, 31), (48, 32))]
    msg = str(err)
    for name in err.missing + err.unexpected:
        assert name in msg
    assert "checkpoint has (48, 31), model expects (48, 32)" in msg


def test_missing_last_layer_needs_depth():
    blocks = seed_blocks(3)
    cfg = interop.import_seed_blocks(blocks).config
    sd = {k: v for k, v in blocks.state_dict().items() if not k.startswith("2.")}
    with pytest.raises(CheckpointMismatchError, match=r"2\.attn\.q_proj\.weight"):
        interop.import_seed_blocks(sd, cfg, depth=3)


def test_bare_state_dict_without_config_is_explained():
    with pytest.raises(ValueError, match="does not record num_heads"):
        interop.import_seed_blocks(seed_blocks().state_dict())


def hf_dir(tmp_path, **overrides):
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    path = str(tmp_path / "hf")
    model.save_pretrained(path)
    return path


def test_hf_checkpoint_with_a_missing_layer(tmp_path):
    from safetensors.torch import load_file, save_file

    path = hf_dir(tmp_path)
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    removed = sorted(k for k in tensors if k.startswith("model.layers.1."))
    tensors = {k: v for k, v in tensors.items() if k not in removed}
    tensors["model.layers.2.mlp.down_proj.weight"] = torch.zeros(32, 47)
    save_file(tensors, st)
    with pytest.raises(CheckpointMismatchError) as info:
        interop.load_hf(path)
    assert info.value.missing == removed and len(removed) == 9
    assert info.value.shape_mismatches == [("model.layers.2.mlp.down_proj.weight", (32, 47), (32, 48))]
    assert "model.layers.1.self_attn.q_proj.weight" in str(info.value)


def test_hf_tied_head_that_differs(tmp_path):
    from safetensors.torch import load_file, save_file

    path = hf_dir(tmp_path, tie_word_embeddings=True)
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, st)
    with pytest.raises(CheckpointMismatchError, match="tied but lm_head.weight differs"):
        interop.load_hf(path)


@pytest.mark.parametrize("overrides,needle", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope type 'linear'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(head_dim=16), "head_dim 16"),
])
def test_hf_unsupported_configs(overrides, needle):
    cfg = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    cfg.update(overrides)
    with pytest.raises(UnsupportedConfigError, match=needle.replace("(", r"\(")):
        interop.lm_config_from_hf(cfg)


def test_hf_dir_without_weights(tmp_path):
    path = hf_dir(tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(UnknownFormatError, match="no model.safetensors"):
        interop.load_hf(path)


def test_float64_is_not_silently_downcast():
    blocks = seed_blocks().double()
    with pytest.raises(TypeError, match="float64"):
        interop.import_seed_blocks(blocks)
    imported = interop.import_seed_blocks(blocks, dtype="float32")
    assert imported.params["attn"]["wq"].dtype == np.float32


def test_export_refuses_conventions_the_target_cannot_express():
    from eae_jax.blocks import BlockConfig, init_stack
    import jax

    cfg = BlockConfig(dim=32, num_heads=4, num_kv_heads=2, ffn_hidden_dim=48, rope_style="half")
    params = init_stack(jax.random.key(0), cfg, 2)
    with pytest.raises(UnsupportedConfigError, match="interleaved"):
        interop.export_seed_blocks(params, cfg)
    with pytest.raises(ValueError, match="missing"):
        interop.seed_state_dict({"attn": params["attn"]}, cfg)


# ----------------------------------------------------------------------------- found by probing: configs, headers, shards
@pytest.mark.parametrize("scaling", ["linear", ["linear", 2.0], 2.0])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rope_settings_that_are_not_dicts_are_refused(key, scaling):
    """rope_scaling given as a string or a list was accepted (transformers refuses both)."""
    with pytest.raises(UnsupportedConfigError, match=f"config {key} must be a dict of RoPE parameters or null"):
        lm_config_from_hf(hf_config_dict(**{key: scaling}))


@pytest.mark.parametrize("name", ["model.SAFETENSORS", "weights.bin"])
def test_weight_files_are_read_by_content_not_suffix(tmp_path, name):
    """A safetensors file whose name does not end in '.safetensors' was read as a torch pickle."""
    from safetensors.numpy import save_file

    cfg = hf_config_dict()
    params, lm = hf_params(cfg)
    sd = {k: v.numpy() for k, v in hf_state_dict(params, lm).items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in sd}}))
    for source in (str(tmp_path), str(tmp_path / name)):
        chex.assert_trees_all_equal(interop.load_hf(source).params, params)


def _sharded(tmp_path, weight_map, shards):
    from safetensors.numpy import save_file

    cfg = hf_config_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(tmp_path)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_rope_scaling_next_to_rope_parameters_is_refused(scaling):
    """transformers 5 applies ``rope_scaling or rope_parameters``; the scaling was silently dropped."""
    with pytest.raises(UnsupportedConfigError, match="only unscaled RoPE"):
        lm_config_from_hf(hf_config_dict(rope_scaling=scaling))


@pytest.mark.parametrize("scaling", [None, {}, {"rope_type": "default"}])
def test_unscaled_rope_scaling_keeps_rope_parameters_theta(scaling):
    assert lm_config_from_hf(hf_config_dict(rope_scaling=scaling)).block.rope_theta == 500.0


@pytest.mark.parametrize("changes,match", [
    ({"hidden_size": 30, "head_dim": 8}, "not a multiple of num_attention_heads"),
    ({"num_key_value_heads": 3}, "divisible by num_kv_heads"),
    ({"hidden_size": 12, "head_dim": 3}, "even head_dim"),
])
def test_structural_hf_config_problems_are_unsupported(changes, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        lm_config_from_hf(hf_config_dict(**changes))


@pytest.mark.parametrize("bad_dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("fmt", ["hf", "llama2c"])
def test_non_float_weight_is_named(fmt, bad_dtype):
    """An integer / bool tensor in a weight's place was imported as is."""
    if fmt == "hf":
        params, lm = hf_params(hf_config_dict())
        sd = hf_state_dict(params, lm)
        key = "model.layers.1.post_attention_layernorm.weight"
    else:
        lm = LMConfig(11, 2, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=8), tie_embeddings=True)
        sd = llama2c_state_dict(init_lm(jax.random.key(0), lm), lm)
        key = "norm.weight"
    sd[key] = sd[key].to(bad_dtype)
    with pytest.raises(CheckpointMismatchError, match=rf"{key}: dtype {str(bad_dtype).split('.')[1]}"):
        if fmt == "hf":
            interop.import_hf_state_dict(sd, hf_config_dict())
        else:
            interop.import_llama2c_checkpoint({"model_args": {"dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                                              "vocab_size": 11, "hidden_dim": 20, "max_seq_len": 8},
                                               "model": sd}, dtype="float32")


@pytest.mark.parametrize("cut", [20, 36, 255])
def test_llama2c_v1_truncated_header(tmp_path, cut):
    """A v1 file cut inside its header raised struct.error (not an interop error)."""
    data = small_llama2c_bytes(tmp_path, 1)
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
    data = small_llama2c_bytes(tmp_path, 0, shared)
    path = tmp_path / "trail.bin"
    path.write_bytes(data + b"\0" * 8)
    for load in (interop.load_checkpoint, interop.load_llama2c_bin):
        with pytest.raises(CorruptCheckpointError, match="8 trailing bytes"):
            load(str(path))


def test_sharded_index_refuses_duplicates_and_escaping_names(tmp_path):
    cfg = hf_config_dict()
    params, lm = hf_params(cfg)
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
    assert lm_config_from_hf(hf_config_dict(hidden_act="swish")) == lm_config_from_hf(hf_config_dict())
    with pytest.raises(UnsupportedConfigError, match="hidden_act 'gelu'"):
        lm_config_from_hf(hf_config_dict(hidden_act="gelu"))


@pytest.mark.parametrize("zip_format", [True, False])
def test_torch_pickles_are_still_detected(tmp_path, zip_format):
    path = str(tmp_path / "sd.pt")
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=zip_format)
    assert interop.detect_format(path) == "torch_pickle"


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
