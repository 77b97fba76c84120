"""The campaign report (experiments/bench_report.py) on synthetic process
rows: aggregation over processes, ratio verdicts, targets, sweep slopes, the
written tables, and legacy single-process rows."""

import json

import numpy as np
import pytest

from conftest import load_experiment

br = load_experiment("bench_report")
import bench_common as bc  # noqa: E402  (load_experiment put experiments/ on the path)

MED = bc.configs(smoke=False)["medium"][0]


def _row(variant, times, peak=None, pool=None, cfg=MED, rnd=0, check=False, status="ok", **extra):
    row = {"config": cfg.name, "variant": variant, "role": "timed", "round": rnd, "check": check, "status": status,
           "config_detail": cfg.__dict__.copy()}
    if status == "ok":
        row.update(bc.summarize_times([t / 1e3 for t in times]), times_ms=list(times), peak_bytes=peak,
                   peak_reserved_bytes=pool, pool_name="test pool")
    row.update(extra)
    return row


def _campaign(eae_ms=100.0, ckpt_ms=130.0, spread=0.2):
    rng = np.random.default_rng(0)
    rows = []
    for rnd in range(3):
        for v, ms, peak in (("eae", eae_ms, 3.5), ("T-ckpt", ckpt_ms, 3.8), ("J-remat", eae_ms, 4.0)):
            rows.append(_row(v, ms + spread * rng.standard_normal(10), int(peak * bc.GIB), int(peak * 1.1 * bc.GIB),
                             rnd=rnd, check=rnd == 0, grad_rel_err=5e-3 if rnd == 0 else None))
    return rows


def test_aggregate_folds_processes_and_keeps_the_checked_processes_errors():
    rows = _campaign()
    rows.append(_row("eae", [], rnd=3, status="timeout"))
    agg = {e["variant"]: e for e in br.aggregate(rows)}
    e = agg["eae"]
    assert e["processes"] == 4 and e["processes_ok"] == 3 and e["statuses"].count("timeout") == 1
    meds = [np.median(r["times_ms"]) for r in rows if r["variant"] == "eae" and r["status"] == "ok"]
    assert e["step_ms"] == pytest.approx(np.median(meds))
    assert e["step_ms_ci"][0] <= e["step_ms"] <= e["step_ms_ci"][1]
    assert e["peak_bytes"] == int(3.5 * bc.GIB) and e["grad_rel_err"] == 5e-3
    assert e["mfu_pct"] == pytest.approx(100 * MED.model_flops() / (e["step_ms"] / 1e3) / bc.PEAK_BF16_FLOPS)
    assert [x["variant"] for x in br.aggregate(rows)] == ["J-remat", "eae", "T-ckpt"]  # VARIANTS order


def test_ratios_give_wins_losses_and_ties_by_their_intervals():
    agg = br.aggregate(_campaign(eae_ms=100.0, ckpt_ms=130.0))
    rats = {(r["name"], r["kind"]): r for r in br.ratios(agg, "medium")}
    t = rats[("T-ckpt / eae", "time")]
    assert t["value"] == pytest.approx(1.3, rel=1e-2) and t["verdict"] == "win"
    assert rats[("J-remat / eae", "time")]["verdict"] == "tie"
    peak = rats[("eae / T-ckpt", "peak")]
    assert peak["value"] == pytest.approx(3.5 / 3.8, rel=1e-6) and peak["verdict"] == "win"
    assert rats[("eae / J-remat", "pool")]["verdict"] == "win"
    slow = {(r["name"], r["kind"]): r for r in br.ratios(br.aggregate(_campaign(eae_ms=140.0)), "medium")}
    assert slow[("T-ckpt / eae", "time")]["verdict"] == "loss"


def test_memory_ratio_without_a_pool_figure_is_not_a_verdict():
    rows = _campaign()
    for r in rows:
        if r["variant"] == "T-ckpt":
            r["peak_reserved_bytes"] = None
    rats = {(r["name"], r["kind"]): r for r in br.ratios(br.aggregate(rows), "medium")}
    assert rats[("eae / T-ckpt", "pool")]["verdict"] == "n/a"
    assert rats[("eae / T-ckpt", "peak")]["verdict"] == "win"


