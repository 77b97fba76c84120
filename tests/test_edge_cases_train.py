"""Training edge cases: bad inputs get errors naming the problem; no run data is lost or duplicated."""

import json
import os
import re

import jax
import numpy as np
import pytest

from eae_jax.train import CheckpointError, TrainConfig, lr_schedule, make_optimizer, train
from eae_jax.train import checkpoint as ckpt
from eae_jax.train.data import TokenFile

TINY = dict(preset="tiny", batch=2, seq_len=8, warmup=0, log_every=1)


def quiet(*args, **kwargs):
    pass


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


@pytest.mark.parametrize("kw, match", [
    (dict(batch=0), "batch must be >= 1, got 0"),  # was silently the preset's batch
    (dict(seq_len=-3), "seq_len must be >= 1, got -3"),
    (dict(lr=0.0), "lr must be a finite number > 0"),
    (dict(lr=-1e-3), "lr must be a finite number > 0"),
    (dict(lr=float("nan")), "lr must be a finite number > 0"),
    (dict(checkpoint_every=0), "checkpoint_every must be >= 1"),  # was ZeroDivisionError mid-run
    (dict(log_every=0), "log_every must be >= 1"),
    (dict(microbatches=0), "microbatches must be >= 1"),
    (dict(warmup=-1), "warmup must be >= 0"),
    (dict(keep=-1), "keep must be >= 0"),
    (dict(grad_clip=-1.0), "grad_clip must be"),
    (dict(weight_decay=-0.1), "weight_decay must be"),
    (dict(devices=0), "devices must be >= 1"),
    (dict(grad_accum_dtype="int8"), "grad_accum_dtype: unknown dtype 'int8'"),
])
def test_bad_config_values_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{**TINY, **kw})


def _write(path, kind):
    if kind == "empty.bin":
        open(path, "wb").close()
    elif kind == "odd.bin":
        open(path, "wb").write(b"\x01" * 41)
    elif kind == "float.npy":
        np.save(path, np.arange(100, dtype=np.float32))
    elif kind == "negative.npy":
        np.save(path, -np.arange(100))
    elif kind == "garbage.npy":
        open(path, "wb").write(b"not an npy file" * 10)
    elif kind == "dir.npy":
        os.mkdir(path)


@pytest.mark.parametrize("kind, match", [
    ("empty.bin", "holds 0 tokens"),  # was numpy's "cannot mmap an empty file", no path
    ("odd.bin", "41 bytes is not a whole number of uint16 tokens"),
    ("float.npy", "holds float32 values; token ids must be integers"),  # was cast silently
    ("negative.npy", "has negative id -99"),  # was accepted
    ("garbage.npy", "cannot read token file"),
    ("dir.npy", "is not a regular file"),
])
def test_bad_token_files_name_the_file(tmp_path, kind, match):
    path = str(tmp_path / kind)
    _write(path, kind)
    with pytest.raises(ValueError, match=match) as err:
        TokenFile(path, vocab_size=256, seq_len=8)
    assert path in str(err.value)


@pytest.mark.parametrize("blocker", ["out", os.path.join("out", "checkpoints")])
def test_out_path_that_is_a_file_fails_before_training(tmp_path, blocker):
    os.makedirs(tmp_path / "out", exist_ok=True)
    if blocker == "out":
        os.rmdir(tmp_path / "out")
    (tmp_path / blocker).write_text("x")
    with pytest.raises(ValueError, match=f"{tmp_path / blocker} exists and is not a directory"):
        train(TrainConfig(out=str(tmp_path / "out"), steps=2, **TINY), log_fn=quiet)


def test_kill_between_checkpoints_resumes_with_one_record_per_step(tmp_path):
    out = str(tmp_path / "run")
    cfg = dict(TINY, steps=8, checkpoint_every=3, log_every=5)
    # A run killed after step 5: checkpoints at 3 (and the one `until` wrote at 5,
    # removed as if the kill came first), records up to 5, then a torn line.
    # The resumed run used to log steps 4 and 5 twice and glue a record onto the torn line.
    train(TrainConfig(out=out, **{**cfg, "log_every": 1}), log_fn=quiet, until=5)
    os.unlink(os.path.join(out, "checkpoints", "ckpt_00000005.npz"))
    killed = records(out)
    with open(os.path.join(out, "log.jsonl"), "a") as f:
        f.write('{"loss": 1.0, "gr')
    # leftovers of interrupted checkpoint writes: a temp file, a partial directory
    open(os.path.join(out, "checkpoints", ".ckpt_tmp_x.npz"), "wb").write(b"PK\x03\x04")
    os.mkdir(os.path.join(out, "checkpoints", "ckpt_00000099.npz"))
    resumed = train(TrainConfig(out=out, **{**cfg, "keep": 1}), log_fn=quiet)  # pruning passes the directory by
    assert resumed["resumed_from"].endswith("ckpt_00000003.npz")
    assert sorted(os.listdir(os.path.join(out, "checkpoints")))[-2:] == ["ckpt_00000008.npz", "ckpt_00000099.npz"]
    log = records(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 8]  # 4 (first after resume), 5 and 8 logged once each
    # The redone steps reproduce the killed run's losses bit for bit (same data order and state).
    assert [r["loss"] for r in log[3:5]] == [r["loss"] for r in killed[3:5]]
    # tokens/s of the last record (3 steps since step 5) counts those 3 steps, not log_every
    np.testing.assert_allclose(log[-1]["tokens_per_s"] * log[-1]["seconds"], 3 * 2 * 8, rtol=1e-6)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("finished") / "run")
    cfg = dict(TINY, steps=2, checkpoint_every=1)
    train(TrainConfig(out=out, **cfg), log_fn=quiet)
    return out, cfg


