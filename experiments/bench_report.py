"""Report of a `bench_stack.py` campaign: per-variant medians with 95%
intervals, ratios with their verdicts, targets, clocks per timing window,
tables and charts (numpy, scipy, matplotlib when present).

Rows are processes; `aggregate` folds the processes of one variant into
one entry (`bench_stats` gives the statistic and its interval). A row of an
older single-process run (no per-step times) aggregates to a value with no
interval, and its ratios to the verdict ``n/a``.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import bench_common as bc
import bench_stats as bs

# The library's own targets, as ratios measured within one campaign.
TIME_TOL_EAE_VS_REMAT = 1.02
TIME_TOL_PASSES = 1.05
TIME_TOL_OFFLOAD = 1.15
SELECTIVE_TIME = 0.95
SELECTIVE_MEM = 0.5

#: Time ratios ``X / eae`` (above 1: eae is faster, a win).
TIME_AGAINST = ("J-remat", "J-remat-nocse", "J-plain", "T-plain", "T-ckpt", "T-compile", "T-compile-ckpt",
                "T-compile-b0.1", "T-compile-b0.3", "T-compile-b0.5", "T-eae", "T-eae-nosync")
#: Memory ratios ``eae / X`` (below 1: eae needs less, a win), peak and pool.
MEMORY_AGAINST = ("T-ckpt", "T-compile-b0.1", "T-compile-b0.3", "T-compile-b0.5", "T-compile-ckpt", "J-remat",
                  "T-eae")
#: A ratio gets an interval and a verdict only with this many processes a side.
MIN_PROCESSES = 2
#: Ratios that separate framework costs (informative, no side wins).
INFO_RATIOS = (("T-eae", "T-eae-nosync", "time"), ("J-remat", "J-remat-nocse", "time"),
               ("T-compile", "T-plain", "time"))


def fmt_err(v) -> str:
    return "n/a" if v is None else f"{v:.2e}"


def _gib(b) -> Optional[float]:
    return None if b is None else b / bc.GIB


def _median(values) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


# ---------------------------------------------------------------------------- aggregation
def attach_clocks(rows: List[dict], samples: Sequence[dict]) -> None:
    """Give every timed row the clock statistics of its timing window."""
    if not samples:
        return
    for r in rows:
        if r.get("timed_window"):
            r["clocks"] = bs.window_clocks(samples, *r["timed_window"])


CHECK_FIELDS = ("grad_rel_err", "grad_worst_leaf", "grad_worst_rel_err", "grad_rel_err_vs_f32",
                "grad_worst_rel_err_vs_f32", "grad_reference", "loss_ref", "block0_vs_seed_block_rel_err",
                "grad_rel_err_vs_eae_same_process", "loss_vs_eae_same_process", "memory_analysis", "hlo",
                "boundaries_in_grads", "dynamo_stats", "graph_breaks")


def aggregate(rows: List[dict]) -> List[dict]:
    """One entry per (config, variant) over its timed processes."""
    groups: Dict[Tuple[str, str], List[dict]] = {}
    for r in rows:
        if r.get("role", "timed") == "timed":
            groups.setdefault((r["config"], r["variant"]), []).append(r)
    out = []
    for (config, variant), procs in groups.items():
        ok = [r for r in procs if r.get("status") == "ok"]
        entry = {"config": config, "variant": variant, "processes": len(procs), "processes_ok": len(ok),
                 "statuses": [r.get("status") for r in procs], "config_detail": procs[0]["config_detail"]}
        if ok:
            per_step = all(r.get("times_ms") for r in ok)
            times = [r["times_ms"] if per_step else [r["step_ms_median"]] for r in ok]
            seed = bs.seed_for(f"{config}/{variant}")
            summary = bs.summarize(times, seed)
            if not per_step:
                summary.update(ci=None, ci_bootstrap=None, ci_t=None)
            entry.update(per_step_times=per_step, step_ms=summary["value"], step_ms_ci=summary["ci"],
                         step_ms_ci_bootstrap=summary["ci_bootstrap"], step_ms_ci_t=summary["ci_t"],
                         process_medians_ms=summary["process_medians"], times_ms=times)
            cfg = bc.StackConfig(**entry["config_detail"])
            entry["mfu_pct"] = 100.0 * cfg.model_flops() / (entry["step_ms"] / 1e3) / bc.PEAK_BF16_FLOPS
            for key in ("peak_bytes", "peak_reserved_bytes"):
                vals = [r.get(key) for r in ok]
                entry[key + "_all"] = vals
                entry[key] = _median(vals)
            entry["pool_name"] = ok[0].get("pool_name")
            entry["compile_s"] = [r.get("compile_s") for r in ok]
            entry["host_syncs_per_step"] = [r["host_syncs_per_step"] for r in ok if "host_syncs_per_step" in r]
            entry["loss"] = ok[0].get("loss")
            for key in ("sdpa_backend", "torch_mode", "activation_memory_budget", "carry_calls"):
                if key in ok[0]:
                    entry[key] = ok[0][key]
            checked = [r for r in ok if r.get("check", True)]  # an older single-process row checked itself
            for key in CHECK_FIELDS:
                if checked and key in checked[0]:
                    entry[key] = checked[0][key]
            clocks = [r["clocks"] for r in ok if r.get("clocks", {}).get("samples")]
            if clocks:
                entry["clocks"] = {
                    "samples": sum(c["samples"] for c in clocks),
                    "sm_mhz_min": min(c.get("sm_mhz_min", np.inf) for c in clocks),
                    "sm_mhz_median": _median([c.get("sm_mhz_median") for c in clocks]),
                    "power_w_max": max(c.get("power_w_max", -np.inf) for c in clocks),
                    "temp_c_max": max(c.get("temp_c_max", -np.inf) for c in clocks),
                    "clock_event_reasons": sorted({x for c in clocks for x in c.get("clock_event_reasons", [])})}
        out.append(entry)
    order = list(bc.VARIANTS)
    rank = {"medium": 0, "deep": 1}
    out.sort(key=lambda e: (rank.get(e["config"], 2), e["config_detail"]["depth"],
                            order.index(e["variant"]) if e["variant"] in order else len(order)))
    return out


def _by(agg: List[dict], config: str) -> Dict[str, dict]:
    return {e["variant"]: e for e in agg if e["config"] == config and e.get("processes_ok")}


def _ratio_entry(config, name, kind, a: dict, b: dict, higher_is_win: Optional[bool], reading: str) -> dict:
    # Processes without per-step times (older single-process runs) give no interval and no verdict.
    per_step = a["per_step_times"] and b["per_step_times"]
    if kind == "time":
        num, den = a["times_ms"], b["times_ms"]
    else:
        key = "peak_bytes_all" if kind == "peak" else "peak_reserved_bytes_all"
        if any(v is None for v in a.get(key, [None]) + b.get(key, [None])):
            return {"config": config, "name": name, "kind": kind, "value": None, "ci": None, "verdict": "n/a",
                    "reading": reading, "note": "not reported by this backend"}
        num, den = [[v] for v in a[key]], [[v] for v in b[key]]
    r = bs.ratio(num, den, bs.seed_for(f"{config}/{name}/{kind}/num"), bs.seed_for(f"{config}/{name}/{kind}/den"))
    note = ""
    if not per_step:
        r.update(ci=None, ci_bootstrap=None, ci_t=None)
        note = "no per-step times"
    elif min(len(num), len(den)) < MIN_PROCESSES:
        # one process says nothing about the spread between processes
        r.update(ci=None)
        note = f"fewer than {MIN_PROCESSES} processes on a side"
    verdict = "info" if higher_is_win is None else bs.verdict(r["ci"], higher_is_win)
    return {"config": config, "name": name, "kind": kind, **r, "verdict": verdict, "reading": reading,
            "processes": [len(num), len(den)], "note": note}


def ratios(agg: List[dict], config: str) -> List[dict]:
    """Every ratio of docs/benchmarks.md that this campaign measured, for one config."""
    e = _by(agg, config)
    out = []
    if "eae" in e:
        for x in TIME_AGAINST:
            if x in e:
                out.append(_ratio_entry(config, f"{x} / eae", "time", e[x], e["eae"], True,
                                        "step time; above 1: eae faster"))
        for x in MEMORY_AGAINST:
            if x in e:
                for kind, what in (("peak", "peak allocated"), ("pool", "allocator pool")):
                    out.append(_ratio_entry(config, f"eae / {x}", kind, e["eae"], e[x], False,
                                            f"{what}; below 1: eae needs less"))
    for a, b, kind in INFO_RATIOS:
        if a in e and b in e:
            out.append(_ratio_entry(config, f"{a} / {b}", kind, e[a], e[b], None, "step time ratio, informative"))
    return out


# ---------------------------------------------------------------------------- targets
def _check(name, value, op, bound, note=""):
    if value is None or bound is None:
        return {"name": name, "value": None, "op": op, "bound": bound, "pass": None, "note": note or "missing input"}
    ok = value <= bound if op == "<=" else value >= bound if op == ">=" else value < bound
    return {"name": name, "value": value, "op": op, "bound": bound, "pass": bool(ok), "note": note}


def _div(a, b):
    return None if a is None or b is None or b == 0 else a / b


OFFLOAD_VARIANTS = ("eae-offload", "eae-offload-unrolled")


def targets(agg: List[dict], config: str) -> List[dict]:
    """The library's own target ratios for one configuration (point values)."""
    r = _by(agg, config)
    if not r:
        return []
    cfg = bc.StackConfig(**next(iter(r.values()))["config_detail"])
    t = {k: v.get("step_ms") for k, v in r.items()}
    m = {k: v.get("peak_bytes") for k, v in r.items()}
    b = cfg.boundary_bytes(2)
    out = [
        _check("eae time / J-remat time", _div(t.get("eae"), t.get("J-remat")), "<=", TIME_TOL_EAE_VS_REMAT),
        _check("eae-dots time / J-plain time", _div(t.get("eae-dots"), t.get("J-plain")), "<=", SELECTIVE_TIME,
               "selective policy 'dots' = keep outputs of weight matmuls"),
        _check("eae-dots peak / J-plain peak", _div(m.get("eae-dots"), m.get("J-plain")), "<=", SELECTIVE_MEM),
        _check("eae-passes time / eae time", _div(t.get("eae-passes"), t.get("eae")), "<=", TIME_TOL_PASSES,
               "chain(int8_fake_quant(), clip_by_norm(1.0)), boundary-only policy on both sides"),
    ]
    # Offload memory: params + grads + one block + 2 boundaries. "One block"
    # is what the on-device eae needs beyond its params, grads and L
    # boundaries, so the bound is that eae peak minus the L-2 boundaries that
    # should have left the device; boundaries kept in the gradient buffers
    # cost nothing of their own, so then it is eae's peak plus 2.
    slotted = bool(r.get("eae", {}).get("boundaries_in_grads"))
    if "eae-sep" in r:
        base, shift, how = m.get("eae-sep"), -(cfg.depth - 2), "eae-sep peak - (L-2)"
    elif slotted:
        base, shift, how = m.get("eae"), 2, "eae peak (boundaries in grads) + 2"
    else:
        base, shift, how = m.get("eae"), -(cfg.depth - 2), "eae peak - (L-2)"
    bound = None if base is None else base + shift * b
    if "eae-sep" in r and "eae" in r:
        out.append({"name": "info: boundaries saved by storing them in the gradient buffers", "op": "",
                    "bound": None, "pass": None, "value": _div(_sub(m.get("eae-sep"), m.get("eae")), b),
                    "note": f"(eae-sep peak - eae peak) / one boundary; ideally L = {cfg.depth}"})
    for name in OFFLOAD_VARIANTS:
        if name not in r:
            continue
        out.append(_check(f"{name} time / eae time", _div(t.get(name), t.get("eae")), "<=", TIME_TOL_OFFLOAD))
        out.append(_check(f"{name} peak / (params+grads+block+2 boundaries)", _div(m.get(name), bound),
                          "<=", 1.0, f"bound = {how} x {b / 2**20:.0f} MiB"))
        off = r[name]
        eae_err, off_err = r.get("eae", {}).get("grad_rel_err_vs_f32"), off.get("grad_rel_err_vs_f32")
        if eae_err is not None and off_err is not None:
            out.append(_check(f"{name} grad error - eae grad error (both vs float32)", off_err - eae_err,
                              "<=", 1e-3, "offloading the boundaries costs no accuracy"))
        if "grad_rel_err_vs_eae_same_process" in off:
            out.append(_check(f"{name} grads vs eae-sep grads, same process (rel err)",
                              off.get("grad_rel_err_vs_eae_same_process"), "<=", 2e-2,
                              "same source but for the boundaries' memory space; bf16 rounding level, "
                              "as XLA fuses the two programs differently"))
    if m.get("eae-mp-f32b") is not None and m.get("eae-mp-bf16b") is not None:
        out.append(_check("mp: bf16-boundary saving / (L x half an fp32 boundary)",
                          _div(m["eae-mp-f32b"] - m["eae-mp-bf16b"], cfg.depth * b), ">=", 0.9,
                          "fp32-master model, boundaries apart from the gradient buffers; boundary_dtype=bf16 "
                          "halves them"))
    params_b = cfg.param_count() * 2
    stored = 0 if slotted else cfg.depth
    floor = params_b * 2 + stored * b
    out.append({"name": f"info: eae floor params+grads+{'L boundaries' if stored else 'no boundaries'} (GiB)",
                "value": floor / bc.GIB, "op": "", "bound": None, "pass": None,
                "note": f"params {params_b / bc.GIB:.2f} GiB"})
    if m.get("eae") is not None:
        out.append({"name": "info: eae peak above that floor (GiB)", "value": (m["eae"] - floor) / bc.GIB, "op": "",
                    "bound": None, "pass": None, "note": "one block's recompute internals + inputs + workspace"})
    return out


