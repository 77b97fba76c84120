"""What a training run shows and writes besides its checkpoints.

`RunMonitor` is the training loop's one companion: it times the compilation
("compiling the train step ..."), draws the progress bar, runs the
validation loss, adds to each log record the learning rate, tokens/s, model
TFLOP/s, MFU and peak device memory (`eae_jax.train.metrics`), prints the
record's line, writes it to TensorBoard, drives ``--profile``, and at the end
plots the losses and writes the summary (`eae_jax.train.report`).

Throughput counts training steps only: the window's wall time less the time
spent compiling and validating in it (``step_seconds``; ``seconds`` is the
whole window, as before).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.models.llama import cross_entropy, lm_apply
from eae_jax.train.metrics import flops_per_token, format_bytes, peak_memory_bytes, peak_tflops, throughput
from eae_jax.train.profile import module_name
from eae_jax.train.progress import CompileTimer, Progress, show_bar
from eae_jax.train.rundir import naming_writes
from eae_jax.train.shapes import describe_shape


def validation_loss_fn(model) -> Callable:
    """A jitted ``f(params, tokens) -> mean loss`` over int ``(batches, batch, seq_len + 1)``
    held-out tokens: the plain forward (`lm_apply`) in the model's compute dtype.

    Example:
      >>> import jax
      >>> from eae_jax.models import init_lm
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.monitor import validation_loss_fn
      >>> model = TrainConfig(preset="tiny", seq_len=8).model()
      >>> tokens = jax.random.randint(jax.random.key(0), (2, 3, 9), 0, model.vocab_size)
      >>> loss = validation_loss_fn(model)(init_lm(jax.random.key(1), model), tokens)
      >>> loss.shape, bool(loss > 0)
      ((), True)
    """

    def validation_loss(params, tokens):
        def one(batch):
            return cross_entropy(lm_apply(params, batch[:, :-1], model), batch[:, 1:])

        return jnp.mean(jax.lax.map(one, tokens))

    return jax.jit(validation_loss)


class RunMonitor:
    """Progress, metrics, validation, TensorBoard, profile and summary of one training invocation.

    The loop calls, in order: `start` (a fresh run's step-0 validation),
    per step `begin_step`, `host("batch")` around drawing the batch,
    `run_step` for the step itself, `measure` and `report` at log steps
    (`wants_log` adds the validation steps), `end_step`; then `finish` for
    the summary and, in any case, `close`.

    Example:
      >>> import tempfile
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.monitor import RunMonitor
      >>> from eae_jax.train.rundir import JsonlLog
      >>> cfg = TrainConfig(preset="tiny", out=tempfile.mkdtemp(), val_every=5, tensorboard=False)
      >>> mon = RunMonitor(cfg, cfg.model(), None, JsonlLog(cfg.out + "/log.jsonl"), 0, 20, log_fn=print)
      >>> [mon.wants_log(s) for s in (5, 10, 20)]      # no held-out tokens: no validation steps
      [False, False, False]
      >>> mon.close()
    """

    def __init__(self, cfg, model, val_tokens, log, start_step: int, last_step: int, log_fn=print,
                 devices: int = 1, stream=None):
        from eae_jax.train.loop import lr_schedule

        self.cfg, self.model, self.log = cfg, model, log
        self.start_step, self.last_step, self.devices = start_step, last_step, devices
        self._log_fn = log_fn
        self.val = None if val_tokens is None or not cfg.val_every else np.asarray(val_tokens)
        self.bar = Progress(last_step, show_bar(cfg.quiet, stream), stream)
        self.flops_token = flops_per_token(model, cfg.seq_len)
        self.peak = peak_tflops(jax.local_devices()[0].device_kind, cfg.dtype, cfg.peak_tflops)
        self.schedule = lr_schedule(cfg)
        self.tb = self._open_tensorboard()
        self.tb_dir = None if self.tb is None else self.tb.directory
        self.profiler = None
        if cfg.profile:
            from eae_jax.train.profile import StepProfiler

            self.profiler = StepProfiler(cfg.profile, os.path.join(cfg.out, "profile"), self.write)
        self._eval = None
        self.val_s = self.train_s = 0.0
        # Every compilation of the invocation is timed (the step's, the batch helpers', validation's).
        self.compiling = CompileTimer().__enter__()
        self.t_start = time.perf_counter()
        self._window = self._new_window(self.t_start, start_step)
        self._compiled = False
        self.last_val = None

    def _new_window(self, t: float, step: int) -> dict:
        """A throughput window from ``t`` / ``step``: validation time and compile time outside it are
        counted separately so that both come out of it once."""
        return {"t": t, "step": step, "val": 0.0, "compile0": self.compiling.seconds, "val_compile": 0.0}

    # ------------------------------------------------------------------ output
    def write(self, line: str) -> None:
        """Log ``line`` (above the progress bar when it shows)."""
        self.bar.write(self._log_fn, line)

    def _open_tensorboard(self):
        if self.cfg.tensorboard is False:
            return None
        from eae_jax.train.report import MissingExtra, TensorBoardLog

        try:
            return TensorBoardLog(os.path.join(self.cfg.out, "tensorboard"))
        except MissingExtra as err:
            if self.cfg.tensorboard:
                raise
            self.write(f"note: no TensorBoard files ({err})")
            return None

    # ------------------------------------------------------------------ steps
    def start(self, state) -> None:
        """A fresh run: validate the initial params (the step-0 record the curves start from)."""
        if self.start_step != 0 or self.val is None:
            return
        record = {"step": 0, "val_loss": self.validate(state.params), "lr": float(self.schedule(0))}
        with naming_writes(0, self.log.path):
            self.log.write(record)
        self.report(record)
        self._window = self._new_window(time.perf_counter(), 0)

    def begin_step(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.begin(step)

    def host(self, name: str):
        """A context marking host work for ``--profile`` (nothing otherwise)."""
        return self.profiler.host(name) if self.profiler is not None else contextlib.nullcontext()

    def run_step(self, step_fn, state, tokens):
        """``step_fn(state, tokens)``; the first call compiles first, with a notice and its time."""
        if not self._compiled and hasattr(step_fn, "lower"):
            shape = describe_shape(self.cfg.shape, self.model.num_params())
            self.write(f"compiling the train step ({shape}) ...")
            before = self.compiling.seconds
            compiled = step_fn.lower(state, tokens).compile()  # the call below reuses it
            self.write(f"compiled in {self.compiling.seconds - before:.1f}s")
            if self.profiler is not None:
                eval_text = "" if self.val is None else \
                    self._eval_fn().lower(state.params, self.val).compile().as_text()
                self.profiler.set_programs(compiled.as_text(), module_name(eval_text))
        self._compiled = True
        with self.host("dispatch"):
            return step_fn(state, tokens)

    def end_step(self, step: int, state) -> None:
        self.bar.update(step)
        if self.profiler is not None:
            self.profiler.end(step, sync=state)

    # ------------------------------------------------------------------ records
    def validates(self, step: int) -> bool:
        every = self.cfg.val_every
        return self.val is not None and (step % every == 0 or step == self.last_step)

    def wants_log(self, step: int) -> bool:
        """Whether ``step`` must be logged beyond ``--log-every``: it validates."""
        return self.validates(step)

    def _eval_fn(self):
        if self._eval is None:
            self._eval = validation_loss_fn(self.model)
        return self._eval

    def validate(self, params) -> float:
        """The validation loss of ``params`` (its time is kept out of the throughput)."""
        t0, c0 = time.perf_counter(), self.compiling.seconds
        with self.host("validation"):
            loss = float(self._eval_fn()(params, self.val))
        spent = time.perf_counter() - t0
        self.val_s += spent
        self._window["val"] += spent
        self._window["val_compile"] += self.compiling.seconds - c0
        self.last_val = loss
        return loss

    def measure(self, step: int, state) -> dict:
        """The fields `measure` adds to the log record of ``step``: ``lr``, ``val_loss`` (on
        validation steps), ``seconds``, ``step_seconds``, ``tokens_per_s``, ``tflops``, ``mfu``
        and ``peak_memory_bytes`` (None where not measurable)."""
        with self.host("log"):
            out = {"lr": float(self.schedule(step - 1))}
            if self.validates(step):
                out["val_loss"] = self.validate(state.params)
            now = time.perf_counter()
            w = self._window
            wall = now - w["t"]
            compile_s = self.compiling.seconds - w["compile0"] - w["val_compile"]
            step_s = wall - w["val"] - compile_s
            steps = step - w["step"]
            self.train_s += max(step_s, 0.0)
            out.update(seconds=wall, step_seconds=step_s)
            if steps > 0 and step_s > 0:
                out.update(throughput(steps * self.cfg.batch * self.cfg.seq_len, step_s, self.flops_token, self.peak,
                                      self.devices))
            else:
                out.update(tokens_per_s=None, tflops=None, mfu=None)
            out["peak_memory_bytes"] = peak_memory_bytes(jax.local_devices())
            self._window = self._new_window(now, step)
        return out

    def report(self, record: dict) -> None:
        """Print ``record``'s line (unless quiet), update the bar and write TensorBoard."""
        if self.tb is not None:
            self.tb.write(record)
        if record["step"] > self.start_step:  # the bar shows from the first step on (see Progress)
            self.bar.update(record["step"], loss=_short(record.get("loss")), val=_short(self.last_val),
                            tok_s=None if record.get("tokens_per_s") is None else f"{record['tokens_per_s']:,.0f}")
        if not self.cfg.quiet:
            self.write(self.line(record))

    def line(self, record: dict) -> str:
        """The printed line of a log record.

        Example:
          >>> import tempfile
          >>> from eae_jax.train import TrainConfig
          >>> from eae_jax.train.monitor import RunMonitor
          >>> from eae_jax.train.rundir import JsonlLog
          >>> cfg = TrainConfig(preset="tiny", out=tempfile.mkdtemp(), tensorboard=False)
          >>> mon = RunMonitor(cfg, cfg.model(), None, JsonlLog(cfg.out + "/log.jsonl"), 0, 200)
          >>> mon.line({"step": 10, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0,
          ...           "tflops": 0.002, "mfu": None, "peak_memory_bytes": None})
          'step 10/200  loss 2.5000  lr 1.00e-03  grad 0.500  1,234 tok/s  0.0020 TFLOP/s  MFU n/a  mem n/a'
          >>> mon.close()
        """
        parts = [f"step {record['step']}/{self.last_step}"]
        if record.get("loss") is not None:
            parts.append(f"loss {record['loss']:.4f}")
        if record.get("val_loss") is not None:
            parts.append(f"val {record['val_loss']:.4f}")
        if record.get("lr") is not None:
            parts.append(f"lr {record['lr']:.2e}")
        if record.get("grad_norm") is not None:
            parts.append(f"grad {record['grad_norm']:.3f}")
        if record.get("tokens_per_s") is not None:
            parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
            parts.append(f"{record['tflops']:.4f} TFLOP/s")
            parts.append("MFU n/a" if record.get("mfu") is None else f"MFU {100 * record['mfu']:.1f}%")
        if "peak_memory_bytes" in record:
            parts.append(f"mem {format_bytes(record['peak_memory_bytes'])}")
        return "  ".join(parts)

    # ------------------------------------------------------------------ the end
    def finish(self, steps_run: int) -> dict:
        """Close the outputs, plot, print the summary lines; returns the summary's new fields:
        ``wall_s, compile_s, validation_s, tokens, tokens_per_s``, the losses of `report.summarize`,
        and the paths ``plot``, ``tensorboard``, ``profile`` (None when not written)."""
        from eae_jax.train.report import MissingExtra, plot_losses, summarize, summary_lines

        self.close()
        tokens = steps_run * self.cfg.batch * self.cfg.seq_len
        out = {"wall_s": time.perf_counter() - self.t_start, "compile_s": self.compiling.seconds,
               "validation_s": self.val_s, "tokens": tokens,
               "tokens_per_s": tokens / self.train_s if self.train_s > 0 and tokens else None}
        records = self.log.records()
        out.update({k: v for k, v in summarize(records).items() if k not in ("first_loss", "final_loss")})
        out["plot"] = None
        if self.cfg.plot and records:
            path = os.path.join(self.cfg.out, "loss.png")
            try:
                with naming_writes(self.last_step, path):
                    out["plot"] = plot_losses(records, path, title=self.cfg.out)
            except MissingExtra as err:
                self.write(f"note: no plot ({err})")
            except ValueError:
                pass  # no losses logged: nothing to plot
        out["tensorboard"] = self.tb_dir
        out["profile"] = self.profiler.result["trace"] if self.profiler is not None and self.profiler.result \
            else None
        if not self.cfg.quiet:
            losses = summarize(records)
            shown = dict(out, steps_run=steps_run, first_loss=losses["first_loss"], final_loss=losses["final_loss"])
            for line in summary_lines(shown):
                self._log_fn(line)
        return out

    def close(self) -> None:
        """Stop a running profile, close the bar and the TensorBoard files (safe to call twice)."""
        if self.profiler is not None:
            self.profiler.finish()
        self.compiling.__exit__(None, None, None)
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _short(value: Optional[float]) -> Optional[str]:
    return None if value is None else f"{value:.4f}"

