"""``--profile STEPS``: a `jax.profiler` trace of some training steps and where their time went.

The trace (``<out>/profile/plugins/profile/<run>/*.xplane.pb``, with a
Perfetto ``*.trace.json.gz`` beside it) opens in TensorBoard's profile
plugin or ui.perfetto.dev. The stage table is read back from that trace:

* Every device op event carries its HLO instruction (``hlo_op``) and module.
  The instruction's ``op_name`` in the step's optimized HLO holds the
  `jax.named_scope` path it was traced under: ``forward.<segment>`` and
  ``backward.<segment>`` (`eae_jax.reconstruct`, per block group: the
  embedding, the scanned decoder blocks, the head), ``passes`` (the adjoint
  pass chain, inside the backward), ``loss`` and ``optimizer`` (the training
  step); the innermost one names the stage. Ops of the step outside them
  (gradient sums, metrics) are ``other step ops``; the validation program
  is ``validation``; anything else ``other programs``.
* Host work is marked with `jax.profiler.TraceAnnotation` (``eae.host.*``:
  drawing and placing the batch, dispatching the step, waiting for it, logging and
  validation, checkpoints, and around them the training loop's own Python).
* Each profiled step's window (its `jax.profiler.StepTraceAnnotation`) is
  swept: an instant where device ops run goes to their stages (shared when
  several stages run at once); an instant between the step program's first
  and last op with no op running is ``device idle between ops``; else to the innermost
  host annotation; else it stays unattributed. The stages are therefore
  measured, not the step time's remainder: the table prints their sum beside
  the step time measured on the host (`time.perf_counter`) and the
  unattributed rest.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import time
from typing import Dict, List, Optional, Tuple

#: Prefix of the host annotations (``eae.host.batch`` ...).
HOST_PREFIX = "eae.host."
#: Name of the step annotations (TensorBoard's step view reads them).
STEP_NAME = "train"
_SCOPE = re.compile(r"(?<![\w.])(passes|optimizer|loss|(?:forward|backward)\.[^/()]+)")
IDLE = "device idle between ops"
OTHER_STEP = "other step ops"
VALIDATION = "validation"
OTHER_PROGRAMS = "other programs"
UNATTRIBUTED = "unattributed"
#: The host annotation around a step's loop body; finer ones nest inside it.
LOOP = "training loop"


def parse_profile_steps(spec: str) -> Tuple[int, int]:
    """``(first, last)`` steps (inclusive, 1-based) of a ``--profile`` spec ``'N'`` or ``'FIRST:LAST'``.

    Step 1 compiles the step function: profiles start at step 2 or later.

    Raises:
      ValueError: a malformed spec, ``last < first`` or ``first < 2``.

    Example:
      >>> from eae_jax.train.profile import parse_profile_steps
      >>> parse_profile_steps("3:5"), parse_profile_steps("7")
      ((3, 5), (7, 7))
      >>> parse_profile_steps("1:3")
      Traceback (most recent call last):
      ...
      ValueError: --profile 1:3: profiles start at step 2 or later (step 1 compiles the step function)
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", spec or "")
    if not m:
        raise ValueError(f"--profile {spec!r}: expected STEP or FIRST:LAST, e.g. 3:5")
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) else first
    if first < 2:
        raise ValueError(f"--profile {spec}: profiles start at step 2 or later (step 1 compiles the step function)")
    if last < first:
        raise ValueError(f"--profile {spec}: the last step {last} comes before the first {first}")
    return first, last


def hlo_scopes(hlo_text: str) -> Dict[str, str]:
    """Instruction name -> its ``op_name`` metadata, from optimized HLO text.

    Example:
      >>> from eae_jax.train.profile import hlo_scopes
      >>> hlo_scopes('  %fusion.3 = f32[2] fusion(%p), metadata={op_name="jit(f)/optimizer/add" source_line=3}')
      {'fusion.3': 'jit(f)/optimizer/add'}
    """
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^\n]*?metadata=\{[^\n]*?op_name=\"([^\"]*)\"",
                         hlo_text, re.M):
        out[m.group(1)] = m.group(2)
    return out