def _sub(a, b):
    return None if a is None or b is None else a - b


def sweep_analysis(agg: List[dict]) -> dict:
    """Peak-memory slope vs depth per variant (least squares), and eae's expected slope."""
    sweep = [e for e in agg if e["config"].startswith("sweep-") and e.get("processes_ok")]
    out = {"variants": {}}
    if not sweep:
        return out
    cfg = bc.StackConfig(**sweep[0]["config_detail"])
    per_block = cfg.params_per_block() * 2 * 2 + cfg.boundary_bytes(2)  # params + grads + one boundary
    out["expected_eae_slope_mib"] = per_block / 2**20
    for v in sorted({e["variant"] for e in sweep}):
        pts = sorted((e["config_detail"]["depth"], e.get("peak_bytes"), e.get("step_ms")) for e in sweep
                     if e["variant"] == v)
        depths = [p[0] for p in pts]
        entry = {"depth": depths, "peak_gib": [_gib(p[1]) for p in pts], "step_ms": [p[2] for p in pts]}
        if len(pts) >= 2 and all(p[1] is not None for p in pts):
            entry["peak_slope_mib_per_block"] = float(np.polyfit(depths, [p[1] for p in pts], 1)[0] / 2**20)
        if len(pts) >= 2:
            entry["time_slope_ms_per_block"] = float(np.polyfit(depths, [p[2] for p in pts], 1)[0])
        out["variants"][v] = entry
    eae = out["variants"].get("eae", {})
    if "peak_slope_mib_per_block" in eae:
        out["check"] = _check("sweep: eae peak slope / (params+grads+1 boundary per block)",
                              eae["peak_slope_mib_per_block"] / out["expected_eae_slope_mib"], "<=", 1.1)
    return out


