"""What a person watching a run sees: a progress bar with its ETA, and how long compiling took.

The bar (tqdm, on stderr) shows only when stderr is a terminal and the run
is not quiet; lines logged while it shows are written above it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Optional

#: jax.monitoring events whose durations make up a compilation (tracing, lowering, XLA).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileTimer:
    """Seconds JAX spent compiling while the timer was active, from `jax.monitoring` events.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.train.progress import CompileTimer
      >>> with CompileTimer() as timer:
      ...     _ = jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3))
      >>> timer.seconds > 0, timer.compilations >= 1
      (True, True)
    """

    def __init__(self):
        self.seconds, self.compilations = 0.0, 0
        self._lock, self._listening = threading.Lock(), False

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                self.seconds += duration
                self.compilations += event == COMPILE_EVENTS[-1]

    def __enter__(self) -> "CompileTimer":
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        self._listening = True
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring

        if self._listening:  # exiting twice is harmless
            jax.monitoring.unregister_event_duration_listener(self._listen)
            self._listening = False


def show_bar(quiet: bool, stream=None) -> bool:
    """Whether to draw a progress bar: not ``quiet`` and ``stream`` (stderr) is a terminal.

    Example:
      >>> import io
      >>> from eae_jax.train.progress import show_bar
      >>> show_bar(False, io.StringIO()), show_bar(True, io.StringIO())
      (False, False)
    """
    stream = sys.stderr if stream is None else stream
    return not quiet and bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """A step progress bar (tqdm) with an ETA, or nothing when ``enabled`` is False.

    The bar appears at the first `update` (after the first step, whose
    compilation would otherwise skew the rate and the ETA). ``update(step,
    **postfix)`` moves it to ``step`` and shows the postfix values (loss,
    validation loss, tokens/s ...); ``write(log_fn, line)`` logs a line above it.

    Example:
      >>> import io
      >>> from eae_jax.train.progress import Progress
      >>> out = io.StringIO()
      >>> bar = Progress(total=10, enabled=True, stream=out)
      >>> bar.update(1)
      >>> bar.update(4, loss=2.5)
      >>> bar.close()
      >>> "4/10" in out.getvalue() and "loss=2.5" in out.getvalue()
      True
    """

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.enabled, self.bar, self._at = total, enabled, None, None
        self.stream = sys.stderr if stream is None else stream

    def update(self, step: int, **postfix) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=step, unit="step", dynamic_ncols=True, leave=True,
                            file=self.stream, smoothing=0.1)
            self._at = step
        if postfix:
            self.bar.set_postfix({k: v for k, v in postfix.items() if v is not None}, refresh=False)
        self.bar.update(step - self._at)
        self._at = step

    def write(self, log_fn: Callable[[str], None], line: str) -> None:
        if self.bar is None:
            log_fn(line)
            return
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self.bar.fp):
            log_fn(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.enabled = None, False


@contextlib.contextmanager
def stopwatch():
    """Yield a dict whose ``seconds`` holds the block's wall time once it ends.

    Example:
      >>> from eae_jax.train.progress import stopwatch
      >>> with stopwatch() as t:
      ...     pass
      >>> t["seconds"] >= 0
      True
    """
    out = {"seconds": None}
    start = time.perf_counter()
    try:
        yield out
    finally:
        out["seconds"] = time.perf_counter() - start


def format_duration(seconds: Optional[float]) -> str:
    """``'1h02m03s'``, ``'2m05s'`` or ``'4.2s'``.

    Example:
      >>> from eae_jax.train.progress import format_duration
      >>> format_duration(3723), format_duration(125.2), format_duration(4.24)
      ('1h02m03s', '2m05s', '4.2s')
    """
    if seconds is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
