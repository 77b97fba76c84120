"""Two processes on this machine (CPU, gloo collectives) train like one on a text folder:
the same losses and validation losses, the log and tokenizer written once, every process
writing its shards of the checkpoint."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from conftest import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(out, devices, env=None):
    full = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **(env or {}))
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "parallel_worker.py"), "train", str(out)],
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_processes_train_three_steps_like_one(tmp_path):
    text = tmp_path / "text"  # every process reads the same text and splits off the same validation documents
    text.mkdir()
    for i in range(12):
        (text / f"note{i}.txt").write_text(f"note {i}: the quick brown fox jumps over the lazy dog {i * i}\n" * 8)
    port = _free_port()
    pair = [_start(tmp_path / "two", 4, {"JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
                                         "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    alone = _start(tmp_path / "one", 8)
    try:
        first, second, ref = (_result(p) for p in (*pair, alone))
    finally:
        for p in (*pair, alone):
            p.kill()
    assert (first["process"], second["process"], first["processes"], ref["processes"]) == (0, 1, 2, 1)
    assert first["devices"] == ref["devices"] == 8 and first["local_devices"] == 4
    losses = [r["loss"] for r in ref["log"] if "loss" in r]
    val_losses = [r["val_loss"] for r in ref["log"] if "val_loss" in r]
    assert len(losses) == 3 and len(val_losses) == 3
    # one log, each step once (the first process writes it), both processes' losses the same
    assert [r["step"] for r in first["log"]] == [0, 1, 2, 3]
    assert [r["step"] for r in first["log"] if "val_loss" in r] == [0, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in first["log"] if "loss" in r], losses, rtol=1e-5)
    np.testing.assert_allclose([r["val_loss"] for r in first["log"] if "val_loss" in r], val_losses, rtol=1e-5)
    assert first["summary"]["final_loss"] == second["summary"]["final_loss"]
    assert first["summary"]["trained_on"].startswith("text from") and first["summary"]["tokens"] == 3 * 16 * 8
    # the tokenizer is written once, beside the checkpoints
    assert [f for f in os.listdir(tmp_path / "two") if f.startswith("tokenizer")] == ["tokenizer_bytes.json"]
    # both processes wrote their shards of the one checkpoint
    state = tmp_path / "two" / "checkpoints" / "ckpt_00000003" / "state"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state))
