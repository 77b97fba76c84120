"""Where the FFN seam's wall time goes beyond its kernels: idle gaps or slower kernels?

    python experiments/fp8_sustained_probe.py [--shape 8192,2048,5632] [--iters 20] [--copies 8]
        [--variants bf16,eae-castw-unguarded] [--out DIR]

`profile_fp8_seam.py` sums kernel time of one call run with a sync after
each; `bench_fp8.py` times calls back to back (pipelined) and ``--copies``
calls inside one jitted function. Those wall times exceed the kernel sums by
about 20-30% for bf16 and fp8 alike. Two explanations predict different
traces: the device idles between kernels (gaps in the timeline), or the
kernels themselves run longer when the device works without pause (lower
sustained clocks under the power cap). This probe traces each variant in
three modes and reports, per call, the wall time, the summed kernel time,
the idle time inside the traced span, and the mean duration of each of the
top kernels, so the modes can be compared kernel by kernel:

* ``isolated``: one call, sync, 20 ms pause, repeated (what the per-kernel
  profile measured);
* ``pipelined``: ``--iters`` calls dispatched back to back, one sync;
* ``graph``: ``--copies`` calls inside one jitted function (as
  ``bench_fp8.py --graph-copies``), dispatched back to back.

Run ``nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
--format=csv -lms 50`` beside it to see the clocks; the script prints the
wall-clock time of each mode's start and end for that log.

Output: a table and ``fp8_sustained_probe.json`` in ``--out`` (default
``$OUT`` or ``experiments/results``). On CPU the trace holds host events
only, so "kernel" there means XLA host ops and the idle column is not
meaningful; the script runs there for testing.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8 import repeated  # noqa: E402
from profile_fp8_seam import variants  # noqa: E402


def device_events(trace_dir: str) -> List[Dict[str, Any]]:
    """Complete ("X") events of the device processes of a profiler trace,
    each ``{'name', 'ts', 'dur', 'tid'}`` in microseconds; the host's XLA op
    events when the trace has no device process (CPU backend)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"no trace file under {trace_dir}")
    with gzip.open(files[0]) as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in procs.items() if "GPU" in n or "gpu" in n.lower()}
    use = gpu or set(procs)
    return [{"name": e.get("name", "?"), "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0)), "tid": e.get("tid")}
            for e in events if e.get("ph") == "X" and e.get("pid") in use and "ts" in e]


def timeline_stats(events: List[Dict[str, Any]], calls: int) -> Dict[str, Any]:
    """Per-call kernel time, idle time inside the traced span (the union of
    all kernels' intervals subtracted from first-start..last-end, so
    overlapping streams are not double counted), and per-kernel mean
    durations."""
    if not events:
        return {"busy_us": 0.0, "idle_us": 0.0, "span_us": 0.0, "kernels": []}
    ivs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    covered, cur_s, cur_e = 0.0, ivs[0][0], ivs[0][1]
    for s, e in ivs[1:]:
        if s > cur_e:
            covered += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    covered += cur_e - cur_s
    span = ivs[-1][1] - ivs[0][0]
    span = max(span, max(e for _, e in ivs) - ivs[0][0])
    by = collections.defaultdict(list)
    for e in events:
        by[e["name"]].append(e["dur"])
    kernels = sorted(((n, sum(d) / calls, len(d) / calls, statistics.mean(d)) for n, d in by.items()),
                     key=lambda r: -r[1])
    return {"busy_us": sum(e["dur"] for e in events) / calls, "covered_us": covered / calls,
            "span_us": span / calls, "idle_us": (span - covered) / calls, "kernels": kernels}


def traced(run: Callable[[], None], calls: int) -> Dict[str, Any]:
    tdir = tempfile.mkdtemp(prefix="eae_sustained_")
    try:
        start = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        jax.profiler.start_trace(tdir)
        t = time.perf_counter()
        run()
        wall = (time.perf_counter() - t) * 1e6
        jax.profiler.stop_trace()
        end = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        rec = timeline_stats(device_events(tdir), calls)
    finally:
        shutil.rmtree(tdir, ignore_errors=True)
    rec.update(start_utc=start, end_utc=end, traced_wall_us=wall / calls)
    return rec


def probe(name: str, fn: Callable, args: tuple, iters: int, copies: int, pause_s: float) -> Dict[str, Any]:
    """The three modes of one variant (see the module docstring)."""
    one = jax.jit(fn).lower(*args).compile()
    run_g, gargs = repeated(fn, args, 1, copies)
    graph = jax.jit(run_g).lower(*gargs).compile()
    for _ in range(3):
        jax.block_until_ready(one(*args))
        jax.block_until_ready(graph(*gargs))

    def isolated():
        for _ in range(iters):
            jax.block_until_ready(one(*args))
            time.sleep(pause_s)

    def pipelined():
        out = None
        for _ in range(iters):
            out = one(*args)
        jax.block_until_ready(out)

    def in_graph():
        out = None
        for _ in range(max(1, iters // copies)):
            out = graph(*gargs)
        jax.block_until_ready(out)

    # Untraced wall times first: tracing adds host work.
    def wall(run, calls):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t) * 1e6 / calls)
        return statistics.median(ts)

    g_calls = max(1, iters // copies) * copies
    rec = {"variant": name, "modes": {}}
    for mode, run, calls in (("isolated", isolated, iters), ("pipelined", pipelined, iters),
                             ("graph", in_graph, g_calls)):
        w = wall(run, calls)
        if mode == "isolated":
            w -= pause_s * 1e6
        t = traced(run, calls)
        t["wall_us"] = w
        rec["modes"][mode] = t
    return rec


def print_probe(rec: Dict[str, Any], top: int) -> None:
    print(f"\n== {rec['variant']} ==")
    print(f"{'mode':>10} {'wall us':>9} {'kernels us':>10} {'idle us':>8}  start..end (UTC)")
    for mode, m in rec["modes"].items():
        print(f"{mode:>10} {m['wall_us']:9.1f} {m['busy_us']:10.1f} {m['idle_us']:8.1f}  {m['start_utc']}..{m['end_utc']}")
    names = [k[0] for k in rec["modes"]["isolated"]["kernels"][:top]]
    print(f"  mean kernel duration (us): {'  '.join(f'{m:>9}' for m in rec['modes'])}  kernel")
    for n in names:
        cells = []
        for m in rec["modes"].values():
            d = {k[0]: k[3] for k in m["kernels"]}
            cells.append(f"{d[n]:9.1f}" if n in d else f"{'-':>9}")
        print(f"  {'':26}{'  '.join(cells)}  {n[:90]}")
    sys.stdout.flush()


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,2048,5632", help="tokens,dim,ffn")
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--pause-ms", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--variants", default="bf16,eae-castw-unguarded",
                    help="comma list of profile_fp8_seam.py variant names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    m, d, f = (int(v) for v in args.shape.split(","))
    if args.iters < 1 or args.copies < 1:
        ap.error("--iters and --copies must be >= 1")
    want = [v for v in args.variants.split(",") if v]
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    have = {name: (fwd, p, x) for name, fwd, _fb, p, x, _ct in variants(m, d, f)}
    unknown = [v for v in want if v not in have]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {sorted(have)}")
    results = {"shape": [m, d, f], "backend": jax.default_backend(), "jax": jax.__version__,
               "device": str(jax.devices()[0]), "runs": []}
    for v in want:
        fwd, p, x = have[v]
        rec = probe(v, fwd, (p, x), args.iters, args.copies, args.pause_ms / 1e3)
        for mrec in rec["modes"].values():
            mrec["kernels"] = mrec["kernels"][:30]
        results["runs"].append(rec)
        print_probe(rec, args.top)
        with open(os.path.join(out_dir, "fp8_sustained_probe.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
