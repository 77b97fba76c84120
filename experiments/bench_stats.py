"""Statistics of the stack benchmark (numpy, scipy): medians over processes
with 95% confidence intervals, ratios with intervals and their verdict, and
the GPU clock log read back per timing window.

Method (docs/benchmarks.md says why): a variant is timed in several
processes, each giving its per-step times. Its statistic is the median over
processes of each process's median step time. Two 95% intervals are
computed and the reported one spans both:

* a two-level bootstrap: draw the processes with replacement, then each
  drawn process's steps with replacement, take the statistic of the draw
  (a ratio divides the two variants' independent draws); percentile interval;
* a t interval on the logarithms of the process medians (Welch's for a
  ratio), which widens as it should when only a few processes vary between
  themselves more than their steps do (a bootstrap of three processes
  cannot see that spread). It needs at least two processes per variant.

A ratio is a win or a loss only when the reported interval excludes 1;
otherwise it is a tie.
"""

from __future__ import annotations

import csv
import io
import time
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

DRAWS = 10_000
LEVEL = 0.95


def seed_for(name: str, base: int = 0) -> int:
    """A fixed seed per name: re-rendering a report reproduces its intervals.

    >>> seed_for("eae") == seed_for("eae") != seed_for("J-plain")
    True
    """
    return (zlib.crc32(name.encode()) + 1_000_003 * base) & 0x7FFFFFFF


def statistic(processes: Sequence[Sequence[float]]) -> float:
    """Median over processes of each process's median.

    >>> statistic([[1.0, 2.0, 9.0], [3.0], [4.0, 5.0]])
    3.0
    """
    if not processes or any(len(p) == 0 for p in processes):
        raise ValueError("every process needs at least one value")
    return float(np.median([np.median(p) for p in processes]))


def bootstrap(processes: Sequence[Sequence[float]], seed: int, draws: int = DRAWS) -> np.ndarray:
    """``draws`` two-level bootstrap replicates of `statistic`.

    >>> d = bootstrap([[1.0, 1.0], [1.0]], seed=0, draws=5)
    >>> d.tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0]
    """
    if not processes or any(len(p) == 0 for p in processes):
        raise ValueError("every process needs at least one value")
    rng = np.random.default_rng(seed)
    # medians[p, b]: process p's median in draw b (its steps resampled)
    medians = np.empty((len(processes), draws))
    for i, steps in enumerate(processes):
        s = np.asarray(steps, dtype=np.float64)
        idx = rng.integers(0, s.size, size=(draws, s.size))
        medians[i] = np.median(s[idx], axis=1)
    chosen = rng.integers(0, len(processes), size=(draws, len(processes)))
    return np.median(medians[chosen, np.arange(draws)[:, None]], axis=1)


def interval(draws: np.ndarray, level: float = LEVEL) -> Tuple[float, float]:
    """Percentile interval of bootstrap draws."""
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(draws, [tail, 100.0 - tail])
    return float(lo), float(hi)


def t_interval_log(num_medians: Sequence[float], den_medians: Optional[Sequence[float]] = None,
                   level: float = LEVEL) -> Optional[Tuple[float, float]]:
    """t interval of the geometric mean of ``num_medians`` (or, with
    ``den_medians``, Welch's interval of the ratio of the two geometric
    means), from the logarithms; None with fewer than two values a side.

    >>> lo, hi = t_interval_log([10.0, 10.0, 10.0])
    >>> round(lo, 9), round(hi, 9)
    (10.0, 10.0)
    >>> t_interval_log([10.0]) is None
    True
    """
    from scipy import stats

    a = np.log(np.asarray(num_medians, dtype=np.float64))
    if a.size < 2:
        return None
    va = a.var(ddof=1) / a.size
    centre, var, df = a.mean(), va, a.size - 1
    if den_medians is not None:
        b = np.log(np.asarray(den_medians, dtype=np.float64))
        if b.size < 2:
            return None
        vb = b.var(ddof=1) / b.size
        centre, var = a.mean() - b.mean(), va + vb
        denom = (va * va / (a.size - 1) if va else 0.0) + (vb * vb / (b.size - 1) if vb else 0.0)
        df = var * var / denom if denom > 0 else a.size + b.size - 2
    half = float(stats.t.ppf(0.5 + level / 2.0, df)) * float(np.sqrt(var))
    return float(np.exp(centre - half)), float(np.exp(centre + half))


def _span(*intervals) -> List[float]:
    found = [iv for iv in intervals if iv is not None]
    return [min(iv[0] for iv in found), max(iv[1] for iv in found)]


def summarize(processes: Sequence[Sequence[float]], seed: int, draws: int = DRAWS) -> dict:
    """`statistic` with its interval (spanning the bootstrap and t intervals)
    and the process medians.

    >>> out = summarize([[2.0, 2.0], [2.0]], seed=0)
    >>> out["value"], out["ci"], out["process_medians"]
    (2.0, [2.0, 2.0], [2.0, 2.0])
    """
    meds = [float(np.median(p)) for p in processes]
    boot = interval(bootstrap(processes, seed, draws))
    t = t_interval_log(meds)
    return {"value": statistic(processes), "ci": _span(boot, t), "ci_bootstrap": list(boot),
            "ci_t": None if t is None else list(t), "process_medians": meds,
            "process_range": [min(meds), max(meds)], "processes": len(processes)}


