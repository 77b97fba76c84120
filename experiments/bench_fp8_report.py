"""Report of an fp8 campaign (`bench_fp8_campaign.py`): medians with 95%
intervals, ratios with verdicts (`bench_stats`), the gradient cosines, the
training curves; ``fp8_results.json``, ``fp8_table.md`` (the tables
docs/benchmarks.md shows), ``fp8_train_curves.png``. numpy, scipy,
matplotlib when present; no JAX.

``python experiments/bench_fp8_report.py RESULTS.json`` prints the markdown
tables of a campaign's ``fp8_results.json`` (or ``fp8_rows.json``),
recomputed from its rows, to paste into docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_report as br  # noqa: E402
import bench_stats as bs  # noqa: E402

#: A ratio gets an interval and a verdict only with this many processes a side.
MIN_PROCESSES = br.MIN_PROCESSES
KINDS = {"fwd": "forward", "fb": "forward+backward"}
FP8_FFN = ("eae-in", "eae-in-u", "eae-pre", "eae-pre-u", "flax-direct", "flax-einsum", "flax-pre")
#: Head-to-head FFN ratios ``Flax / ours`` (above 1: ours faster): the same weight handling on both sides.
FFN_VERSUS = (("flax-direct", "eae-in"), ("flax-direct", "eae-in-u"), ("flax-einsum", "eae-in-u"),
              ("flax-pre", "eae-pre"), ("flax-pre", "eae-pre-u"))
#: Ratios that price one choice (informative: no side wins).
FFN_INFO = (("eae-in", "eae-in-u", "the guard's cond"), ("eae-in-u", "eae-pre-u", "casting inside the call"),
            ("flax-direct", "flax-pre", "Flax quantizing its kernel in the call"))
STEP_VERSUS = (("flax-fp8", "eae-fp8"), ("flax-fp8", "eae-fp8-u"))
STEP_INFO = (("eae-fp8", "eae-fp8-u", "the step guard"),)
DOC = {
    "bf16": "bf16 (`swiglu` / the plain block)",
    "eae-in": "ours, guarded, weights cast inside the call",
    "eae-in-u": "ours, unguarded, weights cast inside the call",
    "eae-pre": "ours, guarded, weights cast before the call",
    "eae-pre-u": "ours, unguarded, weights cast before the call",
    "flax-direct": "Flax `Fp8DirectDotGeneralOp` (kernel quantized in the call)",
    "flax-einsum": "Flax `Fp8Einsum` (kernel quantized in the call)",
    "flax-pre": "Flax's `fp8_ops` pieces, kernel quantized before the call",
    "eae-fp8": "ours as `eae-jax train --dtype fp8_e4m3` (step guard)",
    "eae-fp8-u": "ours, same recipe, unguarded",
    "flax-fp8": "Flax `Fp8DirectDotGeneralOp` in the same block",
}


def _ok(rows: List[dict], **match) -> List[dict]:
    return [r for r in rows if r.get("status") == "ok" and r.get("role", "timed") == "timed"
            and all(r.get(k) == v for k, v in match.items())]


def _entry(name: str, processes: List[List[float]]) -> dict:
    s = bs.summarize(processes, bs.seed_for(name))
    return {"ms": s["value"], "ci": s["ci"], "process_medians": s["process_medians"], "processes": len(processes)}


def _ratio(name: str, num: List[List[float]], den: List[List[float]], higher_is_win: Optional[bool],
           reading: str) -> dict:
    r = bs.ratio(num, den, bs.seed_for(name + "/num"), bs.seed_for(name + "/den"))
    note = ""
    if min(len(num), len(den)) < MIN_PROCESSES:
        r["ci"], note = None, f"fewer than {MIN_PROCESSES} processes on a side"
    verdict = "info" if higher_is_win is None else bs.verdict(r["ci"], higher_is_win)
    return {"name": name, "value": r["value"], "ci": r["ci"], "verdict": verdict, "reading": reading, "note": note,
            "processes": [len(num), len(den)]}


# ---------------------------------------------------------------------------- aggregation
def ffn_summary(rows: List[dict]) -> Dict[str, dict]:
    """Per FFN shape: per variant and kind the median per-call time with its
    interval, the ratios with their verdicts, the output cosines."""
    out = {}
    for shape in dict.fromkeys(r["config"] for r in _ok(rows, variant="ffn")):
        procs = _ok(rows, variant="ffn", config=shape)
        variants = list(procs[0]["times_ms"])
        times = {v: {k: [p["times_ms"][v][k] for p in procs if v in p["times_ms"]] for k in KINDS} for v in variants}
        entry = {"shape": procs[0]["config_detail"], "processes": len(procs), "variants": {}, "ratios": [],
                 "cos_fwd_vs_bf16": procs[0].get("cos_fwd_vs_bf16"), "hlo": procs[0].get("hlo"),
                 "variant_errors": {v: why for p in procs for v, why in (p.get("variant_errors") or {}).items()}}
        for v in variants:
            entry["variants"][v] = {k: _entry(f"ffn/{shape}/{v}/{k}", times[v][k]) for k in KINDS}
        for k in KINDS:
            for v in [v for v in variants if v != "bf16"]:
                if "bf16" in times:
                    entry["ratios"].append(dict(_ratio(f"ffn/{shape}/{k}/bf16 / {v}", times["bf16"][k], times[v][k],
                                                       True, "speed-up over bf16; above 1: fp8 faster"),
                                                kind=k, group="vs bf16", variant=v))
            for a, b in FFN_VERSUS:
                if a in times and b in times:
                    entry["ratios"].append(dict(_ratio(f"ffn/{shape}/{k}/{a} / {b}", times[a][k], times[b][k], True,
                                                       "above 1: ours faster"), kind=k, group="versus"))
            for a, b, what in FFN_INFO:
                if a in times and b in times:
                    entry["ratios"].append(dict(_ratio(f"ffn/{shape}/{k}/{a} / {b}", times[a][k], times[b][k], None,
                                                       f"cost of {what}"), kind=k, group="info"))
        out[shape] = entry
    return out


def step_summary(rows: List[dict]) -> Dict[str, dict]:
    """Per train-step configuration: step times with intervals, ratios, fp8 ledgers."""
    out = {}
    timed = [r for r in _ok(rows) if r["variant"] != "ffn"]
    for config in dict.fromkeys(r["config"] for r in timed):
        by = {}
        for r in timed:
            if r["config"] == config:
                by.setdefault(r["variant"], []).append(r)
        entry = {"variants": {}, "ratios": []}
        times = {v: [p["times_ms"] for p in procs] for v, procs in by.items()}
        for v, procs in by.items():
            e = _entry(f"step/{config}/{v}", times[v])
            e.update(compile_s=[p.get("compile_s") for p in procs], hlo=procs[0].get("hlo"),
                     rejected_steps=sum(p.get("rejected_steps", 0) for p in procs),
                     fallbacks=sum((p.get("fp8") or {}).get("fallbacks", 0) for p in procs),
                     loss_last=procs[0]["losses"][-1] if procs[0].get("losses") else None,
                     clocks=_clocks([p.get("clocks") for p in procs]))
            entry["variants"][v] = e
        for v in times:
            if v != "bf16" and "bf16" in times:
                entry["ratios"].append(dict(_ratio(f"step/{config}/bf16 / {v}", times["bf16"], times[v], True,
                                                   "speed-up over bf16; above 1: fp8 faster"), group="vs bf16",
                                            variant=v))
        for a, b in STEP_VERSUS:
            if a in times and b in times:
                entry["ratios"].append(dict(_ratio(f"step/{config}/{a} / {b}", times[a], times[b], True,
                                                   "above 1: ours faster"), group="versus"))
        for a, b, what in STEP_INFO:
            if a in times and b in times:
                entry["ratios"].append(dict(_ratio(f"step/{config}/{a} / {b}", times[a], times[b], None,
                                                   f"cost of {what}"), group="info"))
        out[config] = entry
    return out


def _clocks(windows: Sequence[Optional[dict]]) -> Optional[dict]:
    got = [c for c in windows if c and c.get("samples")]
    if not got:
        return None
    return {"samples": sum(c["samples"] for c in got), "sm_mhz_min": min(c.get("sm_mhz_min", np.inf) for c in got),
            "sm_mhz_median": float(np.median([c.get("sm_mhz_median") for c in got if c.get("sm_mhz_median")])),
            "power_w_max": max(c.get("power_w_max", -np.inf) for c in got),
            "clock_event_reasons": sorted({x for c in got for x in c.get("clock_event_reasons", [])})}


def cosine_summary(rows: List[dict]) -> Dict[str, dict]:
    """The reference processes' gradient agreements, per configuration."""
    keys = ("cosines", "loss", "loss_f32", "gate_worst_cos", "eae_step", "flax_error", "observe_step_rejected",
            "compile_s", "run_s", "bind_s")
    out: Dict[str, dict] = {}
    for r in rows:  # a configuration's state writer and its gradient process, merged
        if r.get("role") == "ref" and r.get("status") == "ok":
            got = out.setdefault(r["config"], {k: None for k in keys})
            for k in keys:
                if isinstance(r.get(k), dict) and isinstance(got[k], dict):
                    got[k] = {**got[k], **r[k]}
                elif r.get(k) is not None:
                    got[k] = r[k]
    return out


