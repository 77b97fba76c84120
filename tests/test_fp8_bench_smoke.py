"""experiments/bench_fp8.py --smoke runs end to end on CPU (so the one GPU call
works the first time) and its results say what they should."""

import json

import jax
import numpy as np
import pytest

from conftest import load_experiment


def _load():
    return load_experiment("bench_fp8")


def _optimized(section):
    """``section`` compiled with XLA's optimizations on again, inside a test that turned most of them off
    (`fast_compiles`): the section's checks read the optimized HLO (its conditionals)."""
    def run(args):
        jax.config.update("jax_disable_most_optimizations", False)
        try:
            return section(args)
        finally:
            jax.config.update("jax_disable_most_optimizations", True)

    return run


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::eae_jax.fp8.Fp8FallbackWarning")  # delayed scaling's first steps may fall back
def test_bench_smoke_runs_and_writes_json(tmp_path, monkeypatch, fast_compiles):
    monkeypatch.setenv("OUT", str(tmp_path))
    # Every section, FFN variants of each kind (guards on / off, current /
    # delayed gradient scales, per-channel / delayed weight scales, per-row
    # activation scales); the cast-weight variants have their own test below.
    # The FFN and training sections check lowered programs and numbers only:
    # they compile without most optimizations (a third of the compile time).
    bench = _load()
    monkeypatch.setattr(bench, "e2e_section", _optimized(bench.e2e_section))
    bench.main(["--smoke", "--ffn-variants", "static,static-u-d,delayedw-d,delayedw-u-d,row"])
    res = json.loads((tmp_path / "bench_fp8_smoke.json").read_text())
    assert set(res) >= {"env", "ffn", "e2e", "train"}
    for section in ("ffn", "e2e", "train"):
        if isinstance(res[section], dict):
            assert "error" not in res[section], res[section]
    variants = {r["variant"]: r for r in res["ffn"]}
    assert not [r for r in res["ffn"] if "error" in r and not r["variant"].startswith("flax")]
    ours = variants["eae fp8 static"]
    assert 0.99 < ours["cos_bare"] < 1.0 and ours["cos_boundary"] > 0.999
    assert ours["fwd"]["lowered_fp8_dots"] == 2 and ours["fb"]["lowered_fp8_dots"] == 7
    assert ours["fp8_calls_fwd"] == 1.0 and ours["fp8_calls_fb"] == 1.0
    assert ours["fwd"]["median_ms"] > 0 and ours["fb"]["median_ms"] > 0
    for key in ("graph_fwd", "graph_fb"):  # in-graph timing of 2 copies, per call
        assert ours[key]["copies"] == 2 and ours[key]["per_call_pipelined_ms"] > 0, key
        assert ours[key]["lowered_fp8_dots"] == 2 * ours[key[6:]]["lowered_fp8_dots"], key
    assert ours["graph_fwd_speedup"] > 0 and variants["bf16 (eae_jax swiglu)"]["graph_fwd_speedup"] == 1.0
    for name in ("eae fp8 static delayed grads delayed-w", "eae fp8 static unguarded delayed grads delayed-w",
                 "eae fp8 static unguarded delayed grads", "eae fp8 row"):
        kind = variants[name]  # every kind: same GEMM count, same accuracy class
        assert kind["fwd"]["lowered_fp8_dots"] == 2 and kind["fb"]["lowered_fp8_dots"] == 7, name
        assert 0.99 < kind["cos_bare"] < 1.0 and kind["cos_boundary"] > 0.999, name
    (e2e,) = res["e2e"]
    assert "error" not in e2e, e2e
    assert e2e["gate_worst_cos"] >= 0.999 and set(e2e["variants"]) == {"block", "step", "off"}
    for g, v in e2e["variants"].items():
        assert v["calls_exact"] and v["fallbacks"] == 0 and v["fp8_fraction"] == 1.0, g
        assert v["fp8"]["lowered_fp8_dots"] > 0 and v["fp8"]["median_ms"] > 0
    conds = {g: v["fp8"]["hlo"]["conditionals"] for g, v in e2e["variants"].items()}
    # per layer 2 with 'block' (test_block_fallback_takes_two_conditionals_per_layer); 'step' has the step's
    # one decision (keep or drop the update), none in the blocks
    assert conds == {"block": 2, "step": 1, "off": 0}
    train = res["train"]
    assert train["within_2pct"], train
    assert train["fp8"]["ledger"]["fp8_calls"] > 0.9 * train["fp8"]["ledger"]["calls"]
    assert len(train["bf16"]["losses"]) == train["config"]["steps"]


