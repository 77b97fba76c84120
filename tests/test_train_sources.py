"""What a run trains on and from (eae_jax.train.sources): text folders and tokenizers, the
vocabulary they fix, held-out batches, and ``--init`` from an exported checkpoint whose loss the
fine-tune resumes."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import quiet
from eae_jax.cli import main
from eae_jax.model_files import load_model
from eae_jax.models import cross_entropy, lm_apply
from eae_jax.text import load_text_corpus
from eae_jax.train import TrainConfig, train
from eae_jax.train.sources import prepare_run

SEQ = 16
OFF = ["--no-plot", "--no-tensorboard", "--checkpoint-every", "100"]


@pytest.fixture(scope="module")
def notes(tmp_path_factory):
    """A folder of 40 small text documents."""
    root = tmp_path_factory.mktemp("notes") / "notes"
    root.mkdir()
    for i in range(40):
        (root / f"note{i:02d}.txt").write_text(f"note {i}: the quick brown fox jumps over the lazy dog {i * 7}.\n" * 5)
    return str(root)


def window_file(tmp_path, ids):
    """A token file of exactly one window: every batch drawn from it is that window."""
    path = str(tmp_path / "window.npy")
    np.save(path, np.asarray(ids, np.int32))
    return path


def loss_of(out, step=1):
    (record,) = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if json.loads(line).get("step") == step]
    return record["loss"]


# ----------------------------------------------------------------------------- text and vocabulary
def test_a_text_folder_with_a_trained_bpe_tokenizer(notes, tmp_path, capsys, fast_compiles):
    pytest.importorskip("tokenizers")
    out = str(tmp_path / "run")
    code = main(["train", "--text", notes, "--tokenizer", "bpe:300", "--steps", "2", "--batch", "2", "--seq-len",
                 str(SEQ), "--val-every", "2", "--val-batches", "2", "--out", out, *OFF])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    model = load_model(out)  # the run reads back with the tokenizer it was trained with
    assert model.tokenizer.kind == "hf" and model.config.vocab_size == model.tokenizer.vocab_size <= 300
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert f"text from {notes} (hf tokenizer, vocabulary {model.config.vocab_size})" in summary["trained_on"]
    # the validation loss is the held-out documents' loss under the logged params: recompute it
    corpus = load_text_corpus([notes], model.tokenizer, val_fraction=0.05)
    run = prepare_run(TrainConfig(text=[notes], tokenizer=os.path.join(out, "tokenizer.json"), batch=2,
                                  seq_len=SEQ, val_batches=2, out=out))
    assert np.array_equal(run.val[0, 0], np.asarray(corpus.val[: SEQ + 1], np.int32))  # the first held-out window
    want = np.mean([cross_entropy(lm_apply(model.params, b[:, :-1], model.config), b[:, 1:]) for b in run.val])
    (last,) = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if json.loads(line)["step"] == 2]
    assert last["val_loss"] == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("args, match", [
    (["--vocab-size", "256"], r"--vocab-size 256 is smaller than the tokenizer's 257 ids \(bytes\)"),
    (["--tokenizer", "bpe:12"], r"bpe:<vocab size >= 257>"),
    (["--val-data", "x.npy"], "--val-data applies to --data runs"),
    (["--data", "x.npy"], "give --text or --data, not both"),
    (["--synthetic"], "--synthetic trains on the synthetic task"),
    (["--val-fraction", "0.9"], r"val_fraction must be in \(0, 0.5\]"),
    (["--text", "/no/such/notes"], "text path /no/such/notes does not exist"),
])
def test_text_runs_refuse_what_does_not_fit_before_building(notes, tmp_path, capsys, monkeypatch, args, match):
    from eae_jax.train import loop

    monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built a model for a bad argument"))
    argv = ["train", "--steps", "1", "--seq-len", str(SEQ), "--out", str(tmp_path / "run")]
    code = main(argv + (["--text", notes] if "--text" not in args else []) + args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("eae-jax train: error: "), err
    assert __import__("re").search(match, err), err


def test_a_vocabulary_at_the_tokenizers_size_is_accepted(notes, tmp_path):
    run = prepare_run(TrainConfig(text=[notes], vocab_size=257, seq_len=SEQ, out=str(tmp_path / "r")))
    assert run.config.model().vocab_size == 257 and run.tokenizer.vocab_size == 257
    wider = prepare_run(TrainConfig(text=[notes], vocab_size=320, seq_len=SEQ, out=str(tmp_path / "r")))
    assert wider.config.model().vocab_size == 320  # padding rows are allowed


def test_val_fraction_bounds(notes, tmp_path):
    run = prepare_run(TrainConfig(text=[notes], val_fraction=0.5, seq_len=SEQ, out=str(tmp_path / "r")))
    assert run.val is not None  # half the documents held out is the most allowed
    for bad in (0.0, 0.5000001):
        with pytest.raises(ValueError, match="val_fraction must be in"):
            TrainConfig(text=[notes], val_fraction=bad)


def test_a_held_out_split_shorter_than_a_window_names_the_fix(tmp_path):
    doc = tmp_path / "one.txt"
    doc.write_text("line\n" * 30)
    with pytest.raises(ValueError, match="validation split .* holds .* tokens; one window needs 65"):
        prepare_run(TrainConfig(text=[str(doc)], seq_len=64, out=str(tmp_path / "r")))


# ----------------------------------------------------------------------------- --init
@pytest.fixture(scope="module")
def window(tiny_run, tmp_path_factory):
    """One window of the tiny run's vocabulary (256 ids), as a token file."""
    ids = np.asarray(jax.random.randint(jax.random.key(3), (SEQ + 1,), 0, 256))
    return window_file(tmp_path_factory.mktemp("window"), ids), ids


