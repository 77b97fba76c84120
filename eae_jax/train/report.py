"""A run's records as TensorBoard scalars, a loss plot and a closing summary.

* `TensorBoardLog`: event files under ``<out>/tensorboard`` through
  tensorboardX (the ``tb`` extra), one scalar per numeric field of a record.
* `plot_losses`: ``<out>/loss.png`` of the training and validation losses
  (matplotlib, the ``plot`` extra), written atomically.
* `summarize`: the run's losses, best validation loss, tokens and times,
  from its records.
"""

from __future__ import annotations

import io
import math
from typing import Iterable, List, Optional

from eae_jax.fileio import atomic_write_bytes

#: Record fields written to TensorBoard, and their tags.
TB_TAGS = {"loss": "loss/train", "val_loss": "loss/validation", "lr": "optim/learning_rate",
           "grad_norm": "optim/grad_norm", "tokens_per_s": "speed/tokens_per_s", "tflops": "speed/model_tflops",
           "mfu": "speed/mfu", "peak_memory_bytes": "memory/peak_bytes"}


class MissingExtra(ImportError):
    """An optional package a requested output needs is not installed (the message says which extra).

    Example:
      >>> from eae_jax.train.report import MissingExtra
      >>> issubclass(MissingExtra, ImportError)
      True
    """


def require_tensorboard() -> None:
    """Raise `MissingExtra` unless tensorboardX (the ``tb`` extra) can be imported.

    Example:
      >>> from eae_jax.train.report import require_tensorboard
      >>> require_tensorboard()      # installed here: nothing happens
    """
    try:
        import tensorboardX  # noqa: F401
    except ImportError as err:
        raise MissingExtra("TensorBoard files need tensorboardX: pip install 'eae-jax[tb]' "
                           "(or pass --no-tensorboard)") from err


class TensorBoardLog:
    """Scalars of every record into TensorBoard event files (tensorboardX's SummaryWriter).

    Raises:
      MissingExtra: tensorboardX is not installed.

    Example:
      >>> import os, tempfile
      >>> from eae_jax.train.report import TensorBoardLog
      >>> folder = tempfile.mkdtemp()
      >>> tb = TensorBoardLog(folder)
      >>> tb.write({"step": 1, "loss": 2.5, "lr": 1e-3, "mfu": None})
      >>> tb.close()
      >>> any(name.startswith("events.out.tfevents") for name in os.listdir(folder))
      True
    """

    def __init__(self, directory: str):
        require_tensorboard()
        from tensorboardX import SummaryWriter

        self.directory = directory
        self.writer = SummaryWriter(directory, flush_secs=10)

    def write(self, record: dict) -> None:
        step = record.get("step")
        for field, tag in TB_TAGS.items():
            value = record.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


def _series(records: Iterable[dict], field: str) -> tuple:
    """``(steps, values)`` of the records holding a finite number under ``field``."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    points = [(r["step"], r[field]) for r in records if isinstance(r.get("step"), int) and number(r.get(field))]
    return [p[0] for p in points], [p[1] for p in points]


def plot_losses(records: List[dict], path: str, title: str = "") -> str:
    """Plot the training (``loss``) and validation (``val_loss``) curves of ``records`` into a PNG.

    Uses matplotlib's object API (no pyplot state); the file is written to a
    temporary name beside ``path`` and renamed into place.

    Raises:
      MissingExtra: matplotlib is not installed.
      ValueError: no record holds a loss.

    Example:
      >>> import os, tempfile
      >>> from eae_jax.train.report import plot_losses
      >>> path = os.path.join(tempfile.mkdtemp(), "loss.png")
      >>> records = [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 5.1}, {"step": 2, "loss": 4.0, "val_loss": 4.2}]
      >>> open(plot_losses(records, path), "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
      True
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MissingExtra("the loss plot needs matplotlib: pip install 'eae-jax[plot]' (or pass --no-plot)") from err
    train, val = _series(records, "loss"), _series(records, "val_loss")
    if not train[0] and not val[0]:
        raise ValueError("no record holds a loss to plot")
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train[0]:
        ax.plot(train[0], train[1], label="train", color="tab:blue", linewidth=1.2)
    if val[0]:
        ax.plot(val[0], val[1], label="validation", color="tab:orange", marker="o", markersize=3, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    atomic_write_bytes(path, png.getvalue())
    return path


def summarize(records: List[dict]) -> dict:
    """The run's story from its log records: ``first_loss``, ``final_loss``, ``first_val_loss``,
    ``final_val_loss``, ``best_val_loss`` and ``best_val_step`` (None where absent), and
    ``val_loss_drop`` (the fraction the validation loss fell from its first value to its best).

    Example:
      >>> from eae_jax.train.report import summarize
      >>> s = summarize([{"step": 0, "val_loss": 5.0}, {"step": 10, "loss": 3.0, "val_loss": 2.0},
      ...                {"step": 20, "loss": 2.5, "val_loss": 2.5}])
      >>> s["best_val_loss"], s["best_val_step"], s["val_loss_drop"], s["final_loss"]
      (2.0, 10, 0.6, 2.5)
    """
    steps, losses = _series(records, "loss")
    val_steps, vals = _series(records, "val_loss")
    out = {"first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
           "first_val_loss": vals[0] if vals else None, "final_val_loss": vals[-1] if vals else None,
           "best_val_loss": None, "best_val_step": None, "val_loss_drop": None}
    if vals:
        best = min(range(len(vals)), key=lambda i: vals[i])
        out.update(best_val_loss=vals[best], best_val_step=val_steps[best])
        if vals[0] > 0:
            out["val_loss_drop"] = round(1.0 - vals[best] / vals[0], 12)
    return out


def summary_lines(summary: dict, out: Optional[str] = None) -> List[str]:
    """The closing summary a person reads (the JSON line follows it).

    Example:
      >>> from eae_jax.train.report import summary_lines
      >>> lines = summary_lines({"steps_run": 3, "wall_s": 5.0, "compile_s": 2.0, "tokens": 3000,
      ...                        "tokens_per_s": 1000.0, "first_loss": 5.0, "final_loss": 4.0,
      ...                        "first_val_loss": 5.1, "best_val_loss": 4.2, "best_val_step": 3,
      ...                        "val_loss_drop": 0.176, "plot": "runs/x/loss.png"})
      >>> print("\\n".join(lines))
      done: 3 steps in 5.0s (compiling 2.0s), 3,000 tokens at 1,000 tokens/s
      loss 5.0000 -> 4.0000; validation loss 5.1000 -> best 4.2000 at step 3 (-17.6%)
      plot: runs/x/loss.png
    """
    from eae_jax.train.progress import format_duration

    lines = [f"done: {summary.get('steps_run', 0)} steps in {format_duration(summary.get('wall_s'))} "
             f"(compiling {format_duration(summary.get('compile_s'))}), {summary.get('tokens', 0):,} tokens at "
             f"{summary.get('tokens_per_s') or 0:,.0f} tokens/s"]
    if summary.get("first_loss") is not None:
        line = f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
        if summary.get("best_val_loss") is not None:
            line += (f"; validation loss {summary['first_val_loss']:.4f} -> best {summary['best_val_loss']:.4f} "
                     f"at step {summary['best_val_step']} (-{100 * summary['val_loss_drop']:.1f}%)")
        lines.append(line)
    for key in ("plot", "tensorboard", "profile"):
        if summary.get(key):
            lines.append(f"{key}: {summary[key]}")
    return lines
