"""``eae-jax export`` (eae_jax.export): a training run read back by transformers and by llama2.c's layout."""

import json
import os
import shutil
import struct
import sys

import jax
import numpy as np
import pytest

from eae_jax.export import main
from eae_jax.model_files import load_model
from eae_jax.models import lm_apply
from eae_jax.text import Llama2cTokenizer


@pytest.fixture(scope="module")
def run_model(tiny_run):
    return load_model(tiny_run)


def test_hf_export_loads_in_transformers_with_the_same_logits(tiny_run, run_model, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = str(tmp_path / "hf")
    assert main([tiny_run, out]) == 0
    assert "wrote" in capsys.readouterr().err
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 16), 0, run_model.config.vocab_size))
    with torch.no_grad():
        got = hf(torch.tensor(tokens)).logits.numpy()
    want = np.asarray(lm_apply(run_model.params, tokens, run_model.config))   # interleaved RoPE, as trained
    assert np.max(np.abs(got - want)) <= 1e-4, np.max(np.abs(got - want))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["num_hidden_layers"] == 4 and config["tie_word_embeddings"] is False


def test_hf_export_carries_the_tokenizer_and_dtype(tiny_run, tmp_path, capsys):
    pytest.importorskip("torch")
    run = str(tmp_path / "run")
    shutil.copytree(tiny_run, run)
    # A llama2.c tokenizer of 256 pieces fits the tiny preset's 256 ids (BOS 1, EOS 2).
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [bytes([i]) for i in range(3, 256)]
    (tmp_path / "run" / "tokenizer.bin").write_bytes(
        struct.pack("<I", 6) + b"".join(struct.pack("<fI", 0.0, len(p)) + p for p in pieces))
    out = str(tmp_path / "hf")
    assert main([run, out, "--dtype", "bfloat16"]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    with open(os.path.join(out, "model.safetensors"), "rb") as f:            # the safetensors header, read by hand
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert isinstance(load_model(out).tokenizer, Llama2cTokenizer)


def test_llama2c_bin_and_pt_exports(tiny_run, run_model, tmp_path, capsys):
    out = str(tmp_path / "model.bin")
    assert main([tiny_run, out]) == 0
    assert "norm_eps" in capsys.readouterr().err                     # trained with 1e-6; run.c reads 1e-5
    with open(out, "rb") as f:
        header = struct.unpack("<7i", f.read(28))
    b = run_model.config.block
    # dim, hidden, layers, heads, kv heads, vocab (negative: untied head stored last), seq_len
    assert header == (b.dim, b.ffn_hidden_dim, 4, b.num_heads, b.num_kv_heads, -256, b.max_seq_len)
    embed = np.fromfile(out, "<f4", count=256 * b.dim, offset=28).reshape(256, b.dim)
    np.testing.assert_array_equal(embed, run_model.params["embed"])
    back = load_model(out)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back.params, run_model.params)
    torch = pytest.importorskip("torch")
    pt = str(tmp_path / "ckpt.pt")
    assert main([tiny_run, pt]) == 0
    ckpt = torch.load(pt, weights_only=True)
    assert ckpt["model_args"]["norm_eps"] == b.norm_eps
    from_pt = load_model(pt)
    assert from_pt.config == run_model.config                        # the .pt keeps eps and all
    jax.tree_util.tree_map(np.testing.assert_array_equal, from_pt.params, run_model.params)
    np.testing.assert_array_equal(ckpt["model"]["layers.3.attention.wq.weight"].numpy(),
                                  run_model.params["blocks"]["attn"]["wq"][3])


def test_bad_exports_exit_2_and_write_nothing(tiny_run, tmp_path, monkeypatch, capsys):
    existing = tmp_path / "old.bin"
    existing.write_bytes(b"keep me")
    cases = [
        ([str(tmp_path / "missing_run"), str(tmp_path / "x.bin")], "no such model"),
        ([tiny_run, str(existing)], "--force"),
        ([tiny_run, str(tmp_path)], "holds"),                              # a non-empty directory for hf
        ([tiny_run, str(existing), "--format", "hf", "--force"], "is a file"),
        ([tiny_run, str(tmp_path / "d.bin"), "--dtype", "bfloat16"], "float32"),
        ([tiny_run, str(tmp_path / "hf"), "--dtype", "int8"], "--dtype"),
        ([tiny_run, str(tmp_path / "no" / "dir" / "x.bin")], "does not exist"),
    ]
    for argv, match in cases:
        assert main(argv) == 2, argv
        assert match in capsys.readouterr().err, argv
    assert main([tiny_run, "x", "--format", "onnx"]) == 2                # argparse refuses the choice
    monkeypatch.setitem(sys.modules, "torch", None)                      # as if torch were not installed
    assert main([tiny_run, str(tmp_path / "hf")]) == 2
    assert "needs PyTorch" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["old.bin"] and existing.read_bytes() == b"keep me"


def test_a_model_llama2c_cannot_express_exits_2(tmp_path, capsys):
    pytest.importorskip("torch")
    from eae_jax.models import init_lm
    from interop import save_hf
    from interop.hf_llama import lm_config_from_hf

    cfg = lm_config_from_hf({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "rope_theta": 5e5,
                             "num_hidden_layers": 1, "vocab_size": 32, "max_position_embeddings": 16})
    save_hf(str(tmp_path / "hf"), init_lm(jax.random.key(0), cfg), cfg)
    assert main([str(tmp_path / "hf"), str(tmp_path / "m.bin")]) == 2
    assert "base 10000" in capsys.readouterr().err and not (tmp_path / "m.bin").exists()


def test_a_failure_while_writing_exits_1(tiny_run, tmp_path, monkeypatch, capsys):
    import interop.llama2c

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(interop.llama2c, "save_llama2c_bin", disk_full)
    assert main([tiny_run, str(tmp_path / "m.bin")]) == 1
    assert "No space left" in capsys.readouterr().err and not (tmp_path / "m.bin").exists()
