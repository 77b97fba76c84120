"""The tables of docs/benchmarks.md, computed from the checked-in results files.

A page marks each generated table with a comment naming what to render and
from which results file (a path relative to the repository root)::

    <!-- table: ratios experiments/results/h100/RUN/bench_results.json -->
    ...the table...
    <!-- end table -->

Kinds: ``variants`` and ``ratios`` (a stack campaign's ``bench_results.json``:
per-variant medians with their 95% intervals; every ratio with its interval
and verdict), ``before-after`` (two ``bench_results.json`` joined by ``,``:
``BEFORE,AFTER``; each variant both measured, after / before, with its
interval), ``fp8`` (an fp8 campaign's ``fp8_results.json``:
`bench_fp8_report.markdown`'s tables).

``--write PAGE`` fills every marked table of the page from its file,
``--check PAGE`` exits 1 naming each table that differs from what its file
gives (tests/test_docs.py runs it on docs/benchmarks.md), ``--print KIND
PATH`` prints one table. numpy and scipy; no JAX.

Usage::

    python experiments/bench_docs_tables.py --write docs/benchmarks.md
    python experiments/bench_docs_tables.py --check docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_fp8_report as fr  # noqa: E402
import bench_report as br  # noqa: E402

KINDS = ("variants", "ratios", "before-after", "fp8")
MARK = re.compile(r"^<!-- table: (\S+) (\S+) -->\n(.*?)^<!-- end table -->$", re.S | re.M)


def _load(path: str) -> dict:
    full = os.path.join(REPO, path)
    try:
        with open(full) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise SystemExit(f"{path}: cannot read a results file ({type(err).__name__}: {err})")


def _ci(ci, fmt: str) -> str:
    return "n/a" if not ci or ci[0] is None else f"[{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2 ** 30:.3f}"


def _table(head: List[str], body: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def variants_table(doc: dict) -> List[str]:
    """Per variant: processes ok, median step ms with its 95% interval, peak and pool GiB, MFU, error vs f32.

    >>> doc = {"aggregate": [{"variant": "eae", "processes": 3, "processes_ok": 3, "step_ms": 98.03,
    ...        "step_ms_ci": [95.3, 101.17], "peak_bytes": 2 ** 30, "peak_reserved_bytes": None,
    ...        "mfu_pct": 40.0}]}
    >>> variants_table(doc)[2]
    '| eae | 3/3 | 98.03 | [95.30, 101.17] | 1.000 | - | 40.0 | - |'
    """
    body = []
    for e in doc["aggregate"]:
        ok = e.get("processes_ok", 0) > 0
        err = e.get("grad_rel_err_vs_f32")
        body.append([e["variant"], f"{e.get('processes_ok', 0)}/{e['processes']}",
                     f"{e['step_ms']:.2f}" if ok else "-", _ci(e.get("step_ms_ci"), "{:.2f}") if ok else "-",
                     _gib(e.get("peak_bytes")) if ok else "-", _gib(e.get("peak_reserved_bytes")) if ok else "-",
                     f"{e['mfu_pct']:.1f}" if ok else "-", "-" if err is None else f"{err:.2e}"])
    return _table(["variant", "ok", "step ms", "95% CI", "peak GiB", "pool GiB", "MFU %", "grad err vs f32"], body)


def ratios_table(doc: dict) -> List[str]:
    """Every ratio of the run with its 95% interval and verdict (win or loss only where the interval excludes 1).

    >>> doc = {"ratios": [{"name": "T-compile / eae", "kind": "time", "value": 0.829, "ci": [0.804, 0.853],
    ...        "verdict": "loss", "reading": "step time; above 1: eae faster"}]}
    >>> ratios_table(doc)[2]
    '| T-compile / eae | time | 0.829 | [0.804, 0.853] | **loss** | step time; above 1: eae faster |'
    """
    body = []
    for r in doc["ratios"]:
        verdict = f"**{r['verdict']}**" if r["verdict"] == "loss" else r["verdict"]
        body.append([r["name"], r["kind"], "n/a" if r["value"] is None else f"{r['value']:.3f}",
                     _ci(r.get("ci"), "{:.3f}"), verdict,
                     r["reading"] + (f" ({r['note']})" if r.get("note") else "")])
    return _table(["ratio", "kind", "value", "95% CI", "verdict", "reading"], body)


def before_after_table(before: dict, after: dict) -> List[str]:
    """After / before for each variant both runs measured: step time and peak, with intervals and verdicts
    (below 1: the later library is faster or smaller)."""
    agg_b = br.aggregate(before["rows"])
    agg_a = br.aggregate(after["rows"])
    body = []
    for config in dict.fromkeys(e["config"] for e in agg_a):
        b, a = br._by(agg_b, config), br._by(agg_a, config)
        for v in [v for v in a if v in b]:
            for kind, what in (("time", "step time"), ("peak", "peak allocated"), ("pool", "allocator pool")):
                r = br._ratio_entry(config, f"{v} after / before", kind, a[v], b[v], False, what)
                body.append([v, kind, "n/a" if r["value"] is None else f"{r['value']:.3f}",
                             _ci(r.get("ci"), "{:.3f}"), f"**{r['verdict']}**" if r["verdict"] == "loss"
                             else r["verdict"], f"{what}; below 1: after is lower" + (
                                 f" ({r['note']})" if r.get("note") else "")])
    return _table(["variant", "kind", "after / before", "95% CI", "verdict", "reading"], body)


def render(kind: str, path: str) -> List[str]:
    """The lines of one table (``kind``, ``path`` as in a page's marker)."""
    if kind == "variants":
        return variants_table(_load(path))
    if kind == "ratios":
        return ratios_table(_load(path))
    if kind == "before-after":
        parts = path.split(",")
        if len(parts) != 2:
            raise SystemExit(f"before-after needs BEFORE,AFTER (two results files), got {path!r}")
        return before_after_table(_load(parts[0]), _load(parts[1]))
    if kind == "fp8":
        _load(path)  # a clear error for a missing or unreadable file
        return fr.markdown(fr.load(os.path.join(REPO, path)))
    raise SystemExit(f"unknown table kind {kind!r}; expected one of {', '.join(KINDS)}")


def tables(text: str) -> List[Tuple[str, str, str]]:
    """``(kind, path, current body)`` of every marked table of a page."""
    return [(m.group(1), m.group(2), m.group(3)) for m in MARK.finditer(text)]


def fill(text: str) -> str:
    """The page with every marked table rendered from its file."""
    return MARK.sub(lambda m: f"<!-- table: {m.group(1)} {m.group(2)} -->\n"
                    + "\n".join(render(m.group(1), m.group(2))) + "\n<!-- end table -->", text)


def stale(text: str) -> Dict[str, str]:
    """``{'KIND PATH': why}`` for each marked table whose body is not what its file gives."""
    out = {}
    for kind, path, body in tables(text):
        want = "\n".join(render(kind, path)) + "\n"
        if body != want:
            out[f"{kind} {path}"] = "differs from its results file (run --write)"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="PAGE", help="fill the page's marked tables from their files")
    g.add_argument("--check", metavar="PAGE", help="exit 1 if a marked table differs from its file")
    g.add_argument("--print", nargs=2, metavar=("KIND", "PATH"), help="print one table")
    args = p.parse_args(argv)
    if args.print:
        print("\n".join(render(*args.print)))
        return 0
    page = args.write or args.check
    with open(page) as f:
        text = f.read()
    if not tables(text):
        print(f"{page}: no marked tables", file=sys.stderr)
        return 1
    if args.write:
        br.atomic_write(page, fill(text))
        return 0
    bad = stale(text)
    for name, why in bad.items():
        print(f"{page}: table {name}: {why}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