# ---------------------------------------------------------------------------- training runs
def read_train_log(path: str) -> dict:
    """A training run's ``log.jsonl`` as curves: train loss per step, validation
    loss where it ran, step seconds, fp8 fallbacks and rejected steps.

    >>> import tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "log.jsonl")
    >>> with open(p, "w") as f:
    ...     _ = f.write('{"step": 0, "val_loss": 5.5}\\n{"step": 1, "loss": 5.0, "fp8_step_rejected": 1.0}\\n')
    >>> c = read_train_log(p)
    >>> c["steps"], c["loss"], c["val_steps"], c["rejected_steps"]
    ([1], [5.0], [0], 1)
    """
    out = {"steps": [], "loss": [], "val_steps": [], "val_loss": [], "step_seconds": [], "fp8_fallbacks": None,
           "rejected_steps": 0, "log": path}
    if not os.path.exists(path):
        out["error"] = "no log.jsonl (the run did not reach its first step)"
        return out
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a stop
            step = rec.get("step")
            if not isinstance(step, int):
                continue
            if isinstance(rec.get("loss"), (int, float)):
                out["steps"].append(step)
                out["loss"].append(float(rec["loss"]))
                if isinstance(rec.get("step_seconds"), (int, float)):
                    out["step_seconds"].append(float(rec["step_seconds"]))
            if isinstance(rec.get("val_loss"), (int, float)):
                out["val_steps"].append(step)
                out["val_loss"].append(float(rec["val_loss"]))
            if rec.get("fp8_fallbacks") is not None:
                out["fp8_fallbacks"] = rec["fp8_fallbacks"]
            if rec.get("fp8_step_rejected"):
                out["rejected_steps"] += 1
    return out