def fine_tune(init, data, out, capsys):
    """``out`` after one step of ``eae-jax train --init INIT --data DATA`` (batch 2)."""
    code = main(["train", "--init", init, "--data", data, "--seq-len", str(SEQ), "--batch", "2", "--steps", "1",
                 "--out", out, *OFF])
    assert code == 0, capsys.readouterr().err
    return out


def test_a_fine_tune_from_a_llama2c_export_resumes_its_loss(tiny_run, window, tmp_path, capsys):
    path, ids = window
    exported = str(tmp_path / "tiny.bin")
    assert main(["export", tiny_run, exported]) == 0
    out = fine_tune(exported, path, str(tmp_path / "ft"), capsys)
    # the trained run's own params (not the export) on that window, by the plain forward
    original = load_model(tiny_run)
    tokens = np.stack([ids, ids])
    want = cross_entropy(lm_apply(original.params, tokens[:, :-1], original.config), tokens[:, 1:])
    assert loss_of(out) == pytest.approx(float(want), rel=1e-6, abs=1e-6)
    tuned = load_model(out)  # the fine-tune kept the checkpoint's shape, llama2.c conventions included
    assert tuned.config.block.norm_eps == 1e-5 and tuned.config == load_model(exported).config


def test_a_fine_tune_from_a_hugging_face_export_resumes_its_loss(tiny_run, window, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, ids = window
    exported = str(tmp_path / "hf")
    assert main(["export", tiny_run, exported]) == 0
    out = fine_tune(exported, path, str(tmp_path / "ft"), capsys)
    hf = transformers.LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokens = torch.tensor(np.stack([ids, ids]), dtype=torch.long)
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert loss_of(out) == pytest.approx(float(want), rel=1e-5, abs=1e-5)
    assert load_model(out).config.block.rope_style == "half"  # Hugging Face's pairing, as imported


@pytest.mark.parametrize("args, match", [
    (["--dim", "128"], "--dim 128 but the checkpoint has 64"),
    (["--depth", "4", "--heads", "8"], "--heads 8 but the checkpoint has 4"),
])
def test_init_refuses_shape_flags_that_contradict_the_checkpoint(tiny_run, window, tmp_path, capsys, args, match):
    code = main(["train", "--init", tiny_run, "--data", window[0], "--seq-len", str(SEQ), "--out",
                 str(tmp_path / "ft"), *args])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "(drop those flags)" in err, err


def test_init_refuses_a_tokenizer_with_more_ids_than_the_model(tiny_run, notes, tmp_path):
    # the tiny run has 256 ids; the byte tokenizer needs 257
    with pytest.raises(ValueError, match="the --init model's vocabulary 256 is smaller than the tokenizer's 257"):
        train(TrainConfig(init=tiny_run, text=[notes], seq_len=SEQ, out=str(tmp_path / "ft")), log_fn=quiet)


def test_a_token_file_fine_tune_keeps_the_init_models_tokenizer(notes, tmp_path, capsys, fast_compiles):
    text_run = str(tmp_path / "text")
    train(TrainConfig(preset="tiny", text=[notes], seq_len=SEQ, batch=2, steps=1, out=text_run, plot=False,
                      tensorboard=False), log_fn=quiet)
    ids = np.asarray(load_model(text_run).tokenizer.encode("the quick brown fox jumps over")[:SEQ + 1])
    out = fine_tune(text_run, window_file(tmp_path, ids), str(tmp_path / "ft"), capsys)
    # eae-jax generate on the fine-tune reads text with the init model's tokenizer
    tuned = load_model(out).tokenizer
    assert tuned is not None and tuned.kind == load_model(text_run).tokenizer.kind
    assert list(tuned.encode("the quick brown fox jumps over")[:SEQ + 1]) == ids.tolist()
