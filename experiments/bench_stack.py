"""Speed and memory of a LLaMA-style stack, JAX vs PyTorch: a benchmark campaign.

Variants: ``bench_common.VARIANTS`` (J-plain, J-remat with and without
``prevent_cse``, eae and its options, T-plain, T-ckpt, T-compile,
T-compile-ckpt, T-compile-b0.1/0.3/0.5, T-eae, T-eae-nosync, ...).
Configurations: ``medium`` (dim 2048, 16 heads, 4 kv heads, SwiGLU 5632,
depth 16, batch 4, seq 2048, bf16), ``deep`` (depth 48), ``sweep`` (dim
1024 at depth 8/16/32/64).

Protocol (docs/benchmarks.md says why):

* Every variant runs in ``--repeats`` processes. The timing order is
  ``--repeats`` rounds, each a random permutation of the variants drawn
  with ``--seed``; the order is recorded.
* Processes start in that order in batches (``--jobs`` processes while a
  batch holds a variant's first compile, ``--warm-jobs`` after): a batch
  compiles and loads in parallel, then its processes are timed one at a
  time, in order, while nothing else compiles or runs. Each saves every
  step's time. A process that runs out of device memory while preparing
  beside the others is retried once, in the next batch.
* A reference process in the first batch runs J-plain's step and the same
  step in float32 and writes their gradients; the first timed process of
  each variant compares its own with both.
* Compile caches persist across processes: JAX's compilation cache and
  XLA's autotuning results for all JAX processes, inductor's cache per
  torch variant (so no budget setting is served another's graphs).
* nvidia-smi logs clocks, power, temperature and clock-event reasons every
  ``--smi-interval-ms`` for the whole campaign (``smi.csv.gz``); the report
  summarises them over each timing window.
* ``--deadline-s``: no batch starts and no process is timed past it (less
  ``--reserve-s``). Every process's row is saved as soon as it ends
  (``bench_rows.json``), the whole report after every batch and at the end.

Usage (GPU; ``--estimate-only`` prints the schedule and its time estimate)::

    PYTHONUNBUFFERED=1 python experiments/bench_stack.py --configs medium --out $OUT

Smoke (CPU, tiny sizes)::

    python experiments/bench_stack.py --smoke --out /tmp/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_common as bc  # noqa: E402
import bench_plan as bp  # noqa: E402
import bench_report as br  # noqa: E402
import bench_stats as bs  # noqa: E402

REPO = os.path.dirname(HERE)


def _now() -> str:
    return time.strftime("%H:%M:%S")


def say(msg: str) -> None:
    print(f"[bench {_now()}] {msg}", flush=True)


def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line.rstrip("\n"))
    q.put(None)


def _log_tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------- clocks
class SmiLogger:
    """``nvidia-smi --query-gpu=... -lms N`` in the background, into ``smi.csv``."""

    def __init__(self, out_dir: str, interval_ms: int):
        self.path = os.path.join(out_dir, "smi.csv")
        self.interval_ms = interval_ms
        self.proc: Optional[subprocess.Popen] = None
        self.info: dict = {}

    def start(self) -> dict:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.info = {"status": "unavailable: no nvidia-smi"}
            return self.info
        # The GPU the children use: the first visible one.
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
        for reasons in bs.SMI_REASONS + (None,):
            fields = bs.SMI_BASE + (f",{reasons}" if reasons else "")
            probe = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,nounits", "-i", gpu],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                break
        else:
            self.info = {"status": f"unavailable: {(probe.stderr or probe.stdout).strip()[-300:]}"}
            return self.info
        out = open(self.path, "w")
        self.proc = subprocess.Popen([exe, f"--query-gpu={fields}", "--format=csv,nounits", "-i", gpu,
                                      "-lms", str(self.interval_ms)], stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.info = {"status": "logging", "fields": fields, "gpu": gpu, "interval_ms": self.interval_ms,
                     "file": "smi.csv.gz"}
        return self.info

    def stop(self) -> List[dict]:
        """Stop logging, gzip the log, return its samples."""
        if self.proc is None:
            return []
        self.proc.terminate()  # our own child, by its handle
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc = None
        with open(self.path, errors="replace") as f:
            text = f.read()
        with gzip.open(self.path + ".gz.tmp", "wt") as f:
            f.write(text)
        os.replace(self.path + ".gz.tmp", self.path + ".gz")
        os.remove(self.path)
        return bs.parse_smi(text)


# ---------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, args, workdir: str):
        self.args = args
        self.workdir = workdir
        self.t0 = time.time()
        self.results: List[dict] = []
        self.timeline: List[dict] = []
        self.timed_seq = 0  # how many processes were timed so far (the actual order, retries included)
        self.jobs_limit = args.jobs
        self.env = dict(os.environ)
        # Several processes share the GPU while they compile: no preallocation
        # (the pool statistics then show what each step needed).
        self.env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if args.compile_cache:
            # JAX keeps XLA's per-fusion autotuning results beside its cache.
            self.env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(workdir, "jax_cache")
            self.env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

    def remaining(self) -> float:
        return self.args.deadline_s - (time.time() - self.t0)

    def probe(self) -> dict:
        """Start JAX and torch once, with the children's environment."""
        jax_code = ("import jax, json; jax.numpy.zeros(2).block_until_ready(); d = jax.devices()[0]; "
                    "print('PROBE ' + json.dumps({'backend': jax.default_backend(), 'device': d.device_kind, "
                    "'memories': [m.kind for m in d.addressable_memories()]}))")
        torch_code = ("import json, torch; import torch._functorch.config as c; from torch.nn.attention import "
                      "sdpa_kernel; import eae_runtime; print('PROBE ' + json.dumps({'torch': torch.__version__, "
                      "'cuda': torch.cuda.is_available(), 'has_activation_memory_budget': "
                      "hasattr(c, 'activation_memory_budget'), 'eae_runtime': eae_runtime.__version__}))")
        info = {}
        for name, code in (("jax", jax_code), ("torch", torch_code)):
            r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True,
                               timeout=300)
            found = [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("PROBE ")]
            info[name] = found[0] if found else {"error": (r.stderr.strip() or r.stdout.strip())[-1500:]}
        info["xla_flags"] = self.env.get("XLA_FLAGS", "")
        return info

    def child_script(self, job: bp.Job) -> str:
        """The script a job's process runs (``script SPEC.json``); other campaigns override it."""
        return os.path.join(HERE, "bench_child_jax.py" if job.kind == "jax" else "bench_child_torch.py")

    def _spawn(self, job: bp.Job) -> None:
        script = self.child_script(job)
        env = self.env
        if job.role == "ref":  # untimed: allocate and free per buffer, holding no pool beside the others
            env = dict(env, XLA_PYTHON_CLIENT_ALLOCATOR="platform")
        if job.kind == "torch":
            env = dict(env, TORCHINDUCTOR_CACHE_DIR=os.path.join(self.workdir, "inductor", job.variant))
            if not self.args.compile_cache:
                env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        log = open(job.log_path, "w")
        job.proc = subprocess.Popen([sys.executable, script, job.spec_path], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO, bufsize=1)
        log.close()
        threading.Thread(target=_reader, args=(job.proc.stdout, job.lines), daemon=True).start()
        job.state, job.started = "prep", time.time()

    def _kill(self, job: bp.Job) -> None:
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()  # only our own child, by its handle
            try:
                job.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _finish(self, job: bp.Job, result: dict) -> None:
        job.state = "done"
        row = {"config": job.cfg.name, "variant": job.variant, "family": job.cfg.family, "role": job.role,
               "round": job.round, "order": job.order, "check": job.check, "retried": job.retried,
               "timed_seq": self.timed_seq if job.measure_started is not None else None,
               "config_detail": dataclasses.asdict(job.cfg),
               # wall-clock windows (time.time()) of this process's preparation and timing
               "prep_window": None if not job.started else [job.started, job.ready_at or time.time()],
               "measure_window": None if job.measure_started is None else [job.measure_started, time.time()]}
        row.update(result)
        try:
            with open(job.log_path, errors="replace") as f:
                # XLA says so when offloaded data ends up computed on the host (slow)
                row["xla_host_compute_warning"] = "Converting into host compute" in f.read()
        except OSError:
            pass
        job.result = row
        self.results.append(row)
        if row.get("status") != "ok":
            say(f"  {job.key:<34} {row.get('status')}: {str(row.get('error'))[:300]}")
        elif job.role == "ref":
            losses = ", ".join(f"{k} {row[k]:.5f}" for k in ("loss", "loss_f32") if row.get(k) is not None)
            say(f"  {job.key:<34} references written{f' ({losses})' if losses else ''} "
                f"in {time.time() - job.started:.0f}s")
        else:
            peak = row.get("peak_bytes")
            say(f"  {job.key:<34} {row['step_ms_median']:9.2f} ms  peak "
                f"{'n/a' if peak is None else f'{peak / bc.GIB:7.3f} GiB'}"
                + (f"  grad rel err {br.fmt_err(row.get('grad_rel_err'))}" if job.check else ""))

    def _fail(self, job: bp.Job, status: str, why: str) -> None:
        self._kill(job)
        tail = _log_tail(job.log_path)
        self._finish(job, {"status": status, "error": f"{why}\n--- log tail ---\n{tail}" if tail else why})

    def _skip(self, job: bp.Job, why: str = "time budget (--deadline-s) exhausted") -> None:
        if job.proc is not None and job.proc.poll() is None:
            try:
                job.proc.stdin.write("QUIT\n")
                job.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            try:
                job.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill(job)
        self._finish(job, {"status": "skipped", "error": why})

    def _drain(self, job: bp.Job) -> Optional[str]:
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
                job.state, job.ready_at, event = "ready", time.time(), "ready"
            elif line.startswith(("RESULT ", "ERROR ", "SKIP ")):
                self._finish(job, json.loads(line.split(" ", 1)[1]))
                return "result"
            # anything else on stdout is a stray print; it is in the log

    def prepare(self, batch: List[bp.Job]) -> None:
        """Start every job of a batch; return when each is ready or done."""
        for job in batch:
            self._spawn(job)
        prepping = list(batch)
        while prepping:
            for job in list(prepping):
                ev = self._drain(job)
                if ev == "ready":
                    prepping.remove(job)
                    say(f"  {job.key:<34} compiled and loaded in {time.time() - job.started:.0f}s")
                elif ev in ("result", "eof"):  # a reference job finishes here; EOF comes after every line
                    prepping.remove(job)
                    if job.state != "done":
                        self._fail(job, "error", f"child exited with code {job.proc.wait()} before READY")
                    elif job.proc is not None:
                        try:
                            job.proc.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            self._kill(job)
                elif time.time() - job.started > min(self.args.prep_timeout_s,
                                                     max(5.0, self.remaining() - self.args.reserve_s)):
                    prepping.remove(job)
                    self._fail(job, "timeout", f"no READY within the prep timeout ({time.time() - job.started:.0f}s)")
            time.sleep(0.05)

    def measure(self, job: bp.Job) -> None:
        needed = max([t["measure_s"] for t in self.timeline if "measure_s" in t] or [5.0])
        if self.remaining() < self.args.reserve_s + needed:
            self._skip(job)
            return
        job.state = "measuring"
        self.timed_seq += 1
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
            time.sleep(0.01)
        try:  # the next process is timed only once this one has left the GPU
            job.proc.wait(timeout=min(30.0, max(1.0, self.remaining())))
        except subprocess.TimeoutExpired:
            self._kill(job)
        self.timeline.append({"phase": "measure", "job": job.key, "measure_s": time.time() - t0})

    def run_group(self, name: str, jobs: List[bp.Job], write, save_rows) -> None:
        say(f"group {name}: {sum(j.role == 'timed' for j in jobs)} timed processes "
            f"({self.args.repeats} per variant), batches of {self.jobs_limit} "
            f"({min(self.jobs_limit, self.args.warm_jobs)} once every variant has compiled)")
        pending, compiled = list(jobs), set()
        warm_cap = self.args.warm_jobs if self.jobs_limit > 1 else 1
        while pending:
            batch = bp.next_batch(pending, compiled, self.jobs_limit, warm_cap)
            if self.remaining() < self.args.reserve_s + self.args.min_batch_s:
                for job in batch + pending:
                    self._skip(job)
                return
            t0 = time.time()
            self.prepare(batch)
            self.timeline.append({"phase": "prepare", "batch": [j.key for j in batch], "prep_s": time.time() - t0})
            retry = [j for j in batch if self._out_of_memory(j)]
            for job in retry:  # prepared beside too many others: once more, in the next batch
                say(f"  {job.key:<34} ran out of device memory while preparing: retried in the next batch")
                self.results.remove(job.result)
                job.retried, job.proc, job.lines, job.state = True, None, queue.Queue(), "pending"
                job.started, job.ready_at, job.result = 0.0, None, None
            pending[:0] = retry
            save_rows()
            for job in batch:
                if job.state == "ready":
                    self.measure(job)
                    save_rows()
            write()
            say(f"batch done: {time.time() - self.t0:.0f}s spent, {self.remaining():.0f}s left of the deadline")

    @staticmethod
    def _out_of_memory(job: bp.Job) -> bool:
        """A first failure before READY that says the device ran out of memory."""
        if job.retried or job.result is None or job.result.get("status") != "error" or job.ready_at is not None:
            return False
        text = str(job.result.get("error", ""))
        return any(m in text for m in ("out of memory", "RESOURCE_EXHAUSTED", "OutOfMemoryError",
                                        "CUDA_ERROR_OUT_OF_MEMORY"))

    def stop_all(self, jobs: List[bp.Job]) -> None:
        for job in jobs:
            if job.state != "done":
                self._kill(job)
                self._finish(job, {"status": "skipped", "error": "campaign stopped before this process ran"})


