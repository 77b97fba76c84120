"""Bad inputs give clear errors: unsafe pickles, truncated files, missing layers,
wrong shapes, unknown formats, unsupported configurations."""

import io
import os
import pickle
import struct
import zipfile

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

STORIES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "stories260K.bin")


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


@pytest.mark.skipif(not os.path.isfile(STORIES), reason=f"stories260K.bin not found at {STORIES}")
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
