"""The memory-budget benchmark (experiments/bench_budget.py): a CPU smoke run at
tiny sizes, one budget and three variants: the plan's process, a uniform
storage and plain JAX, each timed in its own process, and the files it writes."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_writes_table_json_and_chart(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_budget.py"), "--smoke",
                           "--sections", "budgets", "--budgets", "0.002", "--options", "device,dots,everything",
                           "--variants", "plan,uniform-device,J-plain", "--steps", "1", "--warmup", "0", "--jobs", "3",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "bench_budget.json").read_text())
    table = doc["table"]
    assert set(table) == {"plan-0.002GiB", "uniform-device", "J-plain"}, table
    assert all(row["status"] == "ok" and row["median_ms"] > 0 for row in table.values()), table
    plan = doc["plans"]["0.002"]
    assert plan["peak"] <= plan["budget"] == int(0.002 * 2**30)
    # the prediction against the planned process's own compiled step
    assert abs(plan["peak"] / (table["plan-0.002GiB"]["compiled_peak_gib"] * 2**30) - 1) <= 0.05
    assert np.isclose(doc["predicted"]["plan-0.002GiB"] * 2**30, plan["peak"])
    assert (out / "bench_budget.png").stat().st_size > 0
    assert "plan-0.002GiB" in (out / "bench_budget.txt").read_text()