def _gpu_info() -> dict:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        q = "name,compute_mode,memory.total,clocks.sm,clocks.max.sm,driver_version,power.limit"
        out = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
        return {"nvidia_smi": out}
    except Exception as err:  # informational only
        return {"nvidia_smi_error": repr(err)}


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "torch", "triton", "eae-runtime", "numpy",
                "scipy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def finish_campaign(runner, jobs, smi, meta: dict, workdir: str, args, save_rows, write) -> None:
    """End a campaign, however it ended: stop ``jobs``' processes and the clock log, attach the
    clocks to every result, gather the children's logs, save and print the report, and remove
    the work folder unless kept (``--keep-workdir`` / ``--workdir``)."""
    runner.stop_all(jobs)
    samples = smi.stop()
    br.attach_clocks(runner.results, samples)
    meta["clocks_whole_run"] = bs.window_clocks(samples, runner.t0, time.time()) if samples else None
    _collect_logs(workdir, args.out)
    save_rows()
    print(write(final=True), flush=True)
    if not args.keep_workdir and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect_logs(workdir: str, out: str) -> None:
    logs = os.path.join(workdir, "logs")
    with gzip.open(os.path.join(out, "bench_children.log.gz"), "wt") as f:
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            f.write(f"===== {name}\n")
            with open(os.path.join(logs, name), errors="replace") as g:
                f.write(g.read()[-20000:] + "\n")
    hlo = os.path.join(workdir, "hlo")
    files = sorted(os.listdir(hlo)) if os.path.isdir(hlo) else []
    if files:
        with tarfile.open(os.path.join(out, "hlo_medium.tar.gz"), "w:gz") as tar:
            for name in files:
                tar.add(os.path.join(hlo, name), arcname=name)