def ratio(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]], seed_num: int, seed_den: int,
          draws: int = DRAWS) -> dict:
    """``statistic(num) / statistic(den)`` with its interval (spanning the
    bootstrap interval of the draws' ratios and Welch's t interval).

    >>> r = ratio([[4.0], [4.0]], [[2.0], [2.0]], 0, 1)
    >>> r["value"], r["ci"]
    (2.0, [2.0, 2.0])
    """
    value = statistic(num) / statistic(den)
    boot = interval(bootstrap(num, seed_num, draws) / bootstrap(den, seed_den, draws))
    t = t_interval_log([np.median(p) for p in num], [np.median(p) for p in den])
    return {"value": value, "ci": _span(boot, t), "ci_bootstrap": list(boot), "ci_t": None if t is None else list(t)}


def verdict(ci: Optional[Sequence[float]], higher_is_win: bool) -> str:
    """``win`` / ``loss`` when the interval excludes 1 (on the winning or
    losing side), ``tie`` when it contains 1 (its ends included), ``n/a``
    without an interval.

    >>> verdict([1.01, 1.2], True), verdict([1.0, 1.2], True), verdict([0.8, 0.9], True)
    ('win', 'tie', 'loss')
    >>> verdict([0.8, 0.9], False)
    'win'
    """
    if ci is None or any(v is None for v in ci):
        return "n/a"
    lo, hi = ci
    if lo > 1.0:
        return "win" if higher_is_win else "loss"
    if hi < 1.0:
        return "loss" if higher_is_win else "win"
    return "tie"


# ---------------------------------------------------------------------------- nvidia-smi log
#: What the campaign logs, in order of preference for the last column (the
#: reasons field was renamed across drivers; the probe keeps the first that works).
SMI_BASE = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
SMI_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _smi_time(text: str) -> float:
    """nvidia-smi's local timestamp (``YYYY/MM/DD HH:MM:SS.mmm``) as epoch seconds."""
    text = text.strip()
    whole, _, frac = text.partition(".")
    return time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + (float("0." + frac) if frac else 0.0)


def _number(text: str) -> Optional[float]:
    text = text.strip().split(" ")[0]
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_smi(text: str) -> List[dict]:
    """Samples of an ``nvidia-smi --query-gpu=... --format=csv,nounits`` log.

    Columns are found by their header names; lines that do not parse (a
    repeated header, a line cut by the process's end) are skipped.

    >>> log = ("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
    ...        "temperature.gpu, clocks_event_reasons.active\\n"
    ...        "2026/01/02 03:04:05.250, 1980, 2619, 512.5, 61, 0x0000000000000004\\n")
    >>> s = parse_smi(log)[0]
    >>> (s["sm_mhz"], s["mem_mhz"], s["power_w"], s["temp_c"], s["reasons"])
    (1980.0, 2619.0, 512.5, 61.0, 4)
    """
    rows = list(csv.reader(io.StringIO(text), skipinitialspace=True))
    if not rows:
        return []
    head = [h.strip().lower() for h in rows[0]]

    def col(*keys):
        for i, h in enumerate(head):
            if any(h.startswith(k) for k in keys):
                return i
        return None

    cols = {"t": col("timestamp"), "sm_mhz": col("clocks.current.sm", "clocks.sm"),
            "mem_mhz": col("clocks.current.memory", "clocks.mem"), "power_w": col("power.draw"),
            "temp_c": col("temperature.gpu"), "reasons": col("clocks_event_reasons.active",
                                                             "clocks_throttle_reasons.active")}
    out = []
    for row in rows[1:]:
        if len(row) != len(head) or cols["t"] is None:
            continue
        try:
            sample = {"t": _smi_time(row[cols["t"]])}
        except ValueError:
            continue
        for key in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
            sample[key] = None if cols[key] is None else _number(row[cols[key]])
        reasons = None if cols["reasons"] is None else row[cols["reasons"]].strip()
        sample["reasons"] = int(reasons, 16) if reasons and reasons.startswith("0x") else None
        out.append(sample)
    return out


def window_clocks(samples: Sequence[dict], t0: float, t1: float) -> dict:
    """Clock, power and temperature statistics of the samples in ``[t0, t1]``.

    >>> s = [{"t": float(i), "sm_mhz": 1900.0 + i, "mem_mhz": 2600.0, "power_w": 500.0 + i, "temp_c": 60.0,
    ...       "reasons": 0} for i in range(5)]
    >>> w = window_clocks(s, 1.0, 3.0)
    >>> (w["samples"], w["sm_mhz_min"], w["sm_mhz_median"], w["power_w_max"])
    (3, 1901.0, 1902.0, 503.0)
    """
    inside = [s for s in samples if t0 <= s["t"] <= t1]
    out: Dict[str, object] = {"samples": len(inside)}
    if not inside:
        return out
    for key, name in (("sm_mhz", "sm_mhz"), ("mem_mhz", "mem_mhz"), ("power_w", "power_w"), ("temp_c", "temp_c")):
        vals = [s[key] for s in inside if s[key] is not None]
        if vals:
            out[f"{name}_min"], out[f"{name}_median"], out[f"{name}_max"] = (
                float(min(vals)), float(np.median(vals)), float(max(vals)))
    reasons = sorted({s["reasons"] for s in inside if s["reasons"]})
    out["clock_event_reasons"] = [hex(r) for r in reasons]
    return out
