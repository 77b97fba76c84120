"""The numpy safetensors reader, against the safetensors library as the writer,
and a Hugging Face LLaMA directory loaded with torch, safetensors and
transformers hidden (what the base install has)."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from interop.errors import CorruptCheckpointError
from interop.safetensors_numpy import read_safetensors

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _bits(t):
    """A torch tensor's raw bytes (dtypes numpy lacks included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_every_dtype_reads_back_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 4, generator=g), "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(), "f64": torch.randn(2, generator=g).double(),
        "e4m3": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(4, generator=g).to(torch.float8_e5m2),
        "i64": torch.arange(-3, 3), "i32": torch.arange(4, dtype=torch.int32),
        "i16": torch.arange(2, dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8), "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
    }
    path = str(tmp_path / "all.safetensors")
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    got = read_safetensors(path)
    assert set(got) == set(tensors)
    names = {"bf16": "bfloat16", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "bool": "bool"}
    for name, t in tensors.items():
        assert got[name].shape == tuple(t.shape), name
        assert got[name].tobytes() == _bits(t), name
        if name in names:
            assert got[name].dtype.name == names[name]
    np.testing.assert_array_equal(got["bf16"].astype(np.float32), tensors["bf16"].float().numpy())


def _write(path, header, data):
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


@pytest.mark.parametrize("header, data, needle", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "overlap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "a hole"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8),
     r"needs 12 bytes, its offsets \[0, 8\] span 8"),
    ({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, bytes(1), "dtype 'Q4'"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "shape"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(6), "2 bytes after the last tensor"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4), r"holds 4 \(truncated\)"),
    ({"a": {"dtype": "F32", "shape": [1]}}, bytes(4), "needs exactly dtype, shape and data_offsets"),
    ({"__metadata__": {"n": 1}}, b"", "__metadata__ must map names to strings"),
    ([1, 2], b"", "a JSON list, not an object"),
])
def test_damaged_headers_are_refused_by_name(tmp_path, header, data, needle):
    with pytest.raises(CorruptCheckpointError, match=needle):
        read_safetensors(_write(tmp_path / "bad.safetensors", header, data))


def test_a_header_longer_than_the_file_and_an_empty_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="a header of 1000 bytes in a file of 10"):
        read_safetensors(str(path))
    path.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="no header"):
        read_safetensors(str(path))
    assert read_safetensors(_write(tmp_path / "none.safetensors", {"__metadata__": {"a": "b"}}, b"")) == {}


#: Run in a fresh interpreter where torch, safetensors and transformers cannot be imported.
CHILD = """
import sys
for name in ("torch", "safetensors", "transformers"):
    sys.modules[name] = None
import numpy as np
from interop import load_hf
from interop.safe_load import load_safetensors_file
imported = load_hf(sys.argv[1])
raw = load_safetensors_file(sys.argv[1] + "/model.safetensors")
np.savez(sys.argv[2], **{k: v.view(np.uint16) for k, v in raw.items()},
         _embed=imported.params["embed"].view(np.uint16), _wq=imported.params["blocks"]["attn"]["wq"].view(np.uint16))
print(imported.config.depth, imported.params["embed"].dtype, sorted({str(v.dtype) for v in raw.values()}))
"""


def test_a_hf_llama_directory_loads_without_torch(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=24, num_hidden_layers=2, vocab_size=40,
                                      max_position_embeddings=32)
    folder = str(tmp_path / "llama")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    out = str(tmp_path / "tensors.npz")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", CHILD, folder, out], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["2", "bfloat16", "['bfloat16']"]
    want = safetensors_torch.load_file(os.path.join(folder, "model.safetensors"))
    got = np.load(out)
    for name, t in want.items():
        assert got[name].tobytes() == _bits(t), name
    assert got["_embed"].tobytes() == _bits(want["model.embed_tokens.weight"])
    assert got["_wq"][1].tobytes() == _bits(want["model.layers.1.self_attn.q_proj.weight"])