# ---------------------------------------------------------------------------- text
def _ci(ci, fmt="{:.2f}") -> str:
    return "n/a" if not ci or ci[0] is None else f"[{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def _compile_text(vals) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    return f"{vals[0]:.1f}" + (f" / {np.median(vals[1:]):.1f}" if len(vals) > 1 else "")


def variant_lines(agg: List[dict], markdown: bool) -> List[str]:
    head = ["config", "variant", "ok", "step ms", "95% CI", "process medians", "peak GiB", "pool GiB", "MFU %",
            "grad err vs J-plain", "vs f32", "compile s (first / later)", "syncs/step", "SM MHz min/med", "max W"]
    body = []
    for e in agg:
        ok = e.get("processes_ok", 0) > 0
        c = e.get("clocks") or {}
        body.append([
            e["config"], e["variant"], f"{e.get('processes_ok', 0)}/{e['processes']}",
            f"{e['step_ms']:.2f}" if ok else "-", _ci(e.get("step_ms_ci")) if ok else "-",
            " ".join(f"{v:.1f}" for v in e.get("process_medians_ms", [])) or "-",
            f"{_gib(e['peak_bytes']):.3f}" if ok and e.get("peak_bytes") is not None else "-",
            f"{_gib(e['peak_reserved_bytes']):.3f}" if ok and e.get("peak_reserved_bytes") is not None else "-",
            f"{e['mfu_pct']:.1f}" if ok else "-",
            fmt_err(e.get("grad_rel_err")) if e.get("grad_rel_err") is not None else "-",
            fmt_err(e.get("grad_rel_err_vs_f32")) if e.get("grad_rel_err_vs_f32") is not None else "-",
            _compile_text(e.get("compile_s", [])),
            " ".join(str(v) for v in e.get("host_syncs_per_step", [])) or "-",
            f"{c['sm_mhz_min']:.0f}/{c['sm_mhz_median']:.0f}" if c.get("sm_mhz_median") else "-",
            f"{c['power_w_max']:.0f}" if c.get("power_w_max") is not None and np.isfinite(c["power_w_max"]) else "-",
        ])
    return _table(head, body, markdown)