def test_a_variant_timed_in_one_process_gets_no_verdict():
    rows = [r for r in _campaign() if r["variant"] != "T-ckpt" or r["round"] == 0]
    rats = {(r["name"], r["kind"]): r for r in br.ratios(br.aggregate(rows), "medium")}
    t = rats[("T-ckpt / eae", "time")]
    assert t["value"] == pytest.approx(1.3, rel=1e-2) and t["ci"] is None and t["verdict"] == "n/a"
    assert "fewer than 2 processes" in t["note"] and rats[("J-remat / eae", "time")]["verdict"] == "tie"


def test_single_process_rows_without_step_times_get_no_verdict():
    legacy = [{"config": "medium", "variant": v, "status": "ok", "config_detail": MED.__dict__.copy(),
               "step_ms_median": ms, "peak_bytes": int(gib * bc.GIB)} for v, ms, gib in
              (("eae", 100.0, 3.5), ("T-ckpt", 130.0, 3.8))]
    legacy[0]["grad_rel_err"] = 4e-3
    agg = br.aggregate(legacy)
    assert all(e["step_ms_ci"] is None for e in agg) and agg[0]["grad_rel_err"] == 4e-3
    rats = {r["kind"]: r for r in br.ratios(agg, "medium")}
    assert rats["time"]["value"] == pytest.approx(1.3) and rats["time"]["verdict"] == "n/a"
    assert rats["peak"]["value"] == pytest.approx(3.5 / 3.8) and rats["peak"]["verdict"] == "n/a"


def test_targets_and_sweep_slopes():
    rows = _campaign()
    for r in rows:
        if r["variant"] == "eae" and r["check"]:
            r.update(grad_rel_err_vs_f32=9e-3, boundaries_in_grads=True)
    rows.append(_row("eae-offload", [110.0] * 5, int(3.6 * bc.GIB), check=True, grad_rel_err_vs_f32=9.5e-3))
    checks = {c["name"]: c for c in br.targets(br.aggregate(rows), "medium")}
    assert checks["eae time / J-remat time"]["pass"] is True
    assert checks["eae-offload time / eae time"]["value"] == pytest.approx(1.1, rel=1e-2)
    assert checks["eae-offload grad error - eae grad error (both vs float32)"]["value"] == pytest.approx(5e-4)
    assert checks["eae-offload peak / (params+grads+block+2 boundaries)"]["value"] == pytest.approx(
        3.6 * bc.GIB / (3.5 * bc.GIB + 2 * MED.boundary_bytes()))
    sweep_base = bc.configs(smoke=False)["sweep"]
    srows = [_row("eae", [10.0 * c.depth], int(c.depth * 100 * 2**20), cfg=c) for c in sweep_base]
    sweep = br.sweep_analysis(br.aggregate(srows))
    assert sweep["variants"]["eae"]["peak_slope_mib_per_block"] == pytest.approx(100.0)
    assert sweep["variants"]["eae"]["time_slope_ms_per_block"] == pytest.approx(10.0)
    assert "check" in sweep


def test_write_outputs_writes_json_and_table(tmp_path):
    rows = _campaign()
    meta = {"argv": ["bench_stack.py"], "repeats": 3, "steps": 10, "warmup": 2, "seed": 0,
            "timing_order": [{"variant": "eae", "round": 0}], "timeline": [{"phase": "measure", "measure_s": 3.0}]}
    text = br.write_outputs(str(tmp_path), rows, meta, final=False)
    assert "RATIOS" in text and "T-ckpt / eae" in text
    doc = json.loads((tmp_path / "bench_results.json").read_text())
    assert doc["format"] == 2 and len(doc["rows"]) == len(rows)
    assert {r["verdict"] for r in doc["ratios"]} <= {"win", "loss", "tie", "n/a", "info"}
    md = (tmp_path / "bench_table.md").read_text()
    assert md.startswith("# Stack benchmark") and "## Ratios" in md and "| medium | T-ckpt / eae | time |" in md


def test_clocks_attach_to_timing_windows():
    rows = [_row("eae", [1.0], timed_window=[10.0, 12.0]), _row("T-ckpt", [1.0])]
    samples = [{"t": float(t), "sm_mhz": 1900.0 + t, "mem_mhz": 2600.0, "power_w": 600.0, "temp_c": 60.0,
                "reasons": 0} for t in range(20)]
    br.attach_clocks(rows, samples)
    assert rows[0]["clocks"]["samples"] == 3 and rows[0]["clocks"]["sm_mhz_min"] == 1910.0
    assert "clocks" not in rows[1]
    e = {x["variant"]: x for x in br.aggregate(rows)}["eae"]
    assert e["clocks"]["sm_mhz_median"] == 1911.0
