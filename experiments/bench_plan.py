"""The schedule of a `bench_stack.py` campaign: which processes run, in which
order and batches, and how long that should take (numpy only).

Every variant runs in ``repeats`` processes; the timing order is ``repeats``
rounds, each a seeded random permutation of the variants. A group's
reference job comes first. Batches take the order as it is, smaller while
they hold a variant's first (cold) compile. Why: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
from typing import Dict, List, Optional

import numpy as np

import bench_common as bc

# Planning assumptions behind --estimate-only and the printed estimate (not
# measurements; the results' timeline holds what each phase took): seconds to
# start, compile and load a process, cold (first of its variant) and warm.
PREP_S = {"jax": (25.0, 8.0), "torch": (8.0, 8.0), "torch-compile": (75.0, 22.0), "ref": (55.0, 55.0)}
EXIT_S, CHECK_S, ASSUMED_TFLOPS = 2.0, 4.0, 350.0
# Step cost relative to a step that stores everything (recomputation).
RECOMPUTE = {"plain": 1.0, "compile": 1.0, "remat": 1.33, "ckpt": 1.33, "compile-ckpt": 1.33,
             "compile-budget": 1.15, "eae": 1.33, "eae-nosync": 1.4}


@dataclasses.dataclass
class Job:
    cfg: bc.StackConfig
    variant: str
    role: str  # "timed" or "ref"
    round: int
    order: int  # position in the timing order (-1 for a reference job)
    check: bool
    spec_path: str
    log_path: str
    proc: Optional[subprocess.Popen] = None
    lines: "queue.Queue[Optional[str]]" = dataclasses.field(default_factory=queue.Queue)
    state: str = "pending"  # pending | prep | ready | measuring | done
    started: float = 0.0
    ready_at: Optional[float] = None
    measure_started: Optional[float] = None
    result: Optional[dict] = None
    retried: bool = False

    @property
    def key(self) -> str:
        return f"{self.variant}@{self.cfg.name}" + (" (ref)" if self.role == "ref" else f" #{self.round}")

    @property
    def kind(self) -> str:
        return bc.VARIANTS[self.variant]["kind"]


def timing_order(units: List[tuple], repeats: int, seed: int) -> List[tuple]:
    """``repeats`` rounds, each a seeded random permutation of ``units``:
    ``[(round, unit), ...]`` in timing order.

    >>> [u for _, u in timing_order(["a", "b"], 2, seed=0)].count("a")
    2
    """
    rng = np.random.default_rng(seed)
    order = []
    for r in range(repeats):
        order += [(r, units[i]) for i in rng.permutation(len(units))]
    return order


def build_plan(args, groups: Dict[str, List[bc.StackConfig]], workdir: str, injections: Dict[str, str]):
    """``[(group, [Job...]), ...]``: per group its reference jobs, then its timed processes in order."""
    wanted = None if args.variants in (None, "", "default") else (
        list(bc.VARIANTS) if args.variants == "all" else args.variants.split(","))
    if wanted:
        bad = [v for v in wanted if v not in bc.VARIANTS]
        if bad:
            raise SystemExit(f"unknown variant(s) {bad}; known: {', '.join(bc.VARIANTS)}")
    save_hlo = set(filter(None, args.save_hlo.split(",")))
    plan = []
    for gname in args.configs.split(","):
        if gname not in groups:
            raise SystemExit(f"unknown config group {gname!r}; expected medium, deep or sweep")
        variants = list(wanted or bc.DEFAULT_VARIANTS[gname])
        if wanted and gname == "sweep":
            variants = [v for v in wanted if v in bc.DEFAULT_VARIANTS["sweep"]] or bc.DEFAULT_VARIANTS["sweep"]
        units = [(cfg, v) for cfg in groups[gname] for v in variants]
        jobs: List[Job] = []

        def job(cfg, v, role, rnd, order, check):
            tag = f"{cfg.name}__{v}__{role}{rnd}"
            spec = {"variant": v, "config": dataclasses.asdict(cfg), "workdir": workdir, "steps": args.steps,
                    "warmup": args.warmup, "role": role, "check": check, "round": rnd,
                    "inject": (injections.get(f"{v}@{cfg.name}#{rnd}") or injections.get(f"{v}@{cfg.name}")
                               if role == "timed" else None),
                    "require_gpu": not args.smoke, "sdpa_backend": args.sdpa_backend}
            if role == "timed" and check and v in save_hlo and gname == "medium":
                spec["save_hlo"] = os.path.join(workdir, "hlo", f"{cfg.name}__{v}.hlo.txt")
            path = os.path.join(workdir, "specs", tag + ".json")
            with open(path, "w") as f:
                json.dump(spec, f)
            return Job(cfg, v, role, rnd, order, check, path, os.path.join(workdir, "logs", tag + ".log"))

        if args.reference:
            jobs += [job(cfg, "J-plain", "ref", 0, -1, False) for cfg in groups[gname]]
        seen = set()
        for i, (rnd, (cfg, v)) in enumerate(timing_order(units, args.repeats, args.seed)):
            jobs.append(job(cfg, v, "timed", rnd, i, (cfg.name, v) not in seen))
            seen.add((cfg.name, v))
        plan.append((gname, jobs))
    return plan


def _cold(job: Job, compiled: set) -> bool:
    return job.role == "ref" or (job.variant, job.cfg.name) not in compiled


def next_batch(pending: List[Job], compiled: set, cold_cap: int, warm_cap: int) -> List[Job]:
    """Take the next batch off the front of ``pending``, in order: at most
    ``cold_cap`` processes while it holds one whose variant no earlier batch
    compiled (a cold compile, or a reference job), else at most ``warm_cap``
    (processes served by the compile caches need less time and memory).
    Adds the batch's variants to ``compiled``.
    """
    batch: List[Job] = []
    has_cold = False
    while pending:
        cold = _cold(pending[0], compiled)
        if batch and len(batch) >= (cold_cap if (has_cold or cold) else warm_cap):
            break
        batch.append(pending.pop(0))
        has_cold = has_cold or cold
    compiled |= {(j.variant, j.cfg.name) for j in batch}
    return batch


def estimate(plan, args) -> dict:
    """Seconds each phase should take under the planning assumptions above."""
    prep = timing = 0.0
    batches = 0
    for _, jobs in plan:
        pending, compiled = list(jobs), set()
        while pending:
            cold = {(j.variant, j.cfg.name) for j in pending if _cold(j, compiled)}
            batch = next_batch(pending, compiled, args.jobs, args.warm_jobs)
            batches += 1
            costs = []
            for j in batch:
                mode = bc.VARIANTS[j.variant]["mode"]
                kind = "ref" if j.role == "ref" else ("torch-compile" if mode.startswith("compile") else j.kind)
                costs.append(PREP_S[kind][0 if j.role == "ref" or (j.variant, j.cfg.name) in cold else 1])
                if j.role == "timed":
                    step = j.cfg.model_flops() * RECOMPUTE.get(mode, 1.33) / (ASSUMED_TFLOPS * 1e12)
                    timing += EXIT_S + (args.warmup + args.steps) * step + (CHECK_S if j.check else 0.0)
            prep += max(costs)
    return {"prep_s": prep, "timing_s": timing, "startup_s": 20.0, "report_s": 10.0, "batches": batches,
            "total_s": prep + timing + 30.0, "assumptions": {"prep_s": PREP_S, "exit_s": EXIT_S, "check_s": CHECK_S,
                                                             "tflops": ASSUMED_TFLOPS, "recompute": RECOMPUTE}}


def parse_injections(text: str) -> Dict[str, str]:
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, _, what = item.partition(":")
        if what not in ("raise", "hang", "oom"):
            raise SystemExit(f"--inject-failure items are VARIANT@CONFIG[#ROUND]:raise|hang|oom, got {item!r}")
        out[key] = what
    return out