def stage_of(op_name: Optional[str]) -> str:
    """The stage an op belongs to: its innermost named scope of the step (see the module doc).

    Example:
      >>> from eae_jax.train.profile import stage_of
      >>> stage_of("jit(step)/transpose(jvp(backward.decoder_block))/while/body/passes/round")
      'passes'
      >>> stage_of("jit(step)/jvp(forward.lm_head[2])/dot_general"), stage_of("jit(step)/add")
      ('forward lm_head[2]', 'other step ops')
    """
    found = _SCOPE.findall(op_name or "")
    if not found:
        return OTHER_STEP
    return found[-1].replace(".", " ", 1)


def module_name(hlo_text: str) -> Optional[str]:
    """The module name of HLO text (``HloModule jit_step, ...``), or None.

    Example:
      >>> from eae_jax.train.profile import module_name
      >>> module_name("HloModule jit_step, is_scheduled=true"), module_name("")
      ('jit_step', None)
    """
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return m.group(1) if m else None


def find_trace(directory: str) -> Optional[str]:
    """The newest ``*.xplane.pb`` under ``directory`` (None when there is none).

    Example:
      >>> import tempfile
      >>> from eae_jax.train.profile import find_trace
      >>> find_trace(tempfile.mkdtemp()) is None
      True
    """
    found = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def read_trace(path: str) -> dict:
    """The events of an xplane trace that `stage_table` sweeps, read with `jax.profiler.ProfileData`.

    Returns ``{"device": [(start_ns, end_ns, module, hlo_op)], "host": [(start_ns, end_ns, name)],
    "steps": {step: (start_ns, end_ns)}}``. Device events are leaves (an op
    event containing another of its line, a while loop say, is left out);
    on a plane with an ``XLA Ops`` line (GPUs) only that line is read.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp
      >>> from eae_jax.train.profile import find_trace, read_trace
      >>> def f(x):
      ...     return jnp.sin(x) @ x
      >>> step, x = jax.jit(f), jnp.ones((8, 8))
      >>> _ = step(x)
      >>> folder = tempfile.mkdtemp()
      >>> with jax.profiler.trace(folder):
      ...     with jax.profiler.StepTraceAnnotation("train", step_num=1):
      ...         _ = step(x).block_until_ready()
      >>> events = read_trace(find_trace(folder))
      >>> list(events["steps"]), "jit_f" in {module for _, _, module, _ in events["device"]}
      ([1], True)
    """
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    device, host, steps = [], [], {}
    for plane in data.planes:
        lines = list(plane.lines)
        if any(line.name == "XLA Ops" for line in lines):
            lines = [line for line in lines if line.name == "XLA Ops"]
        for line in lines:
            ops = []
            for event in line.events:
                start, end = event.start_ns, event.start_ns + event.duration_ns
                if event.name == STEP_NAME or event.name.startswith(HOST_PREFIX):
                    stats = dict(event.stats)
                    if event.name == STEP_NAME and "step_num" in stats:
                        steps[int(stats["step_num"])] = (start, end)
                    elif event.name != STEP_NAME:
                        host.append((start, end, event.name[len(HOST_PREFIX):]))
                    continue
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    ops.append((start, end, str(stats.get("hlo_module", "")), str(stats["hlo_op"])))
            device += _leaves(ops)
    return {"device": device, "host": host, "steps": steps}


def _leaves(events: list) -> list:
    """Events of one line that contain no other event of it."""
    events = sorted(events, key=lambda e: (e[0], -e[1]))
    keep = [True] * len(events)
    open_ = []  # indices of events that may still contain later ones
    for i, (start, end, *_rest) in enumerate(events):
        while open_ and events[open_[-1]][1] <= start:
            open_.pop()
        if open_ and end <= events[open_[-1]][1]:
            keep[open_[-1]] = False
        open_.append(i)
    return [e for e, k in zip(events, keep) if k]