def ratio_lines(rats: List[dict], markdown: bool) -> List[str]:
    head = ["config", "ratio", "kind", "value", "95% CI", "verdict", "reading"]
    body = [[r["config"], r["name"], r["kind"], "n/a" if r["value"] is None else f"{r['value']:.3f}",
             _ci(r.get("ci"), "{:.3f}"), r["verdict"], r["reading"] + (f" ({r['note']})" if r.get("note") else "")]
            for r in rats]
    return _table(head, body, markdown)


def _table(head, body, markdown: bool) -> List[str]:
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return [fmt.format(*head), fmt.format(*["-" * w for w in widths])] + [fmt.format(*row) for row in body]


def target_lines(checks: List[dict], config: str) -> List[str]:
    lines = []
    for c in checks:
        mark = {True: "PASS", False: "FAIL", None: "----"}[c["pass"]]
        val = "n/a" if c["value"] is None else f"{c['value']:.3f}"
        bound = "" if c["bound"] is None else f" {c['op']} {c['bound']}"
        note = f"  ({c['note']})" if c.get("note") else ""
        lines.append(f"  [{mark}] {config:<7} {c['name']}: {val}{bound}{note}")
    return lines


def errors_lines(rows: List[dict]) -> List[str]:
    lines = []
    for r in rows:
        if r.get("status") != "ok":
            first = str(r.get("error", "")).strip().splitlines()
            who = f"{r['variant']}@{r['config']}" + (" (ref)" if r.get("role") == "ref" else f" #{r.get('round', 0)}")
            lines.append(f"  {who}: {r.get('status')}: {first[0][:240] if first else ''}")
    return lines