def train_summary(train: Optional[dict], tail: int = 20) -> Optional[dict]:
    """Final losses (mean of the last ``tail`` common steps), their relative
    difference, the validation losses at common steps.

    >>> t = {"runs": {"bf16": {"steps": [1, 2, 3], "loss": [3.0, 2.0, 1.0], "val_steps": [0, 3],
    ...                        "val_loss": [4.0, 1.5]},
    ...               "fp8_e4m3": {"steps": [1, 2], "loss": [3.0, 2.2], "val_steps": [0], "val_loss": [4.0]}}}
    >>> s = train_summary(t, tail=1)
    >>> s["common_steps"], s["final_bf16"], s["final_fp8"], round(s["rel_diff"], 3), s["val"]
    (2, 2.0, 2.2, 0.1, [[0, 4.0, 4.0]])
    """
    if not train or "runs" not in train:
        return None
    b, f = train["runs"].get("bf16", {}), train["runs"].get("fp8_e4m3", {})
    common = sorted(set(b.get("steps", [])) & set(f.get("steps", [])))
    out = {"common_steps": len(common), "tail": min(tail, len(common))}
    if common:
        last = common[-out["tail"]:]
        lb = float(np.mean([b["loss"][b["steps"].index(s)] for s in last]))
        lf = float(np.mean([f["loss"][f["steps"].index(s)] for s in last]))
        out.update(final_bf16=lb, final_fp8=lf, rel_diff=(lf - lb) / lb)
    vb = dict(zip(b.get("val_steps", []), b.get("val_loss", [])))
    vf = dict(zip(f.get("val_steps", []), f.get("val_loss", [])))
    out["val"] = [[s, vb[s], vf[s]] for s in sorted(set(vb) & set(vf))]
    return out