def stage_table(trace: dict, scopes: Dict[str, str], step_module: str, eval_module: Optional[str],
                steps: List[int]) -> Dict[str, float]:
    """Seconds per stage, summed over ``steps``, by sweeping each step's window (see the module doc).

    ``scopes`` maps the step program's instructions to their op names
    (`hlo_scopes`); ``step_module`` / ``eval_module`` name the training step
    and validation programs (``jit_step`` ...).

    Example (two ops of the step and a host annotation in a 10 ns window):
      >>> from eae_jax.train.profile import stage_table
      >>> trace = {"steps": {2: (0, 10)}, "host": [(0, 2, "batch")],
      ...          "device": [(2, 5, "jit_step", "dot.1"), (6, 9, "jit_step", "add.2")]}
      >>> scopes = {"dot.1": "jit(step)/jvp(forward.decoder_block)/dot", "add.2": "jit(step)/optimizer/add"}
      >>> {k: round(v * 1e9) for k, v in stage_table(trace, scopes, "jit_step", None, [2]).items()}
      {'forward decoder_block': 3, 'optimizer': 3, 'device idle between ops': 1, 'host: batch': 2, 'unattributed': 1}
    """
    totals: Dict[str, float] = collections.defaultdict(float)
    for step in steps:
        if step not in trace["steps"]:
            raise ValueError(f"the trace holds no annotation of step {step}")
        w0, w1 = trace["steps"][step]
        dev, own = [], []
        for start, end, module, op in trace["device"]:
            if end <= w0 or start >= w1:
                continue
            if module == step_module:
                label = stage_of(scopes.get(op))
                own.append((max(start, w0), min(end, w1)))
            elif module == eval_module:
                label = VALIDATION
            else:
                label = OTHER_PROGRAMS
            dev.append((max(start, w0), min(end, w1), label))
        host = [(max(s, w0), min(e, w1), "host: " + n) for s, e, n in trace["host"] if e > w0 and s < w1]
        # The step program's device activity: a gap inside it is the device idling mid-step.
        span = (min(s for s, _ in own), max(e for _, e in own)) if own else None
        for label, ns in _sweep(w0, w1, dev, host, span).items():
            totals[label] += ns * 1e-9
    return dict(sorted(totals.items(), key=_stage_order))


def _sweep(w0: int, w1: int, dev: list, host: list, span) -> Dict[str, float]:
    """Attribute every instant of ``[w0, w1)`` (see the module doc); nanoseconds per label."""
    marks = collections.defaultdict(list)
    for kind, events in (("dev", dev), ("host", host)):
        for i, (s, e, label) in enumerate(events):
            if e > s:
                marks[s].append((kind, +1, label, i))
                marks[e].append((kind, -1, label, i))
    times = sorted(set(marks) | {w0, w1})
    active_dev: Dict[str, int] = collections.Counter()
    active_host: Dict[int, Tuple[int, str]] = {}
    out: Dict[str, float] = collections.defaultdict(float)
    for t0, t1 in zip(times, times[1:]):
        for kind, sign, label, i in marks.get(t0, ()):
            if kind == "dev":
                active_dev[label] += sign
                if not active_dev[label]:
                    del active_dev[label]
            elif sign > 0:
                active_host[i] = (t0, label)
            else:
                active_host.pop(i, None)
        dt = t1 - t0
        if dt <= 0:
            continue
        if active_dev:
            count = sum(active_dev.values())
            for label, n in active_dev.items():
                out[label] += dt * n / count
        elif span is not None and span[0] <= t0 and t1 <= span[1]:
            out[IDLE] += dt
        elif active_host:
            out[max(active_host.values())[1]] += dt  # the innermost: the latest started
        else:
            out[UNATTRIBUTED] += dt
    return dict(out)


def format_table(stages: Dict[str, float], steps: int, measured_s: float) -> str:
    """The per-stage table a run prints: milliseconds per step and shares of the measured step time.

    Example:
      >>> from eae_jax.train.profile import format_table
      >>> print(format_table({"forward decoder_block": 0.006, "host: batch": 0.002, "unattributed": 0.002},
      ...                    steps=2, measured_s=0.010))
      stage                      ms/step  % of step
      forward decoder_block        3.000       60.0
      host: batch                  1.000       20.0
      sum of stages                4.000       80.0
      measured step time           5.000      100.0
      unattributed (trace)         1.000       20.0
    """
    per = measured_s / steps * 1e3
    rows = [(k, v / steps * 1e3) for k, v in sorted(stages.items(), key=_stage_order) if k != UNATTRIBUTED]
    total = sum(v for _, v in rows)
    lines = [f"{'stage':<26} {'ms/step':>7}  % of step"]
    lines += [f"{name:<26} {ms:>8.3f} {100 * ms / per:>10.1f}" for name, ms in rows]
    lines.append(f"{'sum of stages':<26} {total:>8.3f} {100 * total / per:>10.1f}")
    lines.append(f"{'measured step time':<26} {per:>8.3f} {100.0:>10.1f}")
    rest = stages.get(UNATTRIBUTED, 0.0) / steps * 1e3
    lines.append(f"{'unattributed (trace)':<26} {rest:>8.3f} {100 * rest / per:>10.1f}")
    return "\n".join(lines)