def timeline_summary(meta: dict) -> Dict[str, float]:
    tl = meta.get("timeline") or []
    return {"startup_s": sum(t.get("s", 0.0) for t in tl if t.get("phase") == "startup"),
            "prepare_s": sum(t.get("prep_s", 0.0) for t in tl if t.get("phase") == "prepare"),
            "measure_s": sum(t.get("measure_s", 0.0) for t in tl if t.get("phase") == "measure"),
            "wall_s": meta.get("wall_s", 0.0)}


METHOD = ("Statistic: median over processes of each process's median step time. 95% CI: the span of a two-level "
          "bootstrap (processes, then steps within each) and a t interval on the log process medians (Welch's for "
          "ratios). A ratio is a win or a loss only when its CI excludes 1, else a tie. Memory: the allocator's "
          "peak (JAX peak_bytes_in_use, torch max_memory_allocated) and its pool (the key in pool_name), median "
          "over processes; both sides hold the same tensors at rest (params, x, y in bf16) and compute the same "
          "float32 loss. Clocks: nvidia-smi samples inside each timing window (smi.csv.gz).")


#: What a reader of the tables needs to know about how the sides differ.
NOTES = (
    "Torch blocks are the seed's reference block with attention through SDPA(enable_gqa=True) on the pinned "
    "backend (sdpa_backend, flash_attention_impl in the JSON); SDPA runs enable_gqa on the flash and math "
    "backends only (its documentation, 2.11), so torch's attention kernel is FlashAttention while JAX's is "
    "cuDNN's fused attention (hlo.cudnn_attention_calls).",
    "torch.compile compiles each block (fullgraph, default mode, one graph shared by the blocks), the loss stays "
    "eager; T-compile-bX sets torch._functorch.config.activation_memory_budget = X for that process.",
    "T-compile-bX repeats the kv heads before SDPA instead of enable_gqa: torch's partitioner under "
    "activation_memory_budget counts SDPA FLOPs with a formula that refuses grouped shapes "
    "(sdpa_flop_count: 'query/key/value shapes are incompatible').",
    "T-eae-nosync is the seed runtime with RuntimeConfig(scheduler=NoHostReadScheduler()): the seed's only "
    "per-block host read is the norm .item() inside ReconstructionEngine.reconstruct, which no RuntimeConfig "
    "option removes; the scheduler is the runtime's documented extension point. syncs/step counts synchronizing "
    "CUDA calls in one step (torch.cuda.set_sync_debug_mode).",
    "Compile caches are shared between the processes of a variant (a later process loads the first one's "
    "executable), so process-to-process spread excludes compilation differences; JAX's pool of a process that "
    "autotuned (compile s first) may include autotuning scratch.",
    "Gradient errors come from each variant's first process: against J-plain (bf16, another program) and against "
    "the same step in float32 (accuracy).",
)