def test_e2e_weight_scaling_variants(tmp_path, monkeypatch, fast_compiles):
    # The '+delayedw' / '+castw' steps run, count every call, never clip,
    # and delayed weight scales follow the weights the steps train.
    monkeypatch.setenv("OUT", str(tmp_path))
    res = _load().main(["--smoke", "--e2e", "--guards", "off,step+delayed+delayedw,step+delayed+castw,block+delayedw",
                        "--warmup", "0", "--iters", "1"])
    (e2e,) = res["e2e"]
    assert set(e2e["variants"]) == {"off", "step+delayed+delayedw", "step+delayed+castw", "block+delayedw"}
    for g, v in e2e["variants"].items():
        assert v["calls_exact"] and v["fallbacks"] == 0 and v["fp8_fraction"] == 1.0, g
        assert v["fp8"]["lowered_fp8_dots"] > 0 and v["weight_clipped"] == 0 and v["grad_clipped"] == 0, g
    # Casting the weights once per step changes nothing but the time.
    v = e2e["variants"]
    assert v["step+delayed+castw"]["fp8_loss_last"] == v["step+delayed+delayedw"]["fp8_loss_last"]
    assert v["step+delayed+castw"]["fp8"]["calls"] == v["step+delayed+delayedw"]["fp8"]["calls"]


def test_ffn_cast_weight_variant_matches_delayed_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    res = _load().main(["--smoke", "--ffn", "--ffn-variants", "delayedw-u-d,castw-u-d", "--no-flax",
                        "--warmup", "0", "--iters", "1"])
    rows = {r["variant"]: r for r in res["ffn"]}
    cast, delayed = rows["eae fp8 static unguarded delayed grads cast-w"], \
        rows["eae fp8 static unguarded delayed grads delayed-w"]
    for key in ("cos_bare", "cos_boundary", "grad_cos_dx", "grad_cos_dw_min"):
        assert cast[key] == delayed[key], key
    assert cast["fwd"]["lowered_fp8_dots"] == 2 and cast["fb"]["lowered_fp8_dots"] == 7
    assert cast["fwd_with_cast"]["median_ms"] > 0 and cast["fwd_with_cast"]["lowered_fp8_dots"] == 2
    # "fwd" is fp8.apply's forward: the ledger's statistics (amax of the
    # input and of the hidden) are left to the "fwd+ledger" timing.
    for row in (cast, delayed):
        assert row["fwd_ledger"]["lowered_fp8_dots"] == 2 and row["graph_fwd_ledger"]["copies"] == 2
        assert row["fwd"]["hlo"]["reduces"] < row["fwd_ledger"]["hlo"]["reduces"], row["fwd"]["hlo"]
        assert row["fwd_ledger_speedup"] > 0 and row["graph_fwd_ledger_speedup"] > 0


def test_step_profile_runs_every_guard_variant(tmp_path):
    res = load_experiment("profile_fp8_seam").main(["--step", "tiny", "--iters", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "profile_fp8_step_tiny.json").read_text())
    assert [r["variant"] for r in saved["runs"]] == ["step-bf16", "step-fp8-block", "step-fp8-step", "step-fp8-off"]
    conds = {r["variant"]: r["conditionals"] for r in res["runs"]}
    assert conds == {"step-bf16": 0, "step-fp8-block": 2, "step-fp8-step": 0, "step-fp8-off": 0}
    assert all(r["median_ms"] > 0 and r["kernels"] for r in res["runs"])


@pytest.mark.slow
def test_ffn_rows_are_on_disk_before_a_run_is_killed(tmp_path, monkeypatch):
    # A device call killed at its time limit must keep the FFN rows measured
    # so far: stop the run where the Flax comparison would start.
    monkeypatch.setenv("OUT", str(tmp_path))
    mod = _load()

    def killed():
        raise SystemExit("killed at the time limit")

    monkeypatch.setattr(mod, "_flax_ops", killed)
    with pytest.raises(SystemExit):
        mod.main(["--smoke", "--ffn", "--ffn-variants", "static", "--warmup", "0", "--iters", "1"])
    res = json.loads((tmp_path / "bench_fp8_smoke_ffn.json").read_text())
    names = [r["variant"] for r in res["ffn"]]
    assert names[0].startswith("bf16") and "eae fp8 static" in names and not any(n.startswith("flax") for n in names)
    assert not list(tmp_path.glob("*.tmp"))


