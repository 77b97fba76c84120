"""The stack benchmark (experiments/bench_stack.py): its arithmetic, its shared
data files, its schedule, and end-to-end smoke campaigns on CPU at tiny sizes;
smoke runs of the other GPU benchmarks (the offload probe, bench_mesh.py)."""

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


SMOKE_VARIANTS = "J-plain,eae,eae-offload,T-ckpt,T-eae-nosync"

# A stand-in for nvidia-smi: the fields queried, one sample per loop period.
FAKE_SMI = """#!{python}
import sys, time
args = sys.argv[1:]
query = next(a.split("=", 1)[1] for a in args if a.startswith("--query-gpu="))
if "noheader" in " ".join(args):
    print("Fake GPU, Default, 81559 MiB, 1980 MHz, 1980 MHz, 0.0, 700.00 W")
    sys.exit(0)
period = int(args[args.index("-lms") + 1]) / 1e3 if "-lms" in args else None
print(", ".join(query.split(",")), flush=True)
while True:
    now = time.time()
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + ".%03d" % int(now % 1 * 1000)
    vals = [stamp, "1980", "2619", "500.0", "60", "0x0000000000000004"][:len(query.split(","))]
    print(", ".join(vals), flush=True)
    if period is None:
        break
    time.sleep(period)
"""


@pytest.mark.slow
def test_bench_smoke_end_to_end(tmp_path):
    """Two processes per variant, one failure and one hang injected into
    round 1; every process is timed alone, in the recorded order."""
    pytest.importorskip("torch")
    pytest.importorskip("eae_runtime")
    out, fake = tmp_path / "out", tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(FAKE_SMI.format(python=sys.executable))
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_stack.py"), "--smoke", "--out", str(out),
           "--variants", SMOKE_VARIANTS, "--repeats", "2", "--seed", "3", "--measure-timeout-s", "8",
           "--smi-interval-ms", "20",
           "--inject-failure", "eae-offload@medium#1:raise,T-ckpt@medium#1:hang,T-eae-nosync@medium#1:oom"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "RATIOS" in r.stdout and "estimate:" in r.stdout
    doc = json.loads((out / "bench_results.json").read_text())
    procs = [row for row in doc["rows"] if row["role"] == "timed"]
    (ref,) = [row for row in doc["rows"] if row["role"] == "ref"]
    assert ref["status"] == "ok" and ref["loss_f32"] == pytest.approx(ref["loss"], rel=1e-2)
    assert [(o["variant"], o["round"]) for o in doc["meta"]["timing_order"]] == \
        [(row["variant"], row["round"]) for row in sorted(procs, key=lambda x: x["order"])]
    bad = {(row["variant"], row["round"]): row for row in procs if row["status"] != "ok"}
    assert set(bad) == {("eae-offload", 1), ("T-ckpt", 1), ("T-eae-nosync", 1)}
    assert "injected failure" in bad[("eae-offload", 1)]["error"] and bad[("T-ckpt", 1)]["status"] == "timeout"
    # out of memory while preparing: tried again once, in the next batch, then recorded
    oom = bad[("T-eae-nosync", 1)]
    assert oom["retried"] and "injected out of memory" in oom["error"] and not bad[("eae-offload", 1)]["retried"]
    assert "retried in the next batch" in r.stdout

    ok = [row for row in procs if row["status"] == "ok"]
    assert len(ok) == 7
    assert sorted(row["timed_seq"] for row in ok) == sorted(set(row["timed_seq"] for row in ok))
    jplain_loss = next(row["loss"] for row in ok if row["variant"] == "J-plain")
    for row in ok:
        assert row["steps_timed"] == 3 and len(row["times_ms"]) == 3 and len(row["warmup_ms"]) == 1
        assert row["timed_window"][0] >= row["measure_window"][0]
        assert row["loss"] == pytest.approx(jplain_loss, rel=2e-2)
        if not row["check"]:
            assert "grad_rel_err" not in row
            continue
        # same weights, same inputs: bf16 rounding differences only, against both references
        assert row["grad_reference"] == "J-plain" and row["grad_rel_err"] < 3e-2, row["variant"]
        assert 0 < row["grad_rel_err_vs_f32"] < 5e-2, row["variant"]
    agg = {e["variant"]: e for e in doc["aggregate"]}
    assert agg["eae"]["processes_ok"] == 2 and agg["T-ckpt"]["processes_ok"] == 1
    assert agg["eae"]["grad_rel_err"] < 5e-3 and agg["eae"]["carry_calls"] == 1.0
    assert agg["eae-offload"]["grad_rel_err_vs_eae_same_process"] < 1e-6
    nosync = agg["T-eae-nosync"]
    assert nosync["sdpa_backend"] == "flash" and nosync["block0_vs_seed_block_rel_err"] < 1e-2
    names = {(x["name"], x["kind"]) for x in doc["ratios"]}
    assert {("T-ckpt / eae", "time"), ("T-eae-nosync / eae", "time"), ("eae / T-ckpt", "pool")} <= names
    # no process was timed while another one compiled or ran (the reference job included)
    for a in procs:
        if not a.get("measure_window"):
            continue
        m0, m1 = a["measure_window"]
        for b in doc["rows"]:
            if b is not a and b.get("prep_window"):
                p0, p1 = b["prep_window"]
                assert m1 <= p0 or p1 <= m0, ("timed during a compile", a["variant"], b["variant"])
            if b is not a and b.get("measure_window"):
                b0, b1 = b["measure_window"]
                assert m1 <= b0 or b1 <= m0
    # the clock log ran for the whole campaign and is summarised per timing window
    assert doc["meta"]["smi"]["status"] == "logging" and "clocks_event_reasons" in doc["meta"]["smi"]["fields"]
    assert doc["meta"]["clocks_whole_run"]["samples"] > 10 and (out / "smi.csv.gz").stat().st_size > 0
    assert any(row.get("clocks", {}).get("samples", 0) > 0 for row in ok)
    assert all(row["clocks"]["sm_mhz_min"] == 1980.0 for row in ok if row.get("clocks", {}).get("samples"))
    md = (out / "bench_table.md").read_text()
    assert md.startswith("# Stack benchmark") and "## Ratios" in md and "## Timing order" in md
    rows_only = json.loads((out / "bench_rows.json").read_text())
    assert len(rows_only["rows"]) == len(doc["rows"])
    assert (out / "bench_children.log.gz").stat().st_size > 0
    # the saved rows alone re-render the same report
    again = tmp_path / "again"
    r2 = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_stack.py"), "--report-from",
                         str(out / "bench_results.json"), "--out", str(again)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stdout[-4000:] + r2.stderr[-4000:]
    doc2 = json.loads((again / "bench_results.json").read_text())
    assert doc2["ratios"] == doc["ratios"] and doc2["aggregate"] == doc["aggregate"]
    assert "rerendered" in doc2["meta"]