# ---------------------------------------------------------------------------- charts
def _plots(out_dir: str, agg: List[dict], sweep: dict) -> List[str]:
    made = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # no matplotlib: the JSON and tables still get written
        print(f"[bench] no charts: matplotlib unavailable ({err})", flush=True)
        return made
    main = [e for e in agg if e["config"] in ("medium", "deep") and e.get("processes_ok")]
    if main:
        labels = [f"{e['variant']} ({e['config']})" for e in main]
        y = np.arange(len(main))
        fig, axes = plt.subplots(1, 2, figsize=(15, 0.32 * len(main) + 2.5))
        med = np.array([e["step_ms"] for e in main])
        lo = np.array([e["step_ms_ci"][0] if e.get("step_ms_ci") else m for e, m in zip(main, med)])
        hi = np.array([e["step_ms_ci"][1] if e.get("step_ms_ci") else m for e, m in zip(main, med)])
        axes[0].barh(y, med, xerr=[med - lo, hi - med], capsize=3)
        axes[0].set_xlabel("median step time (ms), 95% CI")
        peaks = [_gib(e.get("peak_bytes")) or 0.0 for e in main]
        pools = [_gib(e.get("peak_reserved_bytes")) or 0.0 for e in main]
        axes[1].barh(y - 0.2, peaks, height=0.4, label="peak allocated")
        axes[1].barh(y + 0.2, pools, height=0.4, label="allocator pool")
        axes[1].set_xlabel("device memory (GiB)")
        axes[1].legend(fontsize=8)
        for ax in axes:
            ax.set_yticks(y)
            ax.set_yticklabels(labels, fontsize=8)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
        fig.suptitle("LLaMA-style stack, bf16: fwd+bwd step (lower is better)")
        fig.tight_layout()
        path = os.path.join(out_dir, "bench_chart.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    if sweep.get("variants"):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for v, e in sweep["variants"].items():
            if any(p is not None for p in e["peak_gib"]):
                axes[0].plot(e["depth"], [p if p is not None else np.nan for p in e["peak_gib"]], "o-", label=v)
            axes[1].plot(e["depth"], e["step_ms"], "o-", label=v)
        axes[0].set_xlabel("depth")
        axes[0].set_ylabel("peak device memory (GiB)")
        axes[1].set_xlabel("depth")
        axes[1].set_ylabel("median step time (ms)")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, "bench_sweep.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


# ---------------------------------------------------------------------------- all outputs
def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_outputs(out_dir: str, rows: List[dict], meta: dict, final: bool) -> str:
    """Write bench_results.json, bench_table.md (and the charts when final); return the console report."""
    agg = aggregate(rows)
    configs = list(dict.fromkeys(e["config"] for e in agg))
    rats = [r for c in configs for r in ratios(agg, c)]
    checks = {c: targets(agg, c) for c in ("medium", "deep")}
    sweep = sweep_analysis(agg)
    doc = {"format": 2, "meta": meta, "rows": rows, "aggregate": [{k: v for k, v in e.items() if k != "times_ms"}
                                                                   for e in agg],
           "ratios": rats, "targets": checks, "sweep": sweep, "method": METHOD,
           "flop_formula": bc.StackConfig.model_flops.__doc__.strip()}
    atomic_write(os.path.join(out_dir, "bench_results.json"), json.dumps(doc, indent=1, default=str))
    tl = timeline_summary(meta)
    report = ["", "=" * 100, "VARIANTS (median over processes of each process's median step; 95% CI)"]
    report += variant_lines(agg, markdown=False)
    report += ["", "RATIOS"] + ratio_lines(rats, markdown=False)
    errs = errors_lines(rows)
    if errs:
        report += ["", "not ok:"] + errs
    report += ["", "TARGETS"] + [line for c in ("medium", "deep") for line in target_lines(checks[c], c)]
    if "check" in sweep:
        report += target_lines([sweep["check"]], "sweep")
    report += ["", "timeline: " + ", ".join(f"{k} {v:.0f}" for k, v in tl.items())]
    gpu = meta.get("gpu", {}).get("nvidia_smi", "none")
    md = ["# Stack benchmark", "", f"Command: `{' '.join(meta.get('argv', []))}`", "",
          f"Versions: {meta.get('versions')}  ", f"GPU: {gpu}  ",
          f"Processes per variant: {meta.get('repeats')}, timed steps {meta.get('steps')} after {meta.get('warmup')} "
          f"warm-up, order seed {meta.get('seed')}, SDPA backend {meta.get('sdpa_backend')}, compile caches "
          f"{'shared' if meta.get('compile_cache') else 'off'}.", "", METHOD, "", "## Variants", ""]
    md += variant_lines(agg, markdown=True)
    md += ["", "## Ratios", ""] + ratio_lines(rats, markdown=True)
    md += ["", "## Targets", "", "```"] + [line for c in ("medium", "deep") for line in target_lines(checks[c], c)]
    if "check" in sweep:
        md += target_lines([sweep["check"]], "sweep")
    md += ["```", "", "## Timing order", "",
           ", ".join(f"{o['variant']}#{o['round']}" for o in meta.get("timing_order", [])) or "-", "",
           "## Timeline (s)", "", ", ".join(f"{k} {v:.0f}" for k, v in tl.items())]
    if errs:
        md += ["", "## Not ok", "", "```"] + errs + ["```"]
    md += ["", "## Notes", ""] + [f"* {n}" for n in NOTES]
    md += ["", f"MFU: {' '.join(doc['flop_formula'].split())} Over the median step time, against "
           f"{bc.PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s (H100/H200 SXM dense bf16 datasheet)."]
    atomic_write(os.path.join(out_dir, "bench_table.md"), "\n".join(md) + "\n")
    if final:
        made = _plots(out_dir, agg, sweep)
        report += ["", "wrote " + ", ".join(["bench_results.json", "bench_table.md"] +
                                            [os.path.basename(p) for p in made]) + f" to {out_dir}"]
    return "\n".join(report)
