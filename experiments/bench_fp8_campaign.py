"""fp8 against bf16 and against Flax's fp8 ops, in one device call: a campaign
with the stack benchmark's protocol (`bench_stack.py`).

Sections (``--sections``, default ``ffn,step``: what fits one device call of
600 s with the medium step and its gradient references; ``--configs
medium,7b`` and ``train`` add the rest when there is time):

* ``ffn``: the SwiGLU FFN at the 1B-like (8192 x 2048 x 5632) and 7B-like
  (8192 x 4096 x 11008) shapes: bf16; ours with the weights cast to fp8
  inside the timed call and cast beforehand, each guarded (the lone seam's
  default: one lax.cond per call) and unguarded; Flax's
  `Fp8DirectDotGeneralOp` and `Fp8Einsum` (which quantize the kernel in
  every call); Flax's own pieces with the kernel quantized beforehand.
  Forward and forward + backward.
* ``step``: a whole LM train step (embedding, blocks, head, cross-entropy,
  AdamW) of the ``medium`` and ``7b-like`` presets of the training command:
  bf16; ours as ``eae-jax train --dtype fp8_e4m3`` runs it (step guard) and
  unguarded; Flax's fp8 ops in the same LLaMA block. Per configuration, a
  reference process writes the fp8 states the timed processes start from,
  and another, after them, compares the gradients of one step with the
  bf16 and float32 ones (cosines per leaf, smallest, weighted).
* ``train``: ``eae-jax train --preset medium --text`` in bf16 and in
  fp8_e4m3, side by side (loss curves; the two run at the same time, so
  their step times are not a measurement).

Protocol (docs/benchmarks.md): every timed process in a seeded random
order of ``--repeats`` rounds, prepared in parallel batches and timed one
at a time, nothing else running (`bench_stack.Runner`); the state writers
run alone before the first batch (compiling beside it they outran its prep
timeout), the gradient references run after the last timed process;
nvidia-smi logged throughout (`bench_stack.SmiLogger`); medians over
processes with 95% intervals and verdicts (`bench_stats`). An FFN process
times every variant of its shape, in its own random order of rounds. Per-step
times are saved. ``--deadline-s`` bounds the whole campaign: no batch or
process starts past it, the training runs are stopped at it, and every
result so far is kept (``fp8_rows.json`` after every process).

Usage (GPU; ``--estimate-only`` prints the schedule and its time estimate)::

    PYTHONUNBUFFERED=1 python experiments/bench_fp8_campaign.py --deadline-s 540 --out $OUT

Smoke (CPU, tiny sizes)::

    python experiments/bench_fp8_campaign.py --smoke --out /tmp/fp8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_fp8_report as fr  # noqa: E402
import bench_plan as bp  # noqa: E402
import bench_report as br  # noqa: E402
import bench_stack as bst  # noqa: E402

SECTIONS = ("ffn", "step", "train")


@dataclasses.dataclass(frozen=True)
class FFNShape:
    """An FFN shape: tokens x dim x SwiGLU width."""

    name: str
    tokens: int
    dim: int
    ffn: int

    @property
    def family(self) -> str:
        return f"ffn_{self.tokens}x{self.dim}x{self.ffn}"


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """A train-step configuration: a training-command preset."""

    name: str
    preset: str

    @property
    def family(self) -> str:
        return f"lm_{self.preset}"


FFN_SHAPES = {"1b": FFNShape("1b", 8192, 2048, 5632), "7b": FFNShape("7b", 8192, 4096, 11008)}
STEP_SETUPS = {"medium": StepSetup("medium", "medium"), "7b": StepSetup("7b", "7b-like")}
SMOKE_FFN = {"1b": FFNShape("1b", 256, 64, 128), "7b": FFNShape("7b", 256, 64, 192)}
STEP_VARIANTS = ("bf16", "eae-fp8", "eae-fp8-u", "flax-fp8")
FFN_VARIANTS = ("bf16", "eae-in", "eae-in-u", "eae-pre", "eae-pre-u", "flax-direct", "flax-einsum", "flax-pre")


class Job(bp.Job):
    """A campaign process; every one runs `bench_fp8_child.py` (JAX)."""

    @property
    def kind(self) -> str:
        return "jax"


class Runner(bst.Runner):
    """`bench_stack.Runner` (batches, READY/GO, timeouts, deadline) running `bench_fp8_child.py`."""

    def child_script(self, job) -> str:
        return os.path.join(HERE, "bench_fp8_child.py")


def say(msg: str) -> None:
    print(f"[fp8 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- plan
def build_plan(args, workdir: str):
    """``(ref jobs, timed jobs in timing order, gradient jobs)``: the refs write
    the fp8 states the timed processes wait for; the gradient jobs (cosines
    against bf16 and float32) run last, holding nothing up."""
    shapes = SMOKE_FFN if args.smoke else FFN_SHAPES
    ffn = [shapes[s] for s in args.ffn_shapes] if "ffn" in args.sections else []
    steps = [STEP_SETUPS[c] for c in args.configs] if "step" in args.sections else []

    def job(cfg, variant, role, rnd, order):
        tag = f"{cfg.name}__{variant}__{role}{rnd}"
        spec = {"variant": variant, "role": role, "round": rnd, "config": cfg.name, "workdir": workdir,
                "smoke": args.smoke, "require_gpu": not args.smoke, "seed": args.data_seed,
                "inject": args.inject.get(f"{variant}@{cfg.name}") if role == "timed" else None}
        if isinstance(cfg, FFNShape):
            spec.update(shape=[cfg.tokens, cfg.dim, cfg.ffn], variants=list(args.ffn_variants),
                        rounds=args.ffn_rounds, batches=args.ffn_batches, calls=args.ffn_calls,
                        warm_calls=args.ffn_warm_calls, order_seed=args.seed * 1000 + 17 * rnd + len(cfg.name))
        else:
            spec.update(preset=cfg.preset, steps=args.steps, warmup=args.warmup, flax_warmup=1,
                        state_timeout_s=args.prep_timeout_s)
        path = os.path.join(workdir, "specs", tag + ".json")
        with open(path, "w") as f:
            json.dump(spec, f)
        return Job(cfg, variant, role, rnd, order, False, path, os.path.join(workdir, "logs", tag + ".log"))

    refs = [job(c, "ref", "ref", 0, -1) for c in steps]
    units = [(c, "ffn") for c in ffn] + [(c, v) for c in steps for v in args.step_variants]
    timed = [job(c, v, "timed", rnd, i) for i, (rnd, (c, v)) in
             enumerate(bp.timing_order(units, args.repeats, args.seed))]
    grads = [job(c, "grads", "ref", 0, -1) for c in steps]
    return refs, timed, grads


#: Planning assumptions of the printed estimate (seconds; not measurements:
#: the results' timeline holds what each phase took).
ASSUME = {"startup": 20.0, "ref": {"medium": 140.0, "7b": 200.0}, "grads": {"medium": 200.0, "7b": 260.0}, "prep_cold": 45.0, "prep_warm": 15.0,
          "ffn_call_ms": {"1b": 1.5, "7b": 5.0}, "step_ms": {"medium": 110.0, "7b": 200.0}, "process": 1.5,
          "train_setup": 60.0, "train_pair_step": 0.2, "train_end": 15.0, "report": 10.0}


def estimate(args, refs, timed, grads=()) -> dict:
    """Seconds each phase should take under `ASSUME`."""
    if args.smoke:
        return {"total_s": 0.0, "note": "smoke: no estimate"}
    ref = max([ASSUME["ref"][j.cfg.name] for j in refs] or [0.0])
    pending, compiled, prep = list(timed), set(), 0.0
    while pending:  # the state writers run alone before these batches (counted apart)
        cold = any((j.variant, j.cfg.name) not in compiled for j in pending[:args.jobs])
        bp.next_batch(pending, compiled, args.jobs, args.warm_jobs)
        prep += ASSUME["prep_cold"] if cold else ASSUME["prep_warm"]
    timing = 0.0
    for j in timed:
        if j.variant == "ffn":
            calls = 2 * args.ffn_rounds * (args.ffn_warm_calls + args.ffn_batches * args.ffn_calls)
            timing += len(args.ffn_variants) * calls * ASSUME["ffn_call_ms"][j.cfg.name] / 1e3
        else:
            timing += (args.warmup + args.steps) * ASSUME["step_ms"][j.cfg.name] / 1e3
        timing += ASSUME["process"]
    train = (ASSUME["train_setup"] + args.train_steps * ASSUME["train_pair_step"] + ASSUME["train_end"]
             if "train" in args.sections else 0.0)
    cosines = max([ASSUME["grads"][j.cfg.name] for j in grads] or [0.0])
    total = ASSUME["startup"] + ref + prep + timing + cosines + train + ASSUME["report"]
    return {"ref_s": ref, "prep_s": prep, "timing_s": timing, "grads_s": cosines, "train_s": train, "total_s": total,
            "assumptions": ASSUME}


# ---------------------------------------------------------------------------- training runs
def train_commands(args, workdir: str) -> Dict[str, List[str]]:
    """The two ``eae-jax train`` runs: bf16 and fp8_e4m3, everything else equal."""
    common = ["--text", "--steps", str(args.train_steps), "--log-every", "1", "--val-every",
              str(args.train_val_every), "--val-batches", "2", "--checkpoint-every", str(args.train_steps),
              "--keep", "1", "--seed", "0", "--quiet", "--no-plot", "--no-tensorboard"]
    common += ["--preset", "tiny"] if args.smoke else ["--preset", "medium"]
    return {dtype: [sys.executable, "-m", "eae_jax.train", *common, "--dtype", dtype,
                    "--out", os.path.join(workdir, "train", dtype)] for dtype in ("bf16", "fp8_e4m3")}


def run_training(args, workdir: str, env: dict, limit_s: float) -> dict:
    """Both training runs at once, stopped after ``limit_s``; their logs read back."""
    cmds = train_commands(args, workdir)
    procs, logs = {}, {}
    t0 = time.time()
    for dtype, cmd in cmds.items():
        os.makedirs(os.path.dirname(cmd[-1]), exist_ok=True)
        logs[dtype] = os.path.join(workdir, "logs", f"train_{dtype}.log")
        with open(logs[dtype], "w") as log:
            procs[dtype] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=bst.REPO)
    stopped = []
    while any(p.poll() is None for p in procs.values()):
        if time.time() - t0 > limit_s:
            for dtype, p in procs.items():
                if p.poll() is None:
                    p.terminate()  # our own child, by its handle; its log so far is kept
                    stopped.append(dtype)
            for p in procs.values():
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
            break
        time.sleep(0.5)
    runs = {}
    for dtype, cmd in cmds.items():
        runs[dtype] = fr.read_train_log(os.path.join(cmd[-1], "log.jsonl"))
        runs[dtype].update(command=" ".join(["eae-jax", "train"] + cmd[3:]), returncode=procs[dtype].returncode,
                           stopped_at_deadline=dtype in stopped, log_tail=bst._log_tail(logs[dtype], 15))
    return {"runs": runs, "wall_s": time.time() - t0, "limit_s": limit_s, "concurrent": True}


# ---------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    p.add_argument("--sections", default="ffn,step", help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--ffn-shapes", default=None, help="comma list of 1b, 7b (default both; smoke 1b)")
    p.add_argument("--ffn-variants", default=",".join(FFN_VARIANTS), help="comma list (bf16 first)")
    p.add_argument("--configs", default=None,
                   help="train-step configurations: comma list of medium, 7b (default medium)")
    p.add_argument("--step-variants", default=",".join(STEP_VARIANTS), help="comma list")
    p.add_argument("--repeats", type=int, default=None, help="processes per variant (default 3; smoke 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the timing orders")
    p.add_argument("--data-seed", type=int, default=0, help="seed of params and tokens")
    p.add_argument("--steps", type=int, default=None, help="timed train steps per process (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per process (default 2; smoke 1)")
    p.add_argument("--ffn-rounds", type=int, default=None, help="rounds per FFN process (default 3; smoke 2)")
    p.add_argument("--ffn-batches", type=int, default=None, help="samples per visit (default 3; smoke 2)")
    p.add_argument("--ffn-calls", type=int, default=None, help="calls per sample (default 8; smoke 2)")
    p.add_argument("--ffn-warm-calls", type=int, default=None, help="untimed calls per visit (default 2; smoke 1)")
    p.add_argument("--train-steps", type=int, default=None, help="steps of each training run (default 250; smoke 6)")
    p.add_argument("--train-val-every", type=int, default=None, help="validation every N steps (default 50)")
    p.add_argument("--xla-flags", default=None,
                   help="appended to XLA_FLAGS for every process, the bf16 baselines too (default none)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"),
                   help="where the results go (default $OUT, else experiments/results)")
    p.add_argument("--workdir", default=None, help="scratch for specs, states, caches, logs (default a temp dir)")
    p.add_argument("--jobs", type=int, default=None, help="processes preparing at once, cold (default 8; smoke 2)")
    p.add_argument("--warm-jobs", type=int, default=None, help="... once compiled (default 12; smoke 2)")
    p.add_argument("--deadline-s", type=float, default=None, help="whole-campaign budget (default 540; smoke 900)")
    p.add_argument("--reserve-s", type=float, default=None, help="kept for the report at the end")
    p.add_argument("--min-batch-s", type=float, default=None, help="no batch starts with less time left")
    p.add_argument("--min-train-s", type=float, default=None, help="no training run starts with less time left")
    p.add_argument("--prep-timeout-s", type=float, default=None, help="per-process limit to set up (default 300)")
    p.add_argument("--measure-timeout-s", type=float, default=None, help="per-process limit to time (default 120)")
    p.add_argument("--smi-interval-ms", type=int, default=200, help="nvidia-smi sampling period")
    p.add_argument("--inject-failure", default="", help="testing aid: VARIANT@CONFIG:raise,... fails those processes")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false")
    p.add_argument("--estimate-only", action="store_true", help="print the schedule and its estimate, run nothing")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--report-from", default=None, metavar="JSON",
                   help="measure nothing: re-render fp8_results.json (or fp8_rows.json) into --out")
    args = p.parse_args(argv)
    smoke = args.smoke

    def pick(name, full, small):
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else full)

    for name, full, small in (("repeats", 3, 2), ("steps", 10, 2), ("warmup", 2, 1), ("ffn_rounds", 3, 2),
                              ("ffn_batches", 3, 2), ("ffn_calls", 8, 2), ("ffn_warm_calls", 2, 1),
                              ("train_steps", 250, 6), ("train_val_every", 50, 3), ("jobs", 8, 2),
                              ("warm_jobs", 12, 2), ("deadline_s", 540.0, 900.0), ("reserve_s", 15.0, 5.0),
                              ("min_batch_s", 40.0, 5.0), ("min_train_s", 90.0, 5.0),
                              ("prep_timeout_s", 300.0, 300.0), ("measure_timeout_s", 120.0, 120.0),
                              ("xla_flags", "", ""), ("ffn_shapes", "1b,7b", "1b"),
                              ("configs", "medium", "medium")):
        pick(name, full, small)
    args.sections = _listed(p, "--sections", args.sections, SECTIONS)
    args.ffn_shapes = _listed(p, "--ffn-shapes", args.ffn_shapes, tuple(FFN_SHAPES))
    args.ffn_variants = _listed(p, "--ffn-variants", args.ffn_variants, FFN_VARIANTS)
    args.configs = _listed(p, "--configs", args.configs, tuple(STEP_SETUPS))
    args.step_variants = _listed(p, "--step-variants", args.step_variants, STEP_VARIANTS)
    if args.ffn_variants[0] != "bf16":
        p.error("--ffn-variants must start with bf16 (every ratio is against it)")
    if "bf16" not in args.step_variants:
        p.error("--step-variants must include bf16 (every ratio is against it)")
    if min(args.repeats, args.steps, args.ffn_rounds, args.ffn_batches, args.ffn_calls, args.jobs,
           args.warm_jobs, args.train_steps, args.train_val_every) < 1 or min(args.warmup, args.ffn_warm_calls) < 0:
        p.error("counts must be >= 1 (--warmup, --ffn-warm-calls >= 0)")
    args.inject = {}
    for item in filter(None, args.inject_failure.split(",")):
        key, _, what = item.partition(":")
        if what != "raise":
            p.error(f"--inject-failure items are VARIANT@CONFIG:raise, got {item!r}")
        args.inject[key] = what
    return args


def _listed(p, flag, text, valid):
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in valid]
    if bad or not items:
        p.error(f"{flag}: unknown {bad or 'empty list'}; expected a comma list of {', '.join(valid)}")
    return items


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_from:
        return fr.rerender(args.report_from, args.out)
    workdir = args.workdir or tempfile.mkdtemp(prefix="eae_fp8_")
    for sub in ("specs", "logs", "state"):
        os.makedirs(os.path.join(workdir, sub), exist_ok=True)
    refs, timed, grads = build_plan(args, workdir)
    est = estimate(args, refs, timed, grads)
    order = [{"order": j.order, "round": j.round, "config": j.cfg.name, "variant": j.variant} for j in timed]
    say("timing order (seed %d): %s" % (args.seed, ", ".join(f"{o['variant']}@{o['config']}#{o['round']}"
                                                           for o in order)))
    if not args.smoke:
        say(f"estimate: refs {est['ref_s']:.0f}s, prepare {est['prep_s']:.0f}s, timing {est['timing_s']:.0f}s, "
            f"gradients {est['grads_s']:.0f}s, training {est['train_s']:.0f}s: {est['total_s']:.0f}s in all (deadline {args.deadline_s:.0f}s; "
            "planning assumptions, see the timeline for what each phase took)")
    if args.estimate_only:
        return 0
    os.makedirs(args.out, exist_ok=True)
    runner = Runner(args, workdir)
    flags = " ".join(filter(None, [runner.env.get("XLA_FLAGS", ""), args.xla_flags]))
    if flags:
        runner.env["XLA_FLAGS"] = flags
    if args.smoke:  # the smoke checks that everything runs, not its speed: compiles a third as long
        runner.env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    smi = bst.SmiLogger(args.out, args.smi_interval_ms)
    meta = {"argv": sys.argv, "args": {k: v for k, v in vars(args).items() if k != "inject"},
            "timing_order": order, "estimate": est, "versions": bst._versions(), "gpu": bst._gpu_info(),
            "xla_flags": flags, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "started_epoch": runner.t0}
    for pkg in ("flax", "optax"):
        try:
            from importlib import metadata

            meta["versions"][pkg] = metadata.version(pkg)
        except Exception:  # informational
            pass
    meta["smi"] = smi.start()
    say(f"versions {meta['versions']}, XLA_FLAGS {flags!r}")
    train: Optional[dict] = None

    def write(final=False):
        meta["wall_s"] = time.time() - runner.t0
        meta["timeline"] = runner.timeline
        return fr.write_outputs(args.out, runner.results, meta, train, final=final)

    def save_rows():
        meta["wall_s"] = time.time() - runner.t0
        br.atomic_write(os.path.join(args.out, "fp8_rows.json"),
                        json.dumps({"meta": meta, "rows": runner.results, "train": train}, default=str))

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        if refs or timed:
            # The state writers run alone first: compiling beside the first batch, a writer
            # outran that batch's prep timeout and every fp8 process waiting for its states
            # timed out. The gradient references (a float32 step) come after everything timed.
            if refs:
                runner.run_group("fp8 states", refs, write, save_rows)
            runner.run_group("fp8", timed + grads, write, save_rows)
        if "train" in args.sections:
            left = runner.remaining() - args.reserve_s
            if left < args.min_train_s:
                train = {"skipped": f"{left:.0f}s left of the deadline (--min-train-s {args.min_train_s:.0f})"}
            else:
                say(f"training runs (bf16, fp8_e4m3) side by side, at most {left:.0f}s")
                env = dict(runner.env)
                train = run_training(args, workdir, env, left)
                runner.timeline.append({"phase": "train", "s": train["wall_s"]})
            save_rows()
    finally:
        bst.finish_campaign(runner, refs + timed + grads, smi, meta, workdir, args, save_rows, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
