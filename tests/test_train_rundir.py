"""A training run's directory: the lock, resuming past an unreadable checkpoint, write
checks up front and mid-run, and token files identified by content."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import TINY_TRAIN, compiling_fast, damage_checkpoint, quiet
from eae_jax.train import CheckpointError, TrainConfig, train
from eae_jax.train import legacy_npz
from eae_jax.train.checkpoint import CheckpointStore
from eae_jax.train.data import TokenFile
from eae_jax.train.errors import UnreadableCheckpointError
from eae_jax.train.lock import RunLock, RunLockedError
from eae_jax.train.rundir import RunWriteError, prepare_out

# ----------------------------------------------------------------------------- the lock
def test_a_second_run_into_the_same_out_is_refused_naming_the_holder(tmp_path, capsys):
    """Two runs into one --out both ran: every step logged twice, checkpoints racing."""
    from eae_jax.cli import main

    out = str(tmp_path / "run")
    os.makedirs(out)
    with RunLock(out):
        with pytest.raises(RunLockedError, match=rf"in use by process {os.getpid()} on .*lock {out}/.lock"):
            train(TrainConfig(out=out, steps=1, **TINY_TRAIN), log_fn=quiet)
        assert main(["train", "--out", out, "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert f"in use by process {os.getpid()}" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(os.path.join(out, "log.jsonl")) or not open(os.path.join(out, "log.jsonl")).read()


def test_a_lock_held_by_another_live_process_is_refused(tmp_path):
    out = str(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from eae_jax.train.lock import RunLock; "
         f"l = RunLock({out!r}); l.acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"process {holder.pid} "):
            RunLock(out).acquire()
    finally:
        holder.kill()
        holder.wait()
    said = []
    with RunLock(out, said.append):  # the killed holder's lock is taken over, with a message
        pass
    assert said == [f"taking over the lock {out}/.lock of process {holder.pid} on {os.uname().nodename}, "
                    "which no longer holds it"]
    said.clear()
    with RunLock(out, said.append):  # a clean release leaves nothing to take over
        pass
    assert said == []


# ----------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def _two_checkpoints(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("made") / "run")
    with compiling_fast():
        train(TrainConfig(out=out, steps=4, checkpoint_every=2, **TINY_TRAIN), log_fn=quiet, until=4)
    return out


@pytest.fixture
def run_with_two_checkpoints(_two_checkpoints, tmp_path, fast_compiles):
    """A copy of a run stopped at step 4 with checkpoints at 2 and 4."""
    out = str(tmp_path / "run")
    shutil.copytree(_two_checkpoints, out)
    names = _names(os.path.join(out, "checkpoints"))
    assert [os.path.basename(n) for n in names] == ["ckpt_00000002", "ckpt_00000004"]
    return out, names


def _names(directory):
    store = CheckpointStore(directory)
    try:
        return [path for _, path in store.checkpoints()]
    finally:
        store.close()


@pytest.mark.parametrize("damage", ["random", "truncated", "data"])
def test_resume_falls_back_past_an_unreadable_newest_checkpoint(run_with_two_checkpoints, damage):
    """A corrupt newest checkpoint blocked resume without a word of the good older one."""
    out, (older, newest) = run_with_two_checkpoints
    bad = damage_checkpoint(newest, damage)
    said = []
    summary = train(TrainConfig(out=out, steps=5, checkpoint_every=2, **TINY_TRAIN), log_fn=said.append)
    assert summary["resumed_from"] == older and summary["steps_run"] == 3
    (warning,) = [m for m in said if m.startswith("warning:")]
    assert newest in warning and older in warning and f"moved aside to {newest}.unreadable" in warning
    for rel, content in bad.items():  # kept as it was, never deleted
        assert open(os.path.join(newest + ".unreadable", rel), "rb").read() == content
    # the redone steps wrote fresh checkpoints 4 and 5 beside it
    assert [os.path.basename(n) for n in _names(os.path.dirname(newest))][-2:] == ["ckpt_00000004", "ckpt_00000005"]


def test_resume_refuses_when_no_checkpoint_is_readable(run_with_two_checkpoints):
    out, names = run_with_two_checkpoints
    for n in names:
        damage_checkpoint(n, "random")
    with pytest.raises(CheckpointError, match="no readable checkpoint") as err:
        train(TrainConfig(out=out, steps=5, **TINY_TRAIN), log_fn=quiet)
    assert all(n in str(err.value) for n in names)
    assert all(os.path.exists(n) for n in names)  # nothing moved or deleted


@pytest.mark.parametrize("content, match", [
    (b"\x80\x04" + bytes(100), "is not a checkpoint archive .it starts with bytes 80 04 00 00"),
    (b"", "is not a checkpoint archive .it is empty"),
])
def test_a_random_bytes_legacy_checkpoint_is_named_not_a_pickle(tmp_path, content, match):
    path = str(tmp_path / "ckpt_00000001.npz")
    open(path, "wb").write(content)
    with pytest.raises(UnreadableCheckpointError, match=match) as err:
        legacy_npz.load(path)
    assert "allow_pickle" not in str(err.value)


# ----------------------------------------------------------------------------- writes
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_run_dir_with_a_writable_parent_fails_up_front(tmp_path):
    """The check missed it: the model was built, then a bare [Errno 13] on log.jsonl.tmp."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "log.jsonl").write_text("")
    out.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"cannot write to output directory {out}"):
            prepare_out(str(out))
    finally:
        out.chmod(0o755)


