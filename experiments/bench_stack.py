"""Memory, speed, MFU and gradient agreement of a LLaMA-style stack, JAX vs PyTorch, in one run.

Variants (see ``bench_common.VARIANTS``): J-plain, J-remat, J-remat-dots,
eae (reconstruct, boundaries only; eae-sep: stored apart from the gradient
buffers), eae-passes (int8 fake-quant + clip),
eae-mp-f32b / eae-mp-bf16b (fp32-master model, fp32 vs bf16 boundaries),
eae-offload (boundaries in pinned host memory), eae-dots (selective policy),
T-plain, T-ckpt, T-eae. Configurations: ``medium`` (dim 2048, 16 heads, 4 kv
heads, SwiGLU 5632, depth 16, batch 4, seq 2048, bf16), ``deep`` (depth 48),
``sweep`` (dim 1024 at depth 8/16/32/64).

Every variant runs in its own process, so its peak device memory is its own
(JAX: ``memory_stats()['peak_bytes_in_use']``; torch:
``max_memory_allocated``). Children of one configuration group compile in
parallel (at most ``--jobs`` at a time), then are timed strictly one at a time:
no process compiles or autotunes on the GPU while another is timed. J-plain is
timed first and writes its gradients; every other variant compares its own
gradients (same weights, same inputs) with them.

Usage (GPU)::

    python experiments/bench_stack.py --out $OUT
    python experiments/bench_stack.py --configs medium --variants J-plain,eae --steps 20

Smoke (CPU, tiny sizes)::

    python experiments/bench_stack.py --smoke --out /tmp/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_common as bc  # noqa: E402
import bench_report as br  # noqa: E402

REPO = os.path.dirname(HERE)


def _now() -> str:
    return time.strftime("%H:%M:%S")


def say(msg: str) -> None:
    print(f"[bench {_now()}] {msg}", flush=True)


@dataclasses.dataclass
class Job:
    cfg: bc.StackConfig
    variant: str
    spec_path: str
    log_path: str
    proc: Optional[subprocess.Popen] = None
    lines: "queue.Queue[str]" = dataclasses.field(default_factory=queue.Queue)
    state: str = "pending"  # pending | prep | ready | measuring | done
    started: float = 0.0
    ready_at: Optional[float] = None
    measure_started: Optional[float] = None
    result: Optional[dict] = None
    retried: bool = False

    @property
    def key(self) -> str:
        return f"{self.variant}@{self.cfg.name}"


def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line.rstrip("\n"))
    q.put(None)


def _log_tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


class Runner:
    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.results: List[dict] = []
        self.env = dict(os.environ)
        # Several processes share the GPU while they compile: no preallocation
        # (peak_bytes_in_use counts allocations, not the reserved pool).
        self.env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.jobs_limit = args.jobs

    def probe(self, workdir: str) -> dict:
        """Start JAX once with the children's environment: which backend, and
        whether the XLA flags we add are accepted (an unknown flag aborts XLA)."""
        code = ("import jax, json; jax.numpy.zeros(2).block_until_ready(); d = jax.devices()[0]; "
                "print('PROBE ' + json.dumps({'backend': jax.default_backend(), 'device': d.device_kind, "
                "'memories': [m.kind for m in d.addressable_memories()]}))")
        info = {}
        r = None
        if self.args.autotune_cache and not self.args.smoke:
            cache = os.path.join(workdir, "autotune_cache")
            os.makedirs(cache, exist_ok=True)
            trial = dict(self.env)
            trial["XLA_FLAGS"] = (trial.get("XLA_FLAGS", "") + f" --xla_gpu_per_fusion_autotune_cache_dir={cache}").strip()
            r = subprocess.run([sys.executable, "-c", code], env=trial, capture_output=True, text=True, timeout=180)
            if r.returncode == 0:
                self.env = trial
                info["autotune_cache"] = cache
            else:
                info["autotune_cache"] = "disabled: " + " ".join(r.stderr.strip().splitlines()[-1:])[:300]
                r = None
        if r is None:
            r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=180)
        for line in r.stdout.splitlines():
            if line.startswith("PROBE "):
                info.update(json.loads(line[6:]))
        if r.returncode != 0:
            info["error"] = r.stderr.strip()[-2000:]
        info["xla_flags"] = self.env.get("XLA_FLAGS", "")
        return info

    # ------------------------------------------------------------------ time
    def remaining(self) -> float:
        return self.args.deadline_s - (time.time() - self.t0)

    # ------------------------------------------------------------------ children
    def _spawn(self, job: Job) -> None:
        kind = bc.VARIANTS[job.variant]["kind"]
        script = os.path.join(HERE, "bench_child_jax.py" if kind == "jax" else "bench_child_torch.py")
        log = open(job.log_path, "w")
        job.proc = subprocess.Popen([sys.executable, script, job.spec_path], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=self.env, cwd=REPO,
                                    bufsize=1)
        log.close()
        threading.Thread(target=_reader, args=(job.proc.stdout, job.lines), daemon=True).start()
        job.state, job.started = "prep", time.time()

    def _kill(self, job: Job) -> None:
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()  # only our own child, by its handle
            try:
                job.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _finish(self, job: Job, result: dict) -> None:
        job.state = "done"
        base = {"config": job.cfg.name, "variant": job.variant, "family": job.cfg.family,
                "config_detail": dataclasses.asdict(job.cfg),
                # wall-clock windows (time.time()) of this child's compile+load and of its timing
                "prep_window": (None if not job.started else
                                [job.started, job.ready_at if job.ready_at is not None else time.time()]),
                "measure_window": (None if job.measure_started is None else [job.measure_started, time.time()])}
        base.update(result)
        # XLA says so in the log when offloaded data ends up computed on the host
        # (a pattern its host offloader does not handle): slow, worth flagging.
        try:
            with open(job.log_path, errors="replace") as f:
                log = f.read()
            base["xla_host_compute_warning"] = "Converting into host compute" in log
        except OSError:
            pass
        job.result = base
        self.results.append(base)
        status = base.get("status")
        if status == "ok":
            peak = base.get("peak_bytes")
            say(f"  {job.key:<24} ok   {base['step_ms_median']:9.2f} ms  "
                f"peak {'n/a' if peak is None else f'{peak / bc.GIB:7.3f} GiB'}  "
                f"grad rel err {br.fmt_err(base.get('grad_rel_err'))}")
        else:
            say(f"  {job.key:<24} {status}: {str(base.get('error'))[:300]}")

    def _drain(self, job: Job):
        """Handle queued stdout lines; return 'ready', 'result', 'eof' or None."""
        event = None
        while True:
            try:
                line = job.lines.get_nowait()
            except queue.Empty:
                return event
            if line is None:
                return "eof" if event is None else event
            if line == "READY":
                job.state = "ready"
                job.ready_at = time.time()
                event = "ready"
            elif line.startswith(("RESULT ", "ERROR ", "SKIP ")):
                tag, payload = line.split(" ", 1)
                self._finish(job, json.loads(payload))
                return "result"
            # anything else on stdout is a stray print; it is in the log below

    def _fail(self, job: Job, status: str, why: str) -> None:
        self._kill(job)
        tail = _log_tail(job.log_path)
        self._finish(job, {"status": status, "error": f"{why}\n--- log tail ---\n{tail}" if tail else why})

    def run_group(self, name: str, jobs: List[Job]) -> None:
        """Compile all jobs of a group in parallel, then time them one at a time."""
        reserve = self.args.reserve_s
        # J-plain and eae spawn first so that no waiting child is held back by them.
        pending = sorted(jobs, key=lambda j: (j.cfg.depth, {"J-plain": 0, "eae": 1}.get(j.variant, 2)))
        prepping: List[Job] = []
        ready: List[Job] = []
        say(f"group {name}: {len(jobs)} variants, compiling (up to {self.jobs_limit} at a time)")
        while pending or prepping:
            # Children that compiled hold GPU memory and a CUDA context until they
            # are timed; on the H200 machine a 7th live process failed to get a
            # device and torch children ran out of memory. So the live count is
            # capped, and waiting children are timed to make room, but only
            # once no child is compiling: a compile beside a timed step takes
            # host cores and memory bandwidth (on the H200 the prefetching
            # offload step timed beside a 36 s compile measured 119.5 ms median,
            # 155 ms p90; 109.8 and 113.1 ms in runs without).
            if pending and len(prepping) + len(ready) >= self.jobs_limit and ready and not prepping:
                self._measure_allowed(ready, jobs)
            while pending and len(prepping) + len(ready) < self.jobs_limit:
                if self.remaining() < reserve + 30:
                    for j in pending:
                        self._finish(j, {"status": "skipped", "error": "time budget (--deadline-s) exhausted"})
                    pending = []
                    break
                job = pending.pop(0)
                self._spawn(job)
                prepping.append(job)
            for job in list(prepping):
                ev = self._drain(job)
                if ev == "ready":
                    prepping.remove(job)
                    ready.append(job)
                    say(f"  {job.key:<24} compiled and loaded in {time.time() - job.started:.0f}s")
                    if self.jobs_limit == 1:  # serial mode: time it right away
                        self._measure(job)
                        ready.remove(job)
                elif ev in ("result", "eof"):  # EOF arrives after every line the child wrote
                    prepping.remove(job)
                    if job.state != "done":
                        self._fail(job, "error", f"child exited with code {job.proc.poll()} before READY")
                    if self._looks_exclusive(job) and not job.retried:
                        if self.jobs_limit > 1:
                            say("GPU refuses a second process (exclusive compute mode?): falling back to --jobs 1")
                            self.jobs_limit = 1
                        # Time the children already waiting: that frees the GPU for the rest.
                        ready.sort(key=lambda j: {"J-plain": 0, "eae": 1}.get(j.variant, 2))
                        for waiting in list(ready):
                            self._measure(waiting)
                            ready.remove(waiting)
                        self.results.remove(job.result)
                        job.state, job.result, job.retried = "pending", None, True
                        job.lines = queue.Queue()
                        pending.insert(0, job)
                elif time.time() - job.started > min(self.args.prep_timeout_s, max(5.0, self.remaining() - reserve)):
                    prepping.remove(job)
                    self._fail(job, "timeout", f"no READY within the prep timeout ({time.time() - job.started:.0f}s)")
            time.sleep(0.05)
        # J-plain first: it writes the reference gradients the others compare with;
        # then eae, whose gradients eae-offload must reproduce.
        ready.sort(key=lambda j: (j.cfg.depth, {"J-plain": 0, "eae": 1}.get(j.variant, 2)))
        for job in ready:
            self._measure(job)

    def _measure_allowed(self, ready: List[Job], group: List[Job]) -> None:
        """Time the waiting children that may go now: J-plain first (it writes the
        reference gradients), then eae (eae-offload compares with it), then any."""
        order = {"J-plain": 0, "eae": 1}
        ready.sort(key=lambda j: (j.cfg.depth, order.get(j.variant, 2)))
        for job in list(ready):
            blockers = [j for j in group if j.cfg.depth == job.cfg.depth
                        and order.get(j.variant, 2) < order.get(job.variant, 2) and j.state != "done"]
            if blockers:
                continue
            self._measure(job)
            ready.remove(job)

    def _looks_exclusive(self, job: Job) -> bool:
        text = (job.result or {}).get("error", "") or ""
        return any(s in text for s in ("busy or unavailable", "CUDA_ERROR_DEVICE_UNAVAILABLE", "exclusive"))

    def _measure(self, job: Job) -> None:
        if self.remaining() < self.args.reserve_s:
            try:
                job.proc.stdin.write("QUIT\n")
                job.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            self._finish(job, {"status": "skipped", "error": "time budget (--deadline-s) exhausted"})
            self._kill(job)
            return
        job.state = "measuring"
        t0 = job.measure_started = time.time()
        limit = min(self.args.measure_timeout_s, max(5.0, self.remaining() - self.args.reserve_s))
        try:
            job.proc.stdin.write("GO\n")
            job.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        while True:
            ev = self._drain(job)
            if ev == "result":
                break
            if ev == "eof":
                self._fail(job, "error", f"child exited with code {job.proc.wait()} while measuring")
                break
            if time.time() - t0 > limit:
                self._fail(job, "timeout", f"no result within the measure timeout ({limit:.0f}s)")
                break
            time.sleep(0.02)
        try:
            job.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill(job)


def _parse_injections(text: str) -> Dict[str, str]:
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, _, what = item.partition(":")
        if what not in ("raise", "hang"):
            raise SystemExit(f"--inject-failure items are VARIANT@CONFIG:raise|hang, got {item!r}")
        out[key] = what
    return out


def _gpu_info() -> dict:
    info = {}
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            q = "name,compute_mode,memory.total,clocks.sm,clocks.max.sm,driver_version,power.limit"
            out = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20).stdout.strip()
            info["nvidia_smi"] = out
        except Exception as err:  # informational only
            info["nvidia_smi_error"] = repr(err)
    return info


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "torch", "eae-runtime", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def build_jobs(args, groups: Dict[str, List[bc.StackConfig]], workdir: str, injections: Dict[str, str]):
    wanted = None if args.variants in (None, "", "default") else (
        list(bc.VARIANTS) if args.variants == "all" else args.variants.split(","))
    if wanted:
        bad = [v for v in wanted if v not in bc.VARIANTS]
        if bad:
            raise SystemExit(f"unknown variant(s) {bad}; known: {', '.join(bc.VARIANTS)}")
    plan = []
    save_hlo = set(filter(None, args.save_hlo.split(",")))
    for gname in args.configs.split(","):
        if gname not in groups:
            raise SystemExit(f"unknown config group {gname!r}; expected medium, deep or sweep")
        variants = [v for v in (wanted or bc.DEFAULT_VARIANTS[gname])]
        if wanted and gname == "sweep":
            variants = [v for v in wanted if v in bc.DEFAULT_VARIANTS["sweep"]] or bc.DEFAULT_VARIANTS["sweep"]
        if "J-plain" not in variants:
            say(f"note: J-plain not selected for {gname}: gradient agreement will be reported as missing")
        jobs = []
        for cfg in groups[gname]:
            for v in variants:
                key = f"{v}@{cfg.name}"
                spec_path = os.path.join(workdir, "specs", f"{cfg.name}__{v}.json")
                log_path = os.path.join(workdir, "logs", f"{cfg.name}__{v}.log")
                spec = {"variant": v, "config": dataclasses.asdict(cfg), "workdir": workdir, "steps": args.steps,
                        "warmup": args.warmup, "inject": injections.get(key), "require_gpu": not args.smoke}
                if v in save_hlo and gname == "medium":
                    spec["save_hlo"] = os.path.join(workdir, "hlo", f"{cfg.name}__{v}.hlo.txt")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                jobs.append(Job(cfg, v, spec_path, log_path))
        plan.append((gname, jobs))
    return plan


def _rerender(path: str, out: str) -> int:
    """Rewrite a run's report from its saved rows; the measurement's meta is kept."""
    try:
        with open(path) as f:
            doc = json.load(f)
        rows, meta = doc["rows"], doc["meta"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"--report-from {path}: not a bench_results.json ({type(err).__name__}: {err})")
    os.makedirs(out, exist_ok=True)
    meta = {**meta, "rerendered": {"argv": sys.argv, "at": time.strftime("%Y-%m-%d %H:%M:%S")}}
    print(br.write_outputs(out, rows, meta, final=True))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, under two minutes)")
    p.add_argument("--configs", default="medium,deep,sweep", help="comma list of medium, deep, sweep")
    p.add_argument("--variants", default=None,
                   help="comma list of variants (default: the per-config defaults; 'all' for every variant)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 10; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 2; smoke 1)")
    p.add_argument("--sweep-depths", default=None, help="comma list of depths for the sweep (default 8,16,32,64)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"),
                   help="where the JSON, table, charts and logs go (default $OUT, else experiments/results)")
    p.add_argument("--workdir", default=None, help="scratch for weights, reference grads, logs (default a temp dir)")
    p.add_argument("--jobs", type=int, default=None, help="children compiling at once (default 4; smoke 2)")
    p.add_argument("--prep-timeout-s", type=float, default=None, help="per-variant limit to compile + load")
    p.add_argument("--measure-timeout-s", type=float, default=None, help="per-variant limit to time + check")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="whole-run budget; variants that would start past it are skipped (default 530; smoke 600)")
    p.add_argument("--reserve-s", type=float, default=None, help="time kept for the report at the end")
    p.add_argument("--save-hlo", default="J-remat,eae,eae-offload",
                   help="variants whose compiled HLO (medium) goes into $OUT/hlo_medium.tar.gz")
    p.add_argument("--inject-failure", default="",
                   help="testing aid: VARIANT@CONFIG:raise|hang,... makes those children fail or hang")
    p.add_argument("--no-autotune-cache", dest="autotune_cache", action="store_false",
                   help="do not share XLA's per-fusion autotuning results between the children (GPU)")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--report-from", default=None, metavar="JSON",
                   help="measure nothing: re-render the table, targets and charts from a bench_results.json "
                        "(after the report's checks changed) into --out")
    args = p.parse_args(argv)
    if args.report_from:
        return _rerender(args.report_from, args.out)
    smoke = args.smoke
    args.steps = args.steps or (3 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    args.jobs = args.jobs or (2 if smoke else 4)
    args.prep_timeout_s = args.prep_timeout_s or (120.0 if smoke else 240.0)
    args.measure_timeout_s = args.measure_timeout_s or (60.0 if smoke else 150.0)
    args.deadline_s = args.deadline_s or (600.0 if smoke else 530.0)
    args.reserve_s = args.reserve_s if args.reserve_s is not None else (5.0 if smoke else 15.0)
    if args.steps < 1 or args.warmup < 0 or args.jobs < 1:
        raise SystemExit("--steps >= 1, --warmup >= 0 and --jobs >= 1 are required")
    depths = [int(d) for d in args.sweep_depths.split(",")] if args.sweep_depths else None
    groups = bc.configs(smoke, depths)
    injections = _parse_injections(args.inject_failure)

    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="eae_bench_")
    for sub in ("specs", "logs", "hlo"):
        os.makedirs(os.path.join(workdir, sub), exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    runner = Runner(args)
    meta = {"argv": sys.argv, "smoke": smoke, "steps": args.steps, "warmup": args.warmup, "versions": _versions(),
            "gpu": _gpu_info(), "peak_flops": bc.PEAK_BF16_FLOPS, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    say(f"versions {meta['versions']}")
    if meta["gpu"]:
        say(f"gpu {meta['gpu']}")
        if "Exclusive" in meta["gpu"].get("nvidia_smi", ""):
            say("GPU is in an exclusive compute mode: one process at a time (--jobs 1)")
            runner.jobs_limit = 1
    probe = runner.probe(workdir)
    meta["jax_probe"] = probe
    say(f"jax probe {probe}")
    if "error" in probe:
        say("JAX does not start with this environment; the JAX variants will fail (see jax_probe in the JSON)")
    elif not smoke and probe.get("backend") != "gpu":
        say(f"WARNING: JAX backend is {probe.get('backend')!r}, not gpu: the full-size run needs a GPU")
    plan = build_jobs(args, groups, workdir, injections)

    # Weights: one file set per block shape, deep enough for every selected config.
    t0 = time.time()
    needed: Dict[str, bc.StackConfig] = {}
    for _, jobs in plan:
        for job in jobs:
            cur = needed.get(job.cfg.family)
            if cur is None or job.cfg.depth > cur.depth:
                needed[job.cfg.family] = job.cfg
    for cfg in needed.values():
        bc.ensure_weights(workdir, cfg, cfg.depth, threads=os.cpu_count() or 4)
    for _, jobs in plan:
        for job in jobs:
            bc.ensure_inputs(workdir, job.cfg)
    say(f"weights and inputs ready in {time.time() - t0:.1f}s under {workdir}")

    try:
        for gname, jobs in plan:
            if runner.remaining() < args.reserve_s + 30:
                for job in jobs:
                    runner._finish(job, {"status": "skipped", "error": "time budget (--deadline-s) exhausted"})
                continue
            runner.run_group(gname, jobs)
            br.write_outputs(args.out, runner.results, meta, final=False)
            # Reference grads of a finished group are no longer needed (GBs for deep).
            shutil.rmtree(os.path.join(workdir, "ref"), ignore_errors=True)
    finally:
        meta["wall_s"] = time.time() - runner.t0
        _collect_logs(workdir, args.out)
        report = br.write_outputs(args.out, runner.results, meta, final=True)
        print(report, flush=True)
        if not args.keep_workdir and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _collect_logs(workdir: str, out: str) -> None:
    logs = os.path.join(workdir, "logs")
    with open(os.path.join(out, "bench_children.log"), "w") as f:
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            f.write(f"===== {name}\n")
            with open(os.path.join(logs, name), errors="replace") as g:
                text = g.read()
            f.write(text[-20000:] + "\n")
    hlo = os.path.join(workdir, "hlo")
    files = sorted(os.listdir(hlo)) if os.path.isdir(hlo) else []
    if files:
        with tarfile.open(os.path.join(out, "hlo_medium.tar.gz"), "w:gz") as tar:
            for name in files:
                tar.add(os.path.join(hlo, name), arcname=name)


if __name__ == "__main__":
    sys.exit(main())