@pytest.mark.slow
def test_bench_compiled_variant_smoke(tmp_path):
    """A torch.compile variant through the harness: its budget set, one graph
    shared by the later blocks, compiled into the variant's own inductor
    cache."""
    pytest.importorskip("torch")
    pytest.importorskip("eae_runtime")
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_stack.py"), "--smoke", "--out", str(out),
           "--workdir", str(work), "--variants", "T-compile-b0.3", "--no-reference"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = json.loads((out / "bench_results.json").read_text())["rows"]
    (row,) = rows
    assert row["status"] == "ok", row
    assert row["activation_memory_budget"] == 0.3 and row["graph_breaks"] == 0
    assert row["dynamo_stats"]["unique_graphs"] == 2 and row["compile_s"] > 0
    assert os.listdir(work / "inductor" / "T-compile-b0.3")


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


def test_bench_mesh_times_both_paths_in_one_process(tmp_path, capsys):
    """The one-device mesh benchmark: both variants, interleaved rounds, the same losses, its JSON,
    and its deadline (two rounds however late)."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import bench_mesh

    assert bench_mesh.main(["--preset", "tiny", "--dtype", "fp32", "--depth", "2", "--seq-len", "16", "--batch", "4",
                            "--rounds", "3", "--deadline-s", "0", "--steps", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_mesh.json").read_text())
    assert all(len(res["times"][v]) == 2 and all(len(r) == 1 for r in res["times"][v]) for v in bench_mesh.VARIANTS)
    # the sharded path on the mesh data=1 computes what the plain step does
    np.testing.assert_allclose(res["losses"]["sharded"], res["losses"]["plain"], rtol=1e-6)
    assert len(res["losses"]["plain"]) == 2 + 2  # warm-up steps, then one per round
    assert res["ratio_sharded_over_plain"]["value"] > 0 and "sharded / plain" in capsys.readouterr().out
    assert res["rounds_run"] == 2  # past the deadline from the start: the two rounds an interval needs
    with pytest.raises(SystemExit):
        bench_mesh.main(["--rounds", "1", "--out", str(tmp_path)])