def test_the_write_check_probes_the_run_dir_itself(tmp_path, monkeypatch):
    """Runs as root too: the probe in <out> itself is what catches a read-only run dir."""
    import tempfile

    out = str(tmp_path / "run")
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if os.path.abspath(dir) == os.path.abspath(out):
            raise PermissionError(13, "Permission denied", dir)
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with pytest.raises(PermissionError, match=f"cannot write to output directory {out}"):
        prepare_out(out)


@pytest.mark.parametrize("where", ["log", "checkpoint", "background"])
def test_disk_full_names_the_step_and_the_file(tmp_path, monkeypatch, where, fast_compiles):
    """A full disk stops the run naming the step and file, whether the write fails as it
    starts or later in the background (an Orbax save finishes while training goes on)."""
    import errno

    import orbax.checkpoint as ocp

    from eae_jax.train import rundir

    out = str(tmp_path / "run")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "log":
        monkeypatch.setattr(rundir.JsonlLog, "write", full)
        want = rf"step 1: cannot write {out}/log.jsonl: No space left on device"
    else:
        monkeypatch.setattr(ocp.CheckpointManager, "save" if where == "checkpoint" else "wait_until_finished", full)
        want = rf"step 2: cannot write {out}/checkpoints/ckpt_00000002: No space left on device"
    with pytest.raises(RunWriteError, match=want):
        train(TrainConfig(out=out, steps=2, **TINY_TRAIN), log_fn=quiet)


# ----------------------------------------------------------------------------- token files by content
@pytest.mark.parametrize("name", ["tokens.NPY", "tokens.Npy", "tokens.bin", "tokens"])
def test_a_numpy_token_file_is_read_as_one_whatever_its_name(tmp_path, name):
    """tokens.NPY was read as raw uint16: its header bytes became token ids."""
    ids = (np.arange(100) * 7919) % 32000
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        np.save(f, ids)
    source = TokenFile(path, vocab_size=32000, seq_len=8)
    np.testing.assert_array_equal(np.asarray(source.tokens), ids)


@pytest.mark.parametrize("kind, make, match", [
    ("npz", lambda p: np.savez(p, a=np.arange(10)), "zip archive"),
    ("pickle", lambda p: __import__("pickle").dump(list(range(50)), open(p, "wb"), protocol=4), "pickle file"),
    ("safetensors", lambda p: open(p, "wb").write(b"\x10" + bytes(7) + b'{"a": 1}       ' + bytes(32)), "safetensors"),
    ("npy-named", lambda p: open(p, "wb").write(bytes(64)), "named .npy but it is not a numpy array file"),
])
def test_files_of_other_formats_are_not_read_as_token_ids(tmp_path, kind, make, match):
    path = str(tmp_path / ("t.Npy" if kind == "npy-named" else "t.bin"))
    make(path)
    if kind == "npz":
        os.replace(path + ".npz" if os.path.exists(path + ".npz") else path, path)
    with pytest.raises(ValueError, match=f"cannot read token file {path}.*{match}"):
        TokenFile(path, vocab_size=60000, seq_len=4)