def plot_train(out_dir: str, train: Optional[dict]) -> Optional[str]:
    """``fp8_train_curves.png``: train and validation loss of both runs against step."""
    if not train or "runs" not in train:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # the JSON still holds the curves
        print(f"[fp8] no chart: matplotlib unavailable ({err})", flush=True)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, style in (("bf16", "-"), ("fp8_e4m3", "--")):
        run = train["runs"].get(dtype, {})
        axes[0].plot(run.get("steps", []), run.get("loss", []), style, lw=1, label=dtype)
        axes[1].plot(run.get("val_steps", []), run.get("val_loss", []), style + "o", label=dtype)
    for ax, what in zip(axes, ("train loss (per step)", "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("eae-jax train --text (standard-library text): bf16 vs fp8_e4m3")
    fig.tight_layout()
    path = os.path.join(out_dir, "fp8_train_curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- text
def _ci(ci, fmt="{:.3f}") -> str:
    return "n/a" if not ci else f"[{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def _ratio_cells(r: dict) -> List[str]:
    return [f"{r['value']:.3f}", _ci(r["ci"]), r["verdict"] + (f" ({r['note']})" if r["note"] else "")]


def markdown(doc: dict) -> List[str]:
    """The tables of ``fp8_table.md`` (paste-ready for docs/benchmarks.md)."""
    meta = doc["meta"]
    md = [f"Command: `{' '.join(meta.get('argv', []))}` (XLA_FLAGS `{meta.get('xla_flags') or ''}`)", "",
          f"Versions: {meta.get('versions')}  ", f"GPU: {meta.get('gpu', {}).get('nvidia_smi', 'none')}  ",
          f"Processes per variant: {meta.get('args', {}).get('repeats')}, order seed {meta.get('args', {}).get('seed')}"
          f"; started {meta.get('started')}, {meta.get('wall_s', 0):.0f} s in all.", "", doc["method"], ""]
    for shape, e in doc["ffn"].items():
        s = e["shape"]
        md += [f"#### FFN {s['tokens']} x {s['dim']} x {s['ffn']} ({shape}-like), {e['processes']} processes", "",
               "| variant | forward ms | 95% CI | fwd+bwd ms | 95% CI | fwd cos vs bf16 |", "|---|---|---|---|---|---|"]
        for v, k in e["variants"].items():
            cos = (e.get("cos_fwd_vs_bf16") or {}).get(v)
            md.append(f"| {DOC.get(v, v)} | {k['fwd']['ms']:.3f} | {_ci(k['fwd']['ci'])} | {k['fb']['ms']:.3f} | "
                      f"{_ci(k['fb']['ci'])} | {'-' if cos is None else f'{cos:.5f}'} |")
        for v, why in (e.get("variant_errors") or {}).items():
            md.append(f"| {DOC.get(v, v)} | did not build: {why.splitlines()[0][:200]} | | | | |")
        md += ["", "| ratio | pass | value | 95% CI | verdict | reading |", "|---|---|---|---|---|---|"]
        for r in e["ratios"]:
            md.append(f"| {r['name'].split('/', 3)[-1]} | {KINDS[r['kind']]} | " + " | ".join(_ratio_cells(r))
                      + f" | {r['reading']} |")
        md.append("")
    for config, e in doc["step"].items():
        md += [f"#### Train step, {config}", "",
               "| variant | step ms | 95% CI | process medians | rejected steps | fp8 fallbacks | SM MHz min/med |",
               "|---|---|---|---|---|---|---|"]
        for v, x in e["variants"].items():
            c = x.get("clocks") or {}
            clk = f"{c['sm_mhz_min']:.0f}/{c['sm_mhz_median']:.0f}" if c.get("sm_mhz_median") else "-"
            md.append(f"| {DOC.get(v, v)} | {x['ms']:.1f} | {_ci(x['ci'], '{:.1f}')} | "
                      f"{' '.join(f'{m:.1f}' for m in x['process_medians'])} | {x['rejected_steps']} | "
                      f"{x['fallbacks']} | {clk} |")
        md += ["", "| ratio | value | 95% CI | verdict | reading |", "|---|---|---|---|---|"]
        for r in e["ratios"]:
            md.append(f"| {r['name'].split('/', 2)[-1]} | " + " | ".join(_ratio_cells(r)) + f" | {r['reading']} |")
        md.append("")
    if doc["cosines"]:
        md += ["#### Gradient agreement of one train step (same params, same tokens)", "",
               "| config | gradient | against | whole | smallest leaf | smallest layer | size-weighted |",
               "|---|---|---|---|---|---|---|"]
        for config, c in doc["cosines"].items():
            for what, against in (c.get("cosines") or {}).items():
                for ref in ("vs_bf16", "vs_f32"):
                    a = against.get(ref)
                    if a:
                        md.append(f"| {config} | {what} | {ref[3:]} | {a['global']:.6f} | {a['min_leaf']:.6f} "
                                  f"({min(a['per_leaf'], key=a['per_leaf'].get)}) | {a['min_layer']:.6f} | "
                                  f"{a['size_weighted']:.6f} |")
            if c.get("flax_error"):
                md.append(f"| {config} | flax-fp8 | - | Flax's reference step failed: "
                          f"{c['flax_error'].splitlines()[0][:200]} | | | |")
        md.append("")
    t = doc.get("train_summary")
    if t:
        runs = doc["train"]["runs"]
        md += ["#### Training on real text, bf16 vs fp8 (the two runs side by side)", "",
               f"`{runs['fp8_e4m3'].get('command')}` and the same with `--dtype bf16`: {t['common_steps']} common "
               f"steps" + (" (stopped at the deadline)" if any(r.get("stopped_at_deadline") for r in runs.values())
                           else "") + ". Curves: `fp8_train_curves.png`, `fp8_results.json` (`train`).", "",
               "| | bf16 | fp8_e4m3 |", "|---|---|---|"]
        if "final_bf16" in t:
            md.append(f"| train loss, mean of the last {t['tail']} steps | {t['final_bf16']:.4f} | "
                      f"{t['final_fp8']:.4f} ({100 * t['rel_diff']:+.2f}%) |")
        for s, vb, vf in t["val"]:
            md.append(f"| validation loss, step {s} | {vb:.4f} | {vf:.4f} |")
        md.append(f"| fp8 fallbacks / rejected steps | - | {runs['fp8_e4m3'].get('fp8_fallbacks')} / "
                  f"{runs['fp8_e4m3'].get('rejected_steps')} |")
        md.append("")
    elif doc.get("train"):
        md += [f"Training runs: {doc['train'].get('skipped', 'no result')}", ""]
    errs = br.errors_lines(doc["rows"])
    if errs:
        md += ["#### Not ok", "", "```"] + errs + ["```", ""]
    md += ["Notes:", ""] + [f"* {n}" for n in NOTES]
    return md


METHOD = ("Statistic: median over processes of each process's median (train step: per step; FFN: per call, a "
          "sample being `calls` calls dispatched back to back and synchronised once). 95% CI: the span of a "
          "two-level bootstrap and a t interval on the log process medians (Welch's for ratios), `bench_stats`. "
          "A ratio is a win or a loss only when its CI excludes 1, else a tie. Timed processes run one at a time in "
          "a seeded random order of rounds, after the fp8 state writers and before the gradient references; an "
          "FFN process visits its variants in its own random order of rounds. Clocks: nvidia-smi throughout (smi.csv.gz), per timing window in the JSON.")

NOTES = (
    "Ours runs the training command's fp8 configuration (TrainConfig defaults for --dtype fp8_e4m3: delayed "
    "activation, weight and gradient scales, weights cast to e4m3 once per step, the step guard: checks reduced "
    "in the graph, a failed step dropped by one cond on the update); '-u' is the same recipe with "
    "check_values=False and no cond. In the FFN rows 'guarded' is a lone seam's default guard: one lax.cond per "
    "call.",
    "Flax's recipe: per-tensor delayed scaling of input, kernel and output gradient from the maximum of a "
    "1024-step amax history, no margin, quantization in the compute dtype (bf16); ours: per-tensor delayed "
    "scales from the previous step's amax, 2 binades of gradient headroom, quantization in float32. Flax's "
    "variables are warmed on the same batch before any measurement (a fresh op scales by 1).",
    "Same params and joins on both sides: gate and up as one GEMM and q, k, v as one, joined inside the call from "
    "separate weights. Flax has no pre-cast mode: its pre-cast row is built from flax.linen.fp8_ops (in_q, "
    "quantized_dot, out_dq) with the kernel quantized before the call.",
    "Every variant of a train step runs the same step function (make_optimizer's AdamW, the same loss and "
    "reconstruct stack); only the block and its state handling differ. Params and tokens are the reference "
    "process's (same seed), so the fp8 states it wrote fit them.",
    "Every JAX process runs with the XLA_FLAGS in the command line above; the bf16 baselines too.",
    "The two training runs share the GPU, so their step times are not measurements; the train-step rows are.",
)


def summarize(rows: List[dict], meta: dict, train: Optional[dict]) -> dict:
    """The whole report of a campaign's rows: what ``fp8_results.json`` holds."""
    return {"format": 1, "meta": meta, "rows": rows, "ffn": ffn_summary(rows), "step": step_summary(rows),
            "cosines": cosine_summary(rows), "train": train, "train_summary": train_summary(train),
            "method": METHOD, "notes": list(NOTES)}


def load(path: str) -> dict:
    """`summarize` of a saved campaign (fp8_results.json or fp8_rows.json), recomputed from its rows."""
    try:
        with open(path) as f:
            doc = json.load(f)
        rows, meta, train = doc["rows"], doc["meta"], doc.get("train")
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"{path}: not an fp8_results.json / fp8_rows.json ({type(err).__name__}: {err})")
    return summarize(rows, meta, train)


def write_outputs(out_dir: str, rows: List[dict], meta: dict, train: Optional[dict], final: bool) -> str:
    """Write fp8_results.json and fp8_table.md (and, final, the chart); return the console report."""
    doc = summarize(rows, meta, train)
    br.atomic_write(os.path.join(out_dir, "fp8_results.json"), json.dumps(doc, indent=1, default=str))
    md = ["# fp8 campaign", ""] + markdown(doc)
    br.atomic_write(os.path.join(out_dir, "fp8_table.md"), "\n".join(md) + "\n")
    if final:
        plot_train(out_dir, train)
    return "\n".join(["", "=" * 100] + md)


def rerender(path: str, out: str) -> int:
    """Rewrite a campaign's report from its saved rows (fp8_results.json or fp8_rows.json)."""
    doc = load(path)
    os.makedirs(out, exist_ok=True)
    meta = {**doc["meta"], "rerendered": {"at": time.strftime("%Y-%m-%d %H:%M:%S")}}
    print(write_outputs(out, doc["rows"], meta, doc["train"], final=True))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit("usage: python experiments/bench_fp8_report.py RESULTS.json  (prints the markdown tables)")
    print("\n".join(markdown(load(sys.argv[1]))))
