"""The stack benchmark (experiments/bench_stack.py): its arithmetic, its shared
data files, and one end-to-end smoke run on CPU at tiny sizes."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import bench_common as bc  # noqa: E402


def test_medium_model_flops_match_the_issue_and_block_config():
    from eae_jax.blocks import BlockConfig

    med = bc.configs(smoke=False)["medium"][0]
    assert med.param_count() == 16 * (45_088_768 + 2 * 2048)
    # the issue's figure: 38.76 TFLOP per step (6 N tokens + causal attention)
    assert med.model_flops() / 1e12 == pytest.approx(38.76, abs=0.005)
    for cfg in (med, bc.configs(smoke=False)["sweep"][0], bc.configs(smoke=True)["medium"][0]):
        blk = BlockConfig(dim=cfg.dim, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, ffn_hidden_dim=cfg.ffn)
        assert cfg.model_flops() == pytest.approx(3 * cfg.tokens * cfg.depth * blk.block_flops_per_token(cfg.seq))
        assert cfg.leaf_shapes() == {f"{m}.{k}": v for m, d in blk.param_shapes().items() for k, v in d.items()}


def test_bf16_bits_round_to_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 10_000),
                        np.float32([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38])]).astype(np.float32)
    ours = bc.f32_to_bf16_bits(a)
    ref = a.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(bc.bf16_bits_to_f32(ours), a.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_weight_files_share_their_prefix_across_depths(tmp_path):
    small = bc.configs(smoke=True)["sweep"][0]
    deep = bc.StackConfig(**{**small.__dict__, "name": "x", "depth": 4})
    bc.ensure_weights(str(tmp_path / "a"), deep, 4, threads=2)
    bc.ensure_weights(str(tmp_path / "b"), deep, 2, threads=2)
    two = bc.StackConfig(**{**small.__dict__, "name": "y", "depth": 2})
    wa, wb = bc.load_weight_bits(str(tmp_path / "a"), two), bc.load_weight_bits(str(tmp_path / "b"), two)
    for name, _ in bc.LEAVES:
        np.testing.assert_array_equal(wa[name], wb[name])
        vals = bc.bf16_bits_to_f32(wa[name])
        if name.endswith("scale"):
            assert np.all(np.abs(vals - 1) <= 0.1 + 2.0 ** -7) and vals.std() > 0  # bf16 spacing near 1
        else:
            bound = 1 / math.sqrt(vals.shape[-1])
            assert np.all(np.abs(vals) <= bound * 1.01) and vals.std() > bound / 3
    with pytest.raises(ValueError, match="weight file"):
        bc.load_weight_bits(str(tmp_path / "b"), deep)


def test_rel_err_combination():
    out = bc.combine_rel_err({"a": (1.0, 4.0), "b": (0.0, 12.0)})
    assert out["grad_rel_err"] == pytest.approx(0.25)
    assert out["grad_worst_leaf"] == "a" and out["grad_worst_rel_err"] == pytest.approx(0.5)


SMOKE_VARIANTS = "J-plain,J-remat,eae,eae-sep,eae-passes,eae-offload,eae-mp-bf16b,T-eae"


@pytest.mark.slow
def test_bench_smoke_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_stack.py"), "--smoke", "--out", str(out),
           "--configs", "medium,sweep", "--variants", SMOKE_VARIANTS, "--sweep-depths", "1,2",
           "--inject-failure", "J-remat@sweep-d1:raise,eae@sweep-d2:hang", "--measure-timeout-s", "20"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "TARGETS" in r.stdout and "RESULTS" in r.stdout
    doc = json.loads((out / "bench_results.json").read_text())
    rows = {(row["config"], row["variant"]): row for row in doc["rows"]}

    torch_ok = all(importlib.util.find_spec(m) is not None for m in ("torch", "eae_runtime"))
    for v in SMOKE_VARIANTS.split(","):
        row = rows[("medium", v)]
        if v.startswith("T-") and not torch_ok:
            assert row["status"] == "skipped", row
            continue
        assert row["status"] == "ok", (v, row.get("error"))
        assert row["steps_timed"] == 3 and row["step_ms_median"] > 0 and row["mfu_pct"] > 0
        assert row["loss"] == pytest.approx(rows[("medium", "J-plain")]["loss"], rel=2e-2)
        if v == "J-plain":
            assert row["grad_reference"] == "self"
            continue
        assert row["grad_reference"] == "J-plain"
        # same weights, same inputs: bf16 arithmetic differences only (int8 fake-quant a bit more)
        assert row["grad_rel_err"] < (5e-2 if v == "eae-passes" else 3e-2), (v, row["grad_rel_err"])
    # the recomputing variants redo J-plain's own arithmetic
    assert rows[("medium", "eae")]["grad_rel_err"] < 5e-3
    assert rows[("medium", "eae-offload")]["grad_rel_err_vs_eae"] < 1e-6
    assert rows[("medium", "eae-offload")]["grad_rel_err_vs_eae_same_process"] < 1e-6
    assert rows[("medium", "eae")]["carry_calls"] == 1.0
    # J-plain saved the float32 step's gradients; every bf16 variant's error
    # against them is small, and J-plain's own is nonzero (it is bf16)
    for v in ("J-plain", "eae", "eae-offload"):
        assert 0 < rows[("medium", v)]["grad_rel_err_vs_f32"] < 5e-2, (v, rows[("medium", v)])
    # the smoke sizes fit a boundary in one block's gradients: eae uses the slots, eae-sep does not
    assert rows[("medium", "eae")]["boundaries_in_grads"] is True
    assert rows[("medium", "eae-sep")]["boundaries_in_grads"] is False
    assert rows[("medium", "eae-sep")]["grad_rel_err"] == pytest.approx(rows[("medium", "eae")]["grad_rel_err"],
                                                                        rel=1e-6, abs=1e-9)

    # one failure and one hang were injected in the sweep: recorded, the rest ran
    assert rows[("sweep-d1", "J-remat")]["status"] == "error"
    assert "injected failure" in rows[("sweep-d1", "J-remat")]["error"]
    assert rows[("sweep-d2", "eae")]["status"] == "timeout"
    for key in [("sweep-d1", "J-plain"), ("sweep-d2", "J-plain"), ("sweep-d1", "eae"), ("sweep-d2", "J-remat")]:
        assert rows[key]["status"] == "ok", (key, rows[key].get("error"))
    assert doc["sweep"]["variants"]["J-plain"]["depth"] == [1, 2]
    # no child was timed while another one compiled (a compile takes host
    # cores and memory bandwidth from the timed step)
    timed = [row for row in doc["rows"] if row.get("measure_window")]
    assert len(timed) >= len(SMOKE_VARIANTS.split(","))
    for a in timed:
        m0, m1 = a["measure_window"]
        for b in doc["rows"]:
            if b is not a and b.get("prep_window"):
                p0, p1 = b["prep_window"]
                assert m1 <= p0 or p1 <= m0, ("timed during a compile", a["config"], a["variant"],
                                              b["config"], b["variant"])

    names = {c["name"]: c for c in doc["targets"]["medium"]}
    assert names["eae-passes time / eae time"]["value"] > 0
    assert "eae-sep peak" in names["eae-offload peak / (params+grads+block+2 boundaries)"]["note"]
    assert "info: boundaries saved by storing them in the gradient buffers" in names
    assert names["eae-offload grads vs eae-sep grads, same process (rel err)"]["pass"] is True
    assert names["eae-offload grad error - eae grad error (both vs float32)"]["pass"] is True
    # the saved rows alone re-render the same report (after a change of the checks)
    again = tmp_path / "again"
    r2 = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_stack.py"), "--report-from",
                         str(out / "bench_results.json"), "--out", str(again)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stdout[-4000:] + r2.stderr[-4000:]
    doc2 = json.loads((again / "bench_results.json").read_text())
    assert doc2["targets"] == doc["targets"] and doc2["meta"]["argv"] == doc["meta"]["argv"]
    assert "rerendered" in doc2["meta"]
    if torch_ok:
        assert names["T-eae time / eae time"]["value"] > 0
    assert (out / "bench_table.md").read_text().startswith("# Stack benchmark")
    assert (out / "bench_children.log").stat().st_size > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench_chart.png").stat().st_size > 1000
        assert (out / "bench_sweep.png").stat().st_size > 1000


def test_offload_memory_probe_smoke(tmp_path):
    """The compile-only offload probe runs its variants and writes its JSON."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import offload_memory_probe as omp

    res = omp.main(["--smoke", "--depth", "2", "--variants", "sep,scan,unrolled",
                    "--out", str(tmp_path)])
    assert [r["variant"] for r in res["runs"]] == ["sep", "scan", "unrolled"]
    assert all(r["temp_size_in_bytes"] > 0 for r in res["runs"])
    on_disk = json.loads((tmp_path / "offload_memory_probe.json").read_text())
    assert on_disk["runs"] == json.loads(json.dumps(res["runs"]))
    with pytest.raises(SystemExit):
        omp.main(["--smoke", "--variants", "nope", "--out", str(tmp_path)])