@pytest.mark.parametrize("change, error, match", [
    (dict(lr=1e-2), CheckpointError, r"different config[\s\S]*lr: 0.003 in the checkpoint, 0.01 now"),
    (dict(preset="small"), CheckpointError, r"preset: 'tiny' in the checkpoint, 'small' now"),
    (dict(microbatches=2), CheckpointError, r"microbatches: 1 in the checkpoint, 2 now"),
    (dict(steps=1), ValueError, r"ckpt_00000002.npz is at step 2, past steps=1"),  # was a silent no-op
    # a fresh run into an old run's directory would mix (and with keep=, delete) checkpoints
    (dict(resume=False), ValueError, r"resume is off but .* already holds checkpoints"),
])
def test_resume_refuses_what_would_not_continue_the_run(finished_run, change, error, match):
    out, cfg = finished_run
    with pytest.raises(error, match=match):
        train(TrainConfig(out=out, **{**cfg, **change}), log_fn=quiet)


def test_resuming_a_finished_run_reports_its_logged_losses(finished_run):
    # Nothing to run: the summary's losses were None.
    out, cfg = finished_run
    summary = train(TrainConfig(out=out, **cfg), log_fn=quiet)
    log = records(out)
    assert summary["steps_run"] == 0 and summary["steps"] == 2
    assert summary["final_loss"] == log[-1]["loss"] and summary["first_loss"] == log[0]["loss"]
    assert np.isfinite(summary["final_loss"])


def test_resume_with_more_steps_says_how_the_learning_rate_moves(finished_run):
    # The cosine schedule is rebuilt for the new length: the rate at the
    # resumed step jumps, which used to happen without a word.
    out, cfg = finished_run
    said = []
    train(TrainConfig(out=out, **{**cfg, "steps": 10}), log_fn=said.append, until=2)
    (line,) = [m for m in said if "steps changed" in m]
    before = float(lr_schedule(TrainConfig(**{**cfg, "steps": 2}))(2))
    after = float(lr_schedule(TrainConfig(**{**cfg, "steps": 10}))(2))
    assert "from 2 to 10" in line and f"{before:.3e} to {after:.3e}" in line and before != after
    said.clear()
    train(TrainConfig(out=out, **cfg), log_fn=said.append)
    assert not [m for m in said if "steps changed" in m]


def test_nonfinite_state_is_never_checkpointed(tmp_path):
    out = str(tmp_path / "run")
    # lr 1e30 blows the params up after a couple of steps; log_every is past them,
    # so only the checkpoint guard sees it (it used to save the NaN params).
    with pytest.raises(FloatingPointError,
                       match=r"non-finite .* at step 3; not checkpointed; last checkpoint kept: .*ckpt_00000002"):
        train(TrainConfig(out=out, **{**TINY, "lr": 1e30, "steps": 5, "checkpoint_every": 1, "log_every": 100}),
              log_fn=quiet)
    path = ckpt.latest(os.path.join(out, "checkpoints"))
    with np.load(path) as data:
        assert all(np.all(np.isfinite(data[k])) for k in data.files if data[k].dtype.kind == "f")


def test_checkpoint_errors_name_the_file(tmp_path):
    tree = {"a": np.zeros((2, 3), np.float32)}
    path = ckpt.save(str(tmp_path), 1, tree)
    # the shape error named a tree path where the file should be
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} does not fit"):
        ckpt.restore(path, {"a": np.zeros((3, 2), np.float32)})
    bad_meta = str(tmp_path / "ckpt_00000002.npz")
    np.savez(bad_meta, **{"['a']": tree["a"], "__metadata__.json": np.frombuffer(b"{not json", np.uint8)})
    for read in (lambda p: ckpt.restore(p, tree), ckpt.read_metadata):
        with pytest.raises(CheckpointError, match=rf"cannot read checkpoint {bad_meta}: bad metadata"):
            read(bad_meta)


