"""experiments/bench_fp8_campaign.py runs end to end on CPU (its FFN section,
tiny, so the one GPU call works the first time) and its report recomputes
from the raw per-call times; the gradient-agreement helper against numpy."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, load_experiment


def test_ffn_campaign_smoke_writes_raw_times_and_intervals(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_fp8_campaign.py"), "--smoke", "--sections", "ffn",
           "--ffn-variants", "bf16,eae-in,flax-direct", "--repeats", "2", "--ffn-rounds", "1", "--ffn-batches", "2",
           "--ffn-calls", "1", "--ffn-warm-calls", "0", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "fp8_results.json").read_text())
    rows = [r for r in doc["rows"] if r["variant"] == "ffn"]
    assert [r["status"] for r in rows] == ["ok", "ok"], [r.get("error") for r in rows]
    for r in rows:
        assert sorted(r["order"]) == ["bf16", "eae-in", "flax-direct"]  # one round: each variant once
        for v in ("bf16", "eae-in", "flax-direct"):
            for kind in ("fwd", "fb"):
                times = r["times_ms"][v][kind]
                assert len(times) == 2 and min(times) > 0, (v, kind, times)
        cos = r["cos_fwd_vs_bf16"]
        assert cos["bf16"] == 1.0 and 0.99 < cos["eae-in"] < 1.0 and 0.99 < cos["flax-direct"] < 1.0
    ffn = doc["ffn"]["1b"]
    assert ffn["processes"] == 2
    ratios = {(r["name"].split("/", 3)[-1], r["kind"]): r for r in ffn["ratios"]}
    for kind in ("fwd", "fb"):
        def stat(v):
            return float(np.median([np.median(r["times_ms"][v][kind]) for r in rows]))

        for a, b in (("bf16", "eae-in"), ("flax-direct", "eae-in")):
            r = ratios[(f"{a} / {b}", kind)]
            assert r["value"] == pytest.approx(stat(a) / stat(b), rel=1e-9)
            assert r["ci"][0] <= r["value"] <= r["ci"][1] and r["verdict"] in ("win", "loss", "tie")
    table = (out / "fp8_table.md").read_text()
    assert "#### FFN 256 x 64 x 128" in table and "| flax-direct / eae-in | forward+backward |" in table


def test_grad_agreement_matches_float64_cosines():
    prog = load_experiment("bench_fp8_programs")
    rng = np.random.default_rng(0)
    ref = {"blocks": {"w": rng.normal(size=(3, 4, 5))}, "head": rng.normal(size=(6,))}
    got = {"blocks": {"w": ref["blocks"]["w"] + 0.3 * rng.normal(size=(3, 4, 5))}, "head": -ref["head"]}

    def cos(a, b):
        a, b = np.ravel(a), np.ravel(b)
        return a @ b / np.sqrt((a @ a) * (b @ b))

    out = prog.grad_agreement({k: v for k, v in got.items()}, ref)
    w, rw = got["blocks"]["w"], ref["blocks"]["w"]
    assert out["per_leaf"]["blocks/w"] == pytest.approx(cos(w, rw), abs=1e-6)
    assert out["per_leaf"]["head"] == pytest.approx(-1.0, abs=1e-6)
    assert out["per_layer_min"]["blocks/w"] == pytest.approx(min(cos(w[i], rw[i]) for i in range(3)), abs=1e-6)
    assert out["min_leaf"] == pytest.approx(-1.0, abs=1e-6)
    assert out["size_weighted"] == pytest.approx((60 * cos(w, rw) - 6) / 66, abs=1e-6)
    whole = cos(np.concatenate([w.ravel(), got["head"]]), np.concatenate([rw.ravel(), ref["head"]]))
    assert out["global"] == pytest.approx(whole, abs=1e-6)
    with pytest.raises(ValueError, match="trees differ"):
        prog.grad_agreement({"a": np.ones(2)}, {"b": np.ones(2)})


def test_the_state_writer_and_the_gradient_references_merge_per_configuration():
    report = load_experiment("bench_fp8_report")
    states = {"role": "ref", "status": "ok", "config": "medium", "part": "states", "bind_s": 3.0,
              "gate_worst_cos": 0.9991, "observe_step_rejected": False, "compile_s": {"eae-observe": 9.0}}
    grads = {"role": "ref", "status": "ok", "config": "medium", "part": "grads", "loss": 4.5, "loss_f32": 4.4,
             "cosines": {"bf16": {"vs_f32": {"global": 0.99}}}, "compile_s": {"f32": 150.0}}
    failed = {"role": "ref", "status": "timeout", "config": "7b", "part": "states"}
    timed = {"role": "timed", "status": "ok", "config": "medium", "loss": 1.0}
    got = report.cosine_summary([states, timed, grads, failed])
    assert set(got) == {"medium"}
    m = got["medium"]
    assert (m["bind_s"], m["gate_worst_cos"], m["loss"], m["loss_f32"]) == (3.0, 0.9991, 4.5, 4.4)
    assert m["compile_s"] == {"eae-observe": 9.0, "f32": 150.0} and m["cosines"] == grads["cosines"]
    assert m["observe_step_rejected"] is False and m["flax_error"] is None