def test_fusion_probe_runs_and_its_variants_agree(tmp_path):
    """experiments/fp8_fusion_probe.py on CPU (Pallas in interpret mode): every
    down-GEMM variant computes the fp8 product of its own quantization, the
    library's FFN forward matches the pre-`output_scale` one, and the Pallas
    SwiGLU kernel writes the same fp8 codes as XLA."""
    mod = load_experiment("fp8_fusion_probe")
    assert mod.main(["--shapes", "tiny", "--iters", "1", "--tiles", "32x512x4", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fp8_fusion_probe.json").read_text())
    down = {r["variant"]: r for r in res["down"]}
    assert set(down) == {"direct", "direct-bf16mul", "dq-bf16", "dq-f32", "dq-bf16-barrier", "dq-f32-barrier"}
    for name in ("direct", "direct-bf16mul", "dq-f32", "dq-f32-barrier"):
        assert down[name]["rel_err"] < 8e-3, down[name]  # bf16 output rounding only
    ffn = {r["variant"]: r for r in res["ffn"]}
    assert ffn["bf16"]["cos"] > 0.9999
    assert 0.99 < ffn["library"]["cos"] < 1.0 and abs(ffn["library"]["cos"] - ffn["legacy"]["cos"]) < 1e-3
    swiglu = {r["variant"]: r for r in res["swiglu"]}
    assert swiglu["xla-via-f16"]["codes_differing"] < 1e-3
    assert swiglu["pallas-32x512-w4"]["codes_differing"] == 0.0, swiglu["pallas-32x512-w4"]


@pytest.mark.parametrize("copies", [1, 3])
def test_in_graph_copies_share_no_weight_work(copies):
    # The 'graph' timing must not let XLA quantize one set of weights once
    # for all copies: every copy keeps its own weight quantization and GEMM.
    import jax
    import jax.numpy as jnp
    import numpy as np

    bench = _load()

    def f(w, x):
        wq = (w * 3.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        return x @ wq.T

    w, x = jnp.ones((48, 32)), jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32)
    run, run_args = bench.repeated(f, (w, x), 1, copies)
    text = jax.jit(run).lower(*run_args).compile().as_text()
    assert text.count("f8e4m3fn[48,32]{1,0} convert(") == copies
    outs = jax.jit(run)(*run_args)
    assert len(outs) == copies
    for i, y in enumerate(outs):  # copy i sees the input rolled by i rows
        np.testing.assert_array_equal(np.asarray(y), np.asarray(f(w, jnp.roll(x, i, axis=0))))
    with pytest.raises(ValueError, match="copies"):
        bench.repeated(f, (w, x), 1, 0)


def test_sustained_probe_timeline_stats():
    """fp8_sustained_probe.timeline_stats: kernel time sums every event,
    idle time is the traced span minus the union of the events' intervals
    (two streams overlapping count once), both per call."""
    mod = load_experiment("fp8_sustained_probe")
    ev = [{"name": "gemm", "ts": 0.0, "dur": 10.0, "tid": 1},
          {"name": "copy", "ts": 5.0, "dur": 10.0, "tid": 2},  # overlaps gemm: [0, 15) covered
          {"name": "gemm", "ts": 20.0, "dur": 6.0, "tid": 1},  # 5 idle before it
          {"name": "tiny", "ts": 21.0, "dur": 1.0, "tid": 2},  # inside the second gemm
          {"name": "fuse", "ts": 30.0, "dur": 2.0, "tid": 1}]  # 4 idle before it
    st = mod.timeline_stats(ev, calls=2)
    assert st["busy_us"] == pytest.approx(29.0 / 2)
    assert st["span_us"] == pytest.approx(32.0 / 2)
    assert st["idle_us"] == pytest.approx(9.0 / 2)
    kernels = {k[0]: k for k in st["kernels"]}
    assert kernels["gemm"][1:] == pytest.approx((8.0, 1.0, 8.0))  # per call, calls per call, mean duration
    assert st["kernels"][0][0] == "gemm"
    assert mod.timeline_stats([], calls=1)["idle_us"] == 0.0
