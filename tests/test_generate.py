"""``eae-jax generate`` (eae_jax.generate): outputs against the library and the recomputing loop, every exit code."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, STORIES, needs_stories
from eae_jax.cli import main as cli_main
from eae_jax.generate import main
from eae_jax.models import init_lm
from eae_jax.models.decode import generate
from eae_jax.models.sampling import Sampling
from eae_jax.text import ByteTokenizer
from interop.generate import greedy_generate_jax
from interop.llama2c import lm_config_from_model_args, save_llama2c_bin

ARGS = {"dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 24, "max_seq_len": 32}


@pytest.fixture(scope="module")
def bin_model(tmp_path_factory):
    """A random llama2.c .bin with a 257-id vocabulary (the byte tokenizer's), alone in its folder."""
    cfg = lm_config_from_model_args(dict(ARGS, vocab_size=257))
    params = init_lm(jax.random.key(0), cfg)
    # A small tied table keeps the logits flat enough that sampling with other seeds goes elsewhere
    # (N(0, 1) rows make a token's own logit dominate: the model would repeat its input).
    params["embed"] = params["embed"] * 0.05
    path = str(tmp_path_factory.mktemp("bin_model") / "model.bin")
    save_llama2c_bin(path, params, cfg)
    return path, params, cfg


def _ids(text):
    return [int(t) for t in text.split()]


@needs_stories
def test_stories260k_greedy_reproduces_the_recomputing_loop(capsys):
    assert cli_main(["generate", STORIES, "--temperature", "0", "--steps", "256"]) == 0
    got = _ids(capsys.readouterr().out)
    from interop.llama2c import load_llama2c_bin

    model = load_llama2c_bin(STORIES)
    assert got == greedy_generate_jax(model.params, model.config, [1], 256).tokens.tolist()
    with open(os.path.join(ROOT, "experiments", "results", "stories260k_generate.json")) as f:
        recorded = json.load(f)["jax_tokens"]
    assert got[:len(recorded)] == recorded


def test_ids_prompt_sampled_equals_the_library(bin_model, capsys):
    path, params, cfg = bin_model
    argv = [path, "--ids", "5,6,7", "--steps", "12", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.8",
            "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr()
    want = generate(params, cfg, [5, 6, 7], 12, sampling=Sampling(0.9, 20, 0.8), key=jax.random.key(3)).tokens
    assert _ids(out.out) == want.tolist()
    assert "12 tokens" in out.err
    assert main(argv) == 0 and _ids(capsys.readouterr().out) == want.tolist()        # the seed fixes the run
    assert main(argv[:-1] + ["4"]) == 0 and _ids(capsys.readouterr().out) != want.tolist()


def test_text_prompt_streams_decoded_text(bin_model, tmp_path, capsys):
    path, params, cfg = bin_model
    tok_dir = tmp_path / "tok"
    ByteTokenizer().save(str(tok_dir))
    assert main([path, "--tokenizer", str(tok_dir), "--prompt", "hé", "--steps", "20", "--temperature", "0"]) == 0
    prompt = [256] + list("hé".encode())
    tokens = generate(params, cfg, prompt, 20).tokens.tolist()         # test_decode checks it against recomputing
    assert capsys.readouterr().out == ByteTokenizer().decode(tokens) + "\n"
    # Without BOS, as ids; one byte more keeps the shapes (and the compiled steps) of the run above.
    assert main([path, "--tokenizer", "bytes", "--prompt", "hé!", "--steps", "20", "--temperature", "0",
                 "--output", "ids", "--no-bos"]) == 0
    assert _ids(capsys.readouterr().out) == generate(params, cfg, list("hé!".encode()), 20).tokens.tolist()


def test_a_training_run_and_its_saved_tokenizer(tiny_run, capsys, fast_compiles):
    from eae_jax.train import TrainConfig
    from eae_jax.train import checkpoint as ckpt
    from eae_jax.train.loop import build

    newest = ckpt.latest(os.path.join(tiny_run, "checkpoints"))
    train_cfg = TrainConfig(**ckpt.read_metadata(newest)["config"])
    state, _ = ckpt.restore(newest, build(train_cfg)[4])               # the training loop's own state, in full
    want = greedy_generate_jax(state.params, train_cfg.model(), [1, 2], 6).tokens.tolist()
    for source in (tiny_run, os.path.join(tiny_run, "checkpoints"), newest):
        assert main([source, "--ids", "1,2", "--steps", "6", "--temperature", "0"]) == 0
        assert _ids(capsys.readouterr().out) == want
    assert main([tiny_run, "--steps", "3"]) == 2                       # no tokenizer saved: no BOS to start from
    assert "--prompt or --ids" in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", [
    (["--prompt", "x", "--ids", "1"], "not both"),
    (["--prompt", "x"], "no tokenizer is known"),
    (["--ids", "1,257"], r"\[0, 257\)"),
    (["--ids", "1,a"], "comma-separated integers"),
    (["--steps", "32"], "context of 32"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-2"], "top-k"),
    (["--output", "text"], "needs a tokenizer"),
    (["--tokenizer", "no/such/tokenizer.json"], "no such file"),
])
def test_bad_arguments_exit_2_before_generating(bin_model, capsys, extra, match):
    assert main([bin_model[0], "--steps", "4"] + extra) == 2               # later flags win
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err
    assert __import__("re").search(match, out.err), out.err


def test_bad_files_exit_2(tmp_path, bin_model, capsys):
    assert main([str(tmp_path / "missing.bin")]) == 2
    assert "no such model" in capsys.readouterr().err
    (tmp_path / "young_run" / "checkpoints").mkdir(parents=True)
    assert main([str(tmp_path / "young_run")]) == 2
    assert "without a complete checkpoint" in capsys.readouterr().err
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x01\x02\x03" * 10)
    assert main([str(junk)]) == 2
    assert "unknown checkpoint format" in capsys.readouterr().err
    big = tmp_path / "big"
    big.mkdir()
    (big / "tokenizer.bin").write_bytes(b"\x01\x00\x00\x00" + b"".join(
        np.float32(0).tobytes() + np.uint32(1).tobytes() + bytes([i % 256]) for i in range(300)))
    assert main([bin_model[0], "--tokenizer", str(big / "tokenizer.bin")]) == 2
    assert "300 ids but the model only 257" in capsys.readouterr().err
    assert main([bin_model[0], "--no-such-flag"]) == 2
    assert main(["--help"]) == 0


def test_formats_that_need_torch_exit_2_without_it(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from interop import save_hf
    from interop.hf_llama import lm_config_from_hf

    cfg = lm_config_from_hf({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
                             "num_hidden_layers": 1, "vocab_size": 32, "max_position_embeddings": 16})
    save_hf(str(tmp_path / "hf"), init_lm(jax.random.key(0), cfg), cfg)
    torch.save({"model_args": {}, "model": {}}, str(tmp_path / "ckpt.pt"))
    monkeypatch.setitem(sys.modules, "torch", None)                    # as if torch were not installed
    for source in (tmp_path / "hf", tmp_path / "ckpt.pt"):
        assert main([str(source), "--ids", "1"]) == 2
        assert "needs PyTorch" in capsys.readouterr().err


def test_a_failure_while_generating_exits_1(tmp_path, bin_model, capsys):
    _, params, cfg = bin_model
    bad = dict(params, final_norm={"scale": params["final_norm"]["scale"].at[0].set(jnp.inf)})
    path = str(tmp_path / "nan.bin")
    save_llama2c_bin(path, bad, cfg)
    assert main([path, "--ids", "5,6,7,8", "--steps", "20", "--temperature", "0"]) == 1   # shapes compiled above
    out = capsys.readouterr()
    assert out.out == "5 6 7 8\n" and "not finite" in out.err and "failed after 0 tokens" in out.err


def test_llama2c_bin_and_runs_need_no_torch(bin_model, tiny_run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)                    # any import of torch now fails
    assert main([bin_model[0], "--ids", "5,6,7,8", "--steps", "20", "--temperature", "0"]) == 0
    assert main([tiny_run, "--ids", "1,2", "--steps", "6", "--temperature", "0"]) == 0
    assert "error" not in capsys.readouterr().err