@pytest.mark.parametrize("steps, warmup", [(1, 0), (1, 1), (2, 0), (1, 5)])
def test_short_schedules_build(steps, warmup):
    # steps=1 with warmup=0 raised "cosine_decay_schedule requires positive decay_steps"
    tx = make_optimizer(TrainConfig(**{**TINY, "steps": steps, "warmup": warmup}))
    params = {"w": jax.numpy.ones(3)}
    updates, _ = tx.update({"w": jax.numpy.ones(3)}, tx.init(params), params)
    assert np.all(np.isfinite(np.asarray(updates["w"])))


@pytest.mark.parametrize("args, match", [
    (["--lr", "-1"], "lr must be a finite number > 0"),
    (["--data", "missing.npy"], "token file .*missing.npy does not exist"),
])
def test_cli_bad_input_exits_2_with_the_message(tmp_path, capsys, args, match):
    # like `eae-jax parity`: usage errors exit 2 with one line on stderr, not a traceback
    from eae_jax.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eae-jax train: error: ") and "Traceback" not in err
    assert re.search(match, err), err


def test_fp8_calibration_batch_comes_from_the_token_file(tmp_path, monkeypatch):
    # README: fp8 seams are "calibrated and gated on a batch of the run's own data";
    # with --data the batch used to be synthetic anyway.
    from eae_jax import fp8
    from eae_jax.models.llama import embed
    from eae_jax.train import loop

    np.save(tmp_path / "tok.npy", np.full(64, 7))  # every window is all 7s
    seen = []

    def stop(block, params, xs, *args, **kwargs):
        seen.append(xs[0])
        raise InterruptedError  # the calibration itself is not under test

    monkeypatch.setattr(fp8, "bind_block", stop)
    cfg = TrainConfig(**{**TINY, "dtype": "fp8_e4m3", "data": str(tmp_path / "tok.npy")})
    model = cfg.model()
    params = loop.init_lm(jax.random.key(0), model)
    with pytest.raises(InterruptedError):
        loop.bind_fp8(cfg, model, params, jax.random.key(1), TokenFile(cfg.data, model.vocab_size, cfg.seq_len))
    expected = embed(params["embed"], jax.numpy.full((2, 8), 7, jax.numpy.int32), model.block.compute_dtype)
    np.testing.assert_array_equal(np.asarray(seen[0]), np.asarray(expected))


def test_window_offsets_reach_past_int32_in_huge_token_files():
    # randint's int32 clipped the offsets of a file with more than 2**31
    # tokens: its tail was never sampled.
    from eae_jax.train.data import draw_starts

    high = 3 * 2**32 + 17
    starts = draw_starts(jax.random.key(0), 4096, high)
    assert starts.dtype == np.int64 and starts.min() >= 0 and starts.max() < high
    assert (starts > 2**32).mean() > 0.5  # uniform: about 2/3 of them lie past 2**32
    # Smaller files keep randint's draws (runs resume onto the same windows).
    small = draw_starts(jax.random.key(3), 64, 1000)
    np.testing.assert_array_equal(small, np.asarray(jax.random.randint(jax.random.key(3), (64,), 0, 1000)))
    with pytest.raises(ValueError, match="no window offsets"):
        draw_starts(jax.random.key(0), 2, 0)


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_every_window_of_a_token_file_is_drawn(tmp_path, extra):
    """A window is seq_len + 1 tokens; a file of exactly that length was
    refused and the last start offset was never drawn."""
    seq = 8
    path = str(tmp_path / "t.npy")
    np.save(path, np.arange(seq + 1 + extra, dtype=np.int32))
    source = TokenFile(path, vocab_size=64, seq_len=seq)
    firsts = set()
    for i in range(40):
        rows = np.asarray(source.batch(jax.random.key(i), 4))
        assert rows.shape == (4, seq + 1)
        np.testing.assert_array_equal(rows - rows[:, :1], np.broadcast_to(np.arange(seq + 1), rows.shape))
        firsts.update(rows[:, 0].tolist())
    assert firsts == set(range(extra + 1))
    np.save(path, np.arange(seq, dtype=np.int32))
    with pytest.raises(ValueError, match=f"holds {seq} tokens; one window needs {seq + 1}"):
        TokenFile(path, vocab_size=64, seq_len=seq)


def test_data_path_is_stored_absolute(tmp_path, monkeypatch):
    """A relative --data path was stored as given: resuming from another
    directory compared equal strings and read another file."""
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(data="tokens.npy", **TINY)
    assert os.path.isabs(cfg.data) and cfg.data == os.path.abspath("tokens.npy")
    assert TrainConfig(**TINY).data is None


def test_checkpoints_get_the_usual_file_mode(tmp_path):
    """mkstemp made every checkpoint 0600, unreadable to other users."""
    umask = os.umask(0o022)
    try:
        path = ckpt.save(str(tmp_path), 1, {"w": np.ones(3, np.float32)})
        assert os.stat(path).st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)
