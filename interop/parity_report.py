"""The report of a parity run: rows, their metrics and the verdict (see `interop.parity`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, NamedTuple

import numpy as np

class Row(NamedTuple):
    """One comparison: ``section`` (forward / grad / adjoint[...]), ``name``
    (x3, block 2, dL/dx0 ...), the three metrics, the tolerance applied and
    whether the row passes.

    Example:
      >>> from interop.parity_report import Row
      >>> row = Row("forward", "x1", max_abs=1e-7, rel=2e-7, cos=1.0, tol=1e-5, ok=True)
      >>> row.section, row.ok
      ('forward', True)
    """

    section: str
    name: str
    max_abs: float
    rel: float
    cos: float
    tol: float
    ok: bool


def compare(got: Any, want: Any) -> tuple:
    """``(max_abs, rel, cos)`` of ``got`` against the reference ``want`` in float64.

    ``rel = ||got - want|| / ||want||`` (``||got||`` when want is zero);
    ``cos`` is 1 when both are zero. An empty comparison proves nothing:
    all three are NaN, so its row fails (never agreement by default).

    Raises:
      ValueError: shapes differ.

    Example:
      >>> import numpy as np
      >>> from interop.parity_report import compare
      >>> compare(np.array([3.0, 4.0]), np.array([3.0, 4.0]))
      (0.0, 0.0, 1.0)
      >>> max_abs, rel, cos = compare(np.array([3.0, 4.5]), np.array([3.0, 4.0]))
      >>> max_abs, rel                                               # 0.5 / ||(3, 4)|| = 0.1
      (0.5, 0.1)
    """
    a = np.asarray(got, np.float64).ravel()
    b = np.asarray(want, np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {np.shape(got)} and {np.shape(want)}")
    if a.size == 0:
        return float("nan"), float("nan"), float("nan")
    diff = a - b
    nb, na = float(np.linalg.norm(b)), float(np.linalg.norm(a))
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    rel = float(np.linalg.norm(diff)) / nb if nb > 0 else float(np.linalg.norm(diff))
    if na == 0 and nb == 0:
        cos = 1.0
    elif na == 0 or nb == 0:
        cos = 0.0
    else:
        cos = float(np.dot(a, b) / (na * nb))
    return max_abs, rel, cos


@dataclasses.dataclass
class ParityReport:
    """The rows of one parity run plus what was run.

    Attributes:
      title: what was compared.
      dtype: the compute dtype name (selects the tolerance).
      rows: every comparison.
      info: extra facts (shapes, seeds, loss values ...).

    Example:
      >>> from interop.parity_report import ParityReport, Row
      >>> rows = [Row("forward", "x1", 1e-7, 2e-7, 1.0, 1e-5, True), Row("grad", "wq", 1e-3, 3e-3, 0.99, 1e-5, False)]
      >>> report = ParityReport("demo", "float32", rows, {})
      >>> report.ok, [r.name for r in report.failures], report.worst("grad")
      (False, ['wq'], 0.003)
      >>> ParityReport("empty", "float32", [], {}).ok                 # nothing compared proves nothing
      False
    """

    title: str
    dtype: str
    rows: List[Row]
    info: Dict[str, Any]

    @property
    def ok(self) -> bool:
        """True when there are rows and every one is within its tolerance (a NaN row is not)."""
        return bool(self.rows) and all(r.ok for r in self.rows)

    @property
    def failures(self) -> List[Row]:
        return [r for r in self.rows if not r.ok]

    def worst(self, section_prefix: str = "") -> float:
        """Largest relative error among rows whose section starts with the prefix;
        NaN when one of them is NaN (a NaN never hides behind a finite maximum),
        0 when there are none."""
        rels = [r.rel for r in self.rows if r.section.startswith(section_prefix)]
        if any(np.isnan(r) for r in rels):
            return float("nan")
        return max(rels) if rels else 0.0

    def table(self) -> str:
        """A fixed-width text table, one line per row, with a verdict line."""
        head_ = f"{'section':<20} {'boundary/tensor':<18} {'max_abs_err':>12} {'rel_err':>12} {'cosine':>14} {'tol':>9}  ok"
        lines = [f"== parity: {self.title} ({self.dtype}) ==", head_, "-" * len(head_)]
        for r in self.rows:
            lines.append(f"{r.section:<20} {r.name:<18} {r.max_abs:>12.3e} {r.rel:>12.3e} {r.cos:>14.10f} "
                         f"{r.tol:>9.1e}  {'ok' if r.ok else 'FAIL'}")
        nan_rows = sum(1 for r in self.rows if np.isnan(r.rel))
        if self.ok:
            verdict = "PASS"
        elif not self.rows:
            verdict = "FAIL (nothing was compared)"
        else:
            verdict = (f"FAIL ({len(self.failures)} of {len(self.rows)} rows over tolerance"
                       + (f", {nan_rows} of them NaN" if nan_rows else "") + ")")
        lines.append(f"result: {verdict}; worst rel err: forward {self.worst('forward'):.3e}, "
                     f"grad {self.worst('grad'):.3e}, adjoint {self.worst('adjoint'):.3e}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready dict (rows as dicts)."""
        return {"title": self.title, "dtype": self.dtype, "ok": self.ok, "info": _jsonable(self.info),
                "rows": [r._asdict() for r in self.rows]}


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