def _rerender(path: str, out: str) -> int:
    """Rewrite a campaign's report from its saved rows (bench_results.json, or
    bench_rows.json of a campaign that was killed); the measurement's meta is kept."""
    try:
        with open(path) as f:
            doc = json.load(f)
        rows, meta = doc["rows"], doc["meta"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"--report-from {path}: not a bench_results.json / bench_rows.json "
                         f"({type(err).__name__}: {err})")
    os.makedirs(out, exist_ok=True)
    meta = {**meta, "rerendered": {"argv": sys.argv, "at": time.strftime("%Y-%m-%d %H:%M:%S")}}
    print(br.write_outputs(out, rows, meta, final=True))
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    p.add_argument("--configs", default="medium", help="comma list of medium, deep, sweep")
    p.add_argument("--variants", default=None,
                   help="comma list of variants (default: the per-config defaults; 'all' for every variant)")
    p.add_argument("--repeats", type=int, default=None, help="processes per variant (default 3; smoke 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the timing order")
    p.add_argument("--steps", type=int, default=None, help="timed steps per process (default 10; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per process (default 2; smoke 1)")
    p.add_argument("--sweep-depths", default=None, help="comma list of depths for the sweep (default 8,16,32,64)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"),
                   help="where the JSON, tables, clock log and logs go (default $OUT, else experiments/results)")
    p.add_argument("--workdir", default=None, help="scratch for weights, references, caches, logs (default a temp dir)")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes preparing at once while some compile cold (default 8; smoke 2)")
    p.add_argument("--warm-jobs", type=int, default=None,
                   help="processes preparing at once once every variant of the batch has compiled (default 13; "
                        "smoke 2)")
    p.add_argument("--sdpa-backend", default="flash", help="the one SDPA backend torch attention may use")
    p.add_argument("--prep-timeout-s", type=float, default=None, help="per-process limit to compile + load")
    p.add_argument("--measure-timeout-s", type=float, default=None, help="per-process limit to time + check")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="whole-campaign budget from the start (default 470; smoke 600)")
    p.add_argument("--reserve-s", type=float, default=None, help="time kept for the report at the end")
    p.add_argument("--min-batch-s", type=float, default=None,
                   help="no batch starts with less time than this left before the reserve (default 45; smoke 10)")
    p.add_argument("--smi-interval-ms", type=int, default=200, help="nvidia-smi sampling period")
    p.add_argument("--save-hlo", default="J-remat,J-remat-nocse,eae",
                   help="variants whose compiled HLO (medium, checking process) goes into hlo_medium.tar.gz")
    p.add_argument("--inject-failure", default="",
                   help="testing aid: VARIANT@CONFIG[#ROUND]:raise|hang|oom,... makes those processes (all, or "
                        "that round's) fail, hang, or fail as out of device memory while preparing")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="every process compiles from scratch (no JAX / inductor caches shared between processes)")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="no reference gradients (no accuracy columns)")
    p.add_argument("--estimate-only", action="store_true", help="print the schedule and its time estimate, run nothing")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--report-from", default=None, metavar="JSON",
                   help="measure nothing: re-render the report of a bench_results.json (or bench_rows.json) "
                        "into --out")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.repeats = args.repeats or (1 if smoke else 3)
    args.steps = args.steps or (3 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    args.jobs = args.jobs or (2 if smoke else 8)
    args.warm_jobs = args.warm_jobs or (2 if smoke else 13)
    args.prep_timeout_s = args.prep_timeout_s or (240.0 if smoke else 300.0)
    args.measure_timeout_s = args.measure_timeout_s or (60.0 if smoke else 120.0)
    args.deadline_s = args.deadline_s or (600.0 if smoke else 470.0)
    args.reserve_s = args.reserve_s if args.reserve_s is not None else (5.0 if smoke else 20.0)
    args.min_batch_s = args.min_batch_s if args.min_batch_s is not None else (10.0 if smoke else 45.0)
    if min(args.steps, args.jobs, args.warm_jobs, args.repeats) < 1 or args.warmup < 0:
        raise SystemExit("--steps, --jobs, --warm-jobs and --repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_from:
        return _rerender(args.report_from, args.out)
    depths = [int(d) for d in args.sweep_depths.split(",")] if args.sweep_depths else None
    groups = bc.configs(args.smoke, depths)
    injections = bp.parse_injections(args.inject_failure)

    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="eae_bench_")
    for sub in ("specs", "logs", "hlo"):
        os.makedirs(os.path.join(workdir, sub), exist_ok=True)
    plan = bp.build_plan(args, groups, workdir, injections)
    est = bp.estimate(plan, args)
    order = [{"order": j.order, "round": j.round, "config": j.cfg.name, "variant": j.variant, "check": j.check}
             for _, jobs in plan for j in jobs if j.role == "timed"]
    say(f"timing order (seed {args.seed}): " + ", ".join(f"{o['variant']}#{o['round']}" for o in order))
    say(f"estimate: {est['batches']} batches, compile+load {est['prep_s']:.0f}s + timing {est['timing_s']:.0f}s + "
        f"startup/report "
        f"{est['startup_s'] + est['report_s']:.0f}s = {est['total_s']:.0f}s (deadline {args.deadline_s:.0f}s; "
        f"planning assumptions, see the results' timeline for what each phase took)")
    if est["total_s"] > args.deadline_s:
        say("WARNING: the estimate exceeds the deadline; the last batches may be skipped")
    if args.estimate_only:
        return 0

    os.makedirs(args.out, exist_ok=True)
    runner = Runner(args, workdir)
    smi = SmiLogger(args.out, args.smi_interval_ms)
    meta = {"argv": sys.argv, "smoke": args.smoke, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "seed": args.seed, "jobs": args.jobs, "warm_jobs": args.warm_jobs,
            "sdpa_backend": args.sdpa_backend,
            "compile_cache": args.compile_cache, "timing_order": order, "estimate": est, "versions": _versions(),
            "gpu": _gpu_info(), "peak_flops": bc.PEAK_BF16_FLOPS, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "started_epoch": runner.t0, "env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "XLA_FLAGS")}}
    say(f"versions {meta['versions']}")
    if meta["gpu"]:
        say(f"gpu {meta['gpu']}")
        if "Exclusive" in meta["gpu"].get("nvidia_smi", ""):
            say("GPU is in an exclusive compute mode: one process at a time (--jobs 1)")
            runner.jobs_limit = 1
    meta["smi"] = smi.start()
    meta["probe"] = runner.probe()
    say(f"probe {meta['probe']}")
    jax_probe = meta["probe"]["jax"]
    if not args.smoke and jax_probe.get("backend") != "gpu":
        say(f"WARNING: JAX backend is {jax_probe.get('backend')!r}, not gpu: the full-size run needs a GPU")

    def write(final=False):
        meta["wall_s"] = time.time() - runner.t0
        meta["timeline"] = runner.timeline
        return br.write_outputs(args.out, runner.results, meta, final=final)

    def save_rows():  # cheap, after every process: what a killed campaign leaves (--report-from reads it)
        meta["wall_s"] = time.time() - runner.t0
        meta["timeline"] = runner.timeline
        br.atomic_write(os.path.join(args.out, "bench_rows.json"),
                        json.dumps({"meta": meta, "rows": runner.results}, default=str))

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    all_jobs = [j for _, jobs in plan for j in jobs]
    try:
        t0 = time.time()
        deepest: Dict[str, bc.StackConfig] = {}  # one weight file set per block shape, deep enough for all
        for j in all_jobs:
            if j.cfg.family not in deepest or j.cfg.depth > deepest[j.cfg.family].depth:
                deepest[j.cfg.family] = j.cfg
        for cfg in deepest.values():
            bc.ensure_weights(workdir, cfg, cfg.depth, threads=os.cpu_count() or 4)
        for j in all_jobs:
            bc.ensure_inputs(workdir, j.cfg)
        runner.timeline.append({"phase": "startup", "s": time.time() - runner.t0, "weights_s": time.time() - t0})
        say(f"weights and inputs ready in {time.time() - t0:.1f}s under {workdir}")
        for gname, jobs in plan:
            runner.run_group(gname, jobs, write, save_rows)
            shutil.rmtree(os.path.join(workdir, "ref"), ignore_errors=True)  # GBs for deep stacks
    finally:
        finish_campaign(runner, all_jobs, smi, meta, workdir, args, save_rows, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