def _stage_order(item) -> tuple:
    name = item[0]
    order = ["forward", "loss", "backward", "passes", OTHER_STEP, "optimizer", IDLE, VALIDATION, OTHER_PROGRAMS,
             "host:"]
    rank = next((i for i, prefix in enumerate(order) if name.startswith(prefix)), len(order))
    return rank, name


class StepProfiler:
    """Traces the steps of a ``--profile`` spec and reports their stage table.

    The training loop calls `begin` / `end` around every step, `host` around
    host work, and `set_step_program` with the step's compiled HLO text once
    the step is built; everything is a no-op outside the profiled steps.
    `result` holds the table (as a dict) once the last profiled step ended.

    Example:
      >>> import tempfile
      >>> from eae_jax.train.profile import StepProfiler
      >>> prof = StepProfiler("3:4", tempfile.mkdtemp(), log_fn=print)
      >>> prof.tracing, [prof.wants(s) for s in (2, 3, 4, 5)]
      (False, [False, True, True, False])
    """

    def __init__(self, spec: str, directory: str, log_fn):
        self.first, self.last = parse_profile_steps(spec)
        self.directory, self.log_fn = directory, log_fn
        self.tracing, self.result = False, None
        self._step_ctx, self._loop_ctx, self._t0, self._times = None, None, None, {}
        self.step_text = self.step_module = self.eval_module = None

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last

    def set_programs(self, step_hlo_text: str, eval_module: Optional[str] = None) -> None:
        """The optimized HLO text of the step program (its instructions' scopes) and the
        validation program's module name."""
        self.step_text, self.step_module, self.eval_module = step_hlo_text, module_name(step_hlo_text), eval_module

    def begin(self, step: int) -> None:
        if not self.wants(step):
            return
        import jax

        if not self.tracing:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.tracing = True
        self._step_ctx = jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step)
        self._step_ctx.__enter__()
        # The loop's own Python between the finer annotations (checks, metrics, progress).
        self._loop_ctx = jax.profiler.TraceAnnotation(HOST_PREFIX + LOOP)
        self._loop_ctx.__enter__()
        self._t0 = time.perf_counter()

    def _close_loop(self) -> None:
        if self._loop_ctx is not None:
            self._loop_ctx.__exit__(None, None, None)
            self._loop_ctx = None

    def host(self, name: str):
        """A context marking host work ``name`` (a no-op when not tracing)."""
        import contextlib

        if not self.tracing:
            return contextlib.nullcontext()
        import jax

        return jax.profiler.TraceAnnotation(HOST_PREFIX + name)

    def end(self, step: int, sync=None) -> None:
        """Close step ``step``'s window after waiting for ``sync`` (the new state) to be computed."""
        if self._step_ctx is None or not self.wants(step):
            return
        import jax

        self._close_loop()
        if sync is not None:
            # The host idles here until the device is done: time the trace shows as this wait.
            with self.host("wait for the step"):
                jax.block_until_ready(sync)
        self._times[step] = time.perf_counter() - self._t0
        self._step_ctx.__exit__(None, None, None)
        self._step_ctx = None
        if step >= self.last:
            self.finish()

    def finish(self) -> None:
        """Stop the trace (if running) and build, print and save the table."""
        if not self.tracing:
            return
        import jax

        self._close_loop()
        if self._step_ctx is not None:
            self._step_ctx.__exit__(None, None, None)
            self._step_ctx = None
        jax.profiler.stop_trace()
        self.tracing = False
        path = find_trace(self.directory)
        steps = sorted(self._times)
        if path is None or not steps:
            self.log_fn(f"profile: no trace of steps {self.first}-{self.last} was written")
            return
        stages = stage_table(read_trace(path), hlo_scopes(self.step_text or ""), self.step_module,
                             self.eval_module, steps)
        measured = sum(self._times[s] for s in steps)
        table = format_table(stages, len(steps), measured)
        self.result = {"trace": path, "steps": steps, "measured_step_s": measured / len(steps),
                       "stages_s": {k: v / len(steps) for k, v in stages.items()}}
        with open(os.path.join(self.directory, "stages.json"), "w") as f:
            json.dump(self.result, f, indent=2)
        self.log_fn(f"profile of steps {steps[0]}-{steps[-1]} ({len(steps)} steps; trace {path}):\n{table}")
