"""What a training run shows and writes (eae_jax.train.monitor, progress, report): the quick
start on the built-in text, the progress bar, TensorBoard files read back by tensorboard's
own reader, the loss plot, the summary and the per-record metrics."""

import io
import json
import os

import numpy as np
import pytest

from conftest import quiet
from eae_jax.cli import main
from eae_jax.train import TrainConfig, train
from eae_jax.train.metrics import flops_per_token
from eae_jax.train.progress import Progress, format_duration, show_bar
from eae_jax.train.report import plot_losses, summarize

#: The README's quick start, shortened (fewer steps, the same corpus, model and tokenizer).
QUICK = ["--preset", "tiny", "--steps", "40", "--val-every", "20", "--log-every", "10"]


class FakeTerminal(io.StringIO):
    """stderr as a terminal: the progress bar draws into it."""

    def isatty(self):
        return True


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The shortened README command, run once: (out, stdout, stderr, exit code)."""
    import contextlib

    out = str(tmp_path_factory.mktemp("quick") / "tiny")
    stdout, stderr = io.StringIO(), FakeTerminal()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["train", *QUICK, "--out", out])
    return out, stdout.getvalue(), stderr.getvalue(), code


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


def test_quick_start_trains_on_the_standard_library_and_validation_loss_falls(quick_run):
    out, stdout, stderr, code = quick_run
    assert code == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["trained_on"].startswith("text from the standard library (bytes tokenizer, vocabulary 257)")
    log = records(out)
    vals = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    assert [s for s, _ in vals] == [0, 20, 40]  # the initial model, every --val-every, the end
    # ln(257) = 5.55 nats for a uniform guess; the step-0 model is about that bad
    assert vals[0][1] > 5.0
    assert summary["val_loss_drop"] >= 0.3 and summary["best_val_loss"] == min(v for _, v in vals)
    assert summary["val_loss_drop"] == pytest.approx(1 - summary["best_val_loss"] / vals[0][1])
    assert summary["first_val_loss"] == vals[0][1] and summary["best_val_step"] in (20, 40)
    assert summary["tokens"] == 40 * 16 * 64 and summary["steps_run"] == 40
    # what a person reads: the compile notice with its time, one line per record, the summary
    assert "compiling the train step (4 layers x 64 wide, 4/2 heads, FFN 176, vocab 257" in stdout
    assert "compiled in " in stdout
    assert "step 10/40  loss " in stdout and " tok/s " in stdout and "MFU n/a" in stdout
    assert "done: 40 steps in" in stdout and f"-{100 * summary['val_loss_drop']:.1f}%" in stdout
    # the tokenizer beside the checkpoints: eae-jax generate finds it
    from eae_jax.model_files import load_model

    model = load_model(out)
    assert model.tokenizer.kind == "bytes" and model.config.vocab_size == 257


def test_the_progress_bar_draws_on_a_terminal_only(quick_run):
    out, stdout, stderr, code = quick_run
    assert "40/40" in stderr and "step/s" in stderr and "loss=" in stderr and "val=" in stderr
    assert "step/s" not in stdout and "|" not in stdout  # the bar never goes to stdout
    assert not show_bar(False, io.StringIO()) and show_bar(False, FakeTerminal())
    assert not show_bar(True, FakeTerminal())  # --quiet


def test_the_plot_is_a_png_of_both_curves(quick_run):
    out = quick_run[0]
    from matplotlib.image import imread

    image = imread(os.path.join(out, "loss.png"))
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    # the two curves' colours (matplotlib's tab:blue and tab:orange) are drawn
    rgb = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert (np.abs(rgb - [31, 119, 180]).sum(1) < 30).sum() > 50
    assert (np.abs(rgb - [255, 127, 14]).sum(1) < 30).sum() > 50


def test_tensorboard_files_open_with_tensorboards_own_reader(quick_run):
    out = quick_run[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tensorboard"))
    acc.Reload()
    log = records(out)
    train_loss = [(e.step, e.value) for e in acc.Scalars("loss/train")]
    assert train_loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in log if "loss" in r]
    val = [(e.step, e.value) for e in acc.Scalars("loss/validation")]
    assert val == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in log if "val_loss" in r]
    assert {"optim/learning_rate", "optim/grad_norm", "speed/tokens_per_s", "speed/model_tflops"} \
        <= set(acc.Tags()["scalars"])
    assert "speed/mfu" not in acc.Tags()["scalars"]  # no peak on a CPU: never a made-up number


def test_each_record_carries_lr_throughput_and_model_flops(quick_run):
    out = quick_run[0]
    from eae_jax.train import lr_schedule

    cfg = TrainConfig(preset="tiny", steps=40, text=[], vocab_size=257)
    flops = flops_per_token(cfg.model(), 64)
    for r in records(out)[1:]:
        assert r["lr"] == pytest.approx(float(lr_schedule(cfg)(r["step"] - 1)), rel=1e-6)
        steps = r["step"] - {1: 0, 10: 1, 20: 10, 30: 20, 40: 30}[r["step"]]
        # tokens/s counts the training steps' time only (validation and compilation left out)
        assert r["tokens_per_s"] * r["step_seconds"] == pytest.approx(steps * 16 * 64, rel=1e-9)
        assert r["step_seconds"] <= r["seconds"]
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * flops / 1e12, rel=1e-9)
        assert r["mfu"] is None and r["peak_memory_bytes"] is None  # a CPU reports neither


def test_quiet_runs_print_only_the_summary(tmp_path, capsys, fast_compiles):
    code = main(["train", "--synthetic", "--steps", "2", "--batch", "2", "--seq-len", "8", "--quiet",
                 "--no-plot", "--no-tensorboard", "--peak-tflops", "0.001", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "step 1/2" not in out and "done:" not in out
    assert json.loads(out.strip().splitlines()[-1])["plot"] is None
    assert not os.path.exists(tmp_path / "run" / "loss.png") and not os.path.exists(tmp_path / "run" / "tensorboard")
    for r in records(str(tmp_path / "run")):  # a given peak makes MFU measurable on a CPU
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.001, rel=1e-12)


def test_tensorboard_without_its_package(tmp_path, capsys, monkeypatch, fast_compiles):
    import sys

    from eae_jax.train import loop

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed: importing it fails
    argv = ["train", "--synthetic", "--steps", "1", "--batch", "2", "--seq-len", "8", "--no-plot"]
    with monkeypatch.context() as m:
        m.setattr(loop, "build", lambda *a, **k: pytest.fail("built a model though the writer is missing"))
        code = main(argv + ["--tensorboard", "--out", str(tmp_path / "asked")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == ("eae-jax train: error: TensorBoard files need tensorboardX: pip install "
                                         "'eae-jax[tb]' (or pass --no-tensorboard)")
    code = main(argv + ["--out", str(tmp_path / "default")])  # not asked for: a note, and the run goes on
    captured = capsys.readouterr()
    assert code == 0 and "note: no TensorBoard files (TensorBoard files need tensorboardX" in captured.out
    assert json.loads(captured.out.strip().splitlines()[-1])["tensorboard"] is None


def test_validation_steps_follow_val_every(tmp_path):
    from eae_jax.train.monitor import RunMonitor
    from eae_jax.train.rundir import JsonlLog

    val = np.zeros((1, 2, 9), np.int32)
    for every, want in [(0, []), (1, [1, 2, 3, 4, 5, 6]), (4, [4, 6])]:
        cfg = TrainConfig(preset="tiny", seq_len=8, val_every=every, tensorboard=False, out=str(tmp_path))
        mon = RunMonitor(cfg, cfg.model(), val, JsonlLog(str(tmp_path / "log.jsonl")), 0, 6, log_fn=quiet)
        assert [s for s in range(1, 7) if mon.wants_log(s)] == want, every
        mon.close()
    with pytest.raises(ValueError, match="val_every must be >= 0"):
        TrainConfig(val_every=-1)
    with pytest.raises(ValueError, match="peak_tflops must be a finite number > 0"):
        TrainConfig(peak_tflops=0.0)


def test_a_resumed_run_plots_and_summarizes_the_whole_run(tmp_path, fast_compiles):
    base = dict(preset="tiny", batch=2, seq_len=16, text=[], val_every=2, val_batches=1, log_every=1,
                tensorboard=False)
    out = str(tmp_path / "run")
    train(TrainConfig(out=out, steps=4, **base), log_fn=quiet, until=2)
    summary = train(TrainConfig(out=out, steps=4, **base), log_fn=quiet)
    vals = [r["val_loss"] for r in records(out) if "val_loss" in r]
    assert [r["step"] for r in records(out) if "val_loss" in r] == [0, 2, 4]  # no step-0 record on resume
    assert summary["first_val_loss"] == vals[0] and summary["best_val_loss"] == min(vals)
    assert summary["steps_run"] == 2 and os.path.isfile(summary["plot"])


def test_summary_and_plot_of_hand_made_records(tmp_path):
    rec = [{"step": 0, "val_loss": 4.0}, {"step": 1, "loss": 4.5}, {"step": 2, "loss": 3.0, "val_loss": 3.0},
           {"step": 3, "loss": float("nan")}, {"step": 4, "loss": 2.0, "val_loss": 3.2}]
    s = summarize(rec)
    assert (s["first_loss"], s["final_loss"]) == (4.5, 2.0)  # a non-finite loss is no point of the curve
    assert (s["best_val_loss"], s["best_val_step"], s["val_loss_drop"]) == (3.0, 2, 0.25)
    assert summarize([{"step": 1, "loss": 1.0}])["val_loss_drop"] is None
    with pytest.raises(ValueError, match="no record holds a loss"):
        plot_losses([{"step": 1, "grad_norm": 1.0}], str(tmp_path / "x.png"))
    assert not os.listdir(tmp_path)  # nothing half-written


def test_progress_bar_counts_from_the_first_update():
    out = FakeTerminal()
    bar = Progress(total=50, enabled=True, stream=out)
    bar.update(10)
    bar.update(30, loss="1.0")
    bar.close()
    text = out.getvalue()
    assert "10/50" in text and "30/50" in text and "loss=1.0" in text
    lines = []
    silent = Progress(total=5, enabled=False, stream=out)
    silent.update(3)
    silent.write(lines.append, "a line")
    assert lines == ["a line"] and silent.bar is None
    assert format_duration(59.94) == "59.9s" and format_duration(60) == "1m00s" and format_duration(None) == "n/a"
