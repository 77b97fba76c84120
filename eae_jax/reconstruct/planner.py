"""The planner: from measured costs, the fastest storage per run of blocks under a budget.

`make_plan` takes what every storage option costs each segment of a stack
(`eae_jax.reconstruct.costs`: device bytes and time per block, from
compiled probes of the stack's own step) and chooses, per segment, how
many blocks keep what: boundaries in gradient slots, on the device or in
host memory, or also named intermediates (FFN gate/up, q/k/v, matmul
outputs, attention output, everything). A scanned segment that mixes
options becomes a `Runs` storage, least memory first in depth order.

The predicted peak of a plan: what the base probe holds besides its blocks,
plus every block's params, gradients and kept residuals, plus the largest
of, over the runs the backward meets (last first), what the runs not yet
done keep and the run's extra working memory. Its predicted time: the base
probe's plus every block's seconds. The search takes, for every cap on the
extra working memory, each segment's options on its lower convex hull of
(bytes, seconds), starts every block at its least-memory option, upgrades
one block at a time where a byte buys the most time while the budget
holds, then spends what is left on any move that still fits and saves
time. No scanned run is left with one block (XLA inlines a one-trip loop:
another program than the probes measured).

When the optimizer state (and fp32 master weights) would not fit, or when
moving it to pinned host memory makes the step faster overall, the plan
keeps it there (`eae_jax.offload_optim`), priced at one round trip of its
bytes per step over the host link.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from eae_jax.reconstruct.costs import Costs, Option, default_options, device_rates
from eae_jax.reconstruct.runs import Runs
from eae_jax.reconstruct.storage import Storage

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_budget(budget: Any):
    """A memory budget as bytes (int) or as a fraction of plain autodiff's activations (float in (0, 1]).

    Strings take a unit: ``'6GiB'``, ``'512 MiB'``, ``'6e9'``, ``'8GB'``.

    Raises:
      ValueError: anything else, named.

    >>> parse_budget("6GiB"), parse_budget("1.5 kB"), parse_budget(0.25), parse_budget(4096)
    (6442450944, 1500, 0.25, 4096)
    """
    if isinstance(budget, bool):
        raise ValueError(f"memory budget must be bytes or a fraction, got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"memory budget must be > 0 bytes, got {budget}")
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a fractional memory budget must lie in (0, 1], got {budget}; give bytes as an int "
                             "or a string such as '6GiB'")
        return budget
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", budget)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read memory budget {budget!r}; write e.g. '6GiB', '512MiB', '8GB' or a "
                             "number of bytes")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if value < 1:
            raise ValueError(f"memory budget must be at least one byte, got {budget!r}")
        return int(round(value))
    raise ValueError(f"memory budget must be bytes (int or '6GiB') or a fraction in (0, 1], got {budget!r}")


def fmt_bytes(n: float) -> str:
    """Bytes for people: ``'1.500 GiB'``, ``'12.0 MiB'``, ``'512 B'``.

    >>> fmt_bytes(3 * 2**29), fmt_bytes(-2**20)
    ('1.500 GiB', '-1.0 MiB')
    """
    a = abs(n)
    if a >= 2**30:
        return f"{n / 2**30:.3f} GiB"
    if a >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if a >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{int(n)} B"


def fmt_seconds(t: float) -> str:
    """Seconds for people, in ms or µs: ``'12.30 ms'``, ``'-4.1 µs'``.

    >>> fmt_seconds(0.0123), fmt_seconds(-4.1e-6)
    ('12.30 ms', '-4.1 µs')
    """
    return f"{t * 1e3:.2f} ms" if abs(t) >= 1e-3 else f"{t * 1e6:.1f} µs"


class BudgetError(ValueError):
    """A memory budget no plan meets: below the floor (the message names it).

    >>> issubclass(BudgetError, ValueError)
    True
    """


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """What one segment keeps: ``runs`` is ``((blocks, option name), ...)`` in depth order.

    >>> SegmentPlan("blocks", True, ((3, "slots"), (1, "dots"))).depth
    4
    """

    name: str
    scanned: bool
    runs: Tuple[Tuple[int, str], ...]

    @property
    def depth(self) -> int:
        return sum(n for n, _ in self.runs)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A memory plan: the storage per segment, its predicted peak and time.

    Attributes:
      budget: the budget in bytes (per device).
      segments: one `SegmentPlan` per segment of the stack.
      peak: predicted device peak of the step, bytes.
      seconds: predicted step time (the `Costs` timing model).
      floor: the least peak any plan reaches (the refusal threshold).
      params, grads, optimizer: bytes of each (``optimizer`` on the device;
        0 when the state is offloaded).
      optimizer_offloaded: the optimizer state lives in pinned host memory.
      costs: the measured `Costs` the plan was made from.
      options: option name -> `Option` (the storages).
      compiled_peak: the compiled step's peak when `plan_memory` verified
        the plan (None otherwise).
      reserve: bytes of the budget kept free for what the runtime allocates
        outside the compiled step (`plan_memory`'s ``reserve``).

    ``str(plan)`` is the table `table` prints; `storages` is the list to
    give `reconstruct` as ``storage=``.

    >>> import jax.numpy as jnp
    >>> from eae_jax.reconstruct import reconstruct
    >>> from eae_jax.reconstruct.costs import measure_costs
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w))
    >>> plan = make_plan(measure_costs(stack, jnp.ones((4, 8, 8)), jnp.ones((2, 8))), 1.0)
    >>> plan.segments[0].depth, plan.peak <= plan.budget
    (4, True)
    """

    budget: int
    segments: Tuple[SegmentPlan, ...]
    peak: int
    seconds: float
    floor: int
    params: int
    grads: int
    optimizer: int
    optimizer_offloaded: bool
    costs: Costs
    options: Dict[str, Option]
    compiled_peak: Optional[int] = None
    reserve: int = 0

    @property
    def storages(self) -> List[Storage]:
        """One storage per segment: the option's, or `Runs` where a segment mixes options."""
        out = []
        for seg in self.segments:
            if len(seg.runs) == 1:
                out.append(self.options[seg.runs[0][1]].storage)
            else:
                out.append(Runs(tuple((n, self.options[name].storage) for n, name in seg.runs)))
        return out

    def table(self) -> str:
        """The plan as a readable table: per run of blocks what is kept where,
        bytes and time per block; then the peak, its parts and the time."""
        rows = [("segment", "blocks", "keeps", "where", "kept/block", "device/block", "time/block")]
        for seg, sc in zip(self.segments, self.costs.segments):
            for n, name in seg.runs:
                c = sc.options[name]
                where, what = self.costs.what.get(name, ("?", name))
                rel = "" if seg.scanned else " (vs device)"
                rows.append((seg.name, str(n), f"{name}: {what}", where, fmt_bytes(c.kept_per_block) + rel,
                             fmt_bytes(c.bytes_per_block), fmt_seconds(c.seconds_per_block) + rel))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        rest = self.peak - self.params - self.grads - self.optimizer
        opt = "in pinned host memory" if self.optimizer_offloaded else fmt_bytes(self.optimizer)
        lines += ["", f"predicted peak {fmt_bytes(self.peak)} of budget {fmt_bytes(self.budget)} "
                  f"(floor {fmt_bytes(self.floor)}): params {fmt_bytes(self.params)} + grads "
                  f"{fmt_bytes(self.grads)} + optimizer state {opt} + activations and working memory "
                  f"{fmt_bytes(rest)}" + (f"; {fmt_bytes(self.reserve)} of the budget kept free for the runtime"
                                           if self.reserve else ""),
                  *([] if self.compiled_peak is None else
                    [f"compiled step peak {fmt_bytes(self.compiled_peak)} (prediction / compiled "
                     f"{self.peak / self.compiled_peak:.3f})"]),
                  f"predicted step time {fmt_seconds(self.seconds)} ({self.costs.timing} timing, "
                  f"{self.costs.backend})"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        """The plan as plain data (for logs and JSON)."""
        return {"budget": self.budget, "peak": self.peak, "seconds": self.seconds, "floor": self.floor,
                "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "optimizer_offloaded": self.optimizer_offloaded, "compiled_peak": self.compiled_peak,
                "segments": [{"name": s.name, "runs": [list(r) for r in s.runs]} for s in self.segments]}


class _Choice:
    """Per segment: the options allowed (least memory first), the lower
    convex hull of their (bytes, seconds) and the block count of each."""

    def __init__(self, seg, allowed: List[str], base: int):
        self.seg, self.base = seg, base
        opts = sorted(allowed, key=lambda o: (seg.options[o].bytes_per_block, seg.options[o].seconds_per_block))
        hull: List[str] = []
        for o in opts:
            if hull and seg.options[o].seconds_per_block >= seg.options[hull[-1]].seconds_per_block:
                continue  # more memory, no faster
            while len(hull) >= 2 and _gain(seg, hull[-2], hull[-1]) <= _gain(seg, hull[-1], o):
                hull.pop()
            hull.append(o)
        self.hull, self.allowed = hull, opts
        self.counts = {o: 0 for o in opts}
        self.counts[hull[0]] = seg.depth

    def move(self, a: str, b: str, n: int = 1) -> None:
        self.counts[a] -= n
        self.counts[b] += n

    def hull_step(self):
        """``(from, to)``: one block up the hull from its lowest occupied point, or None."""
        for i, o in enumerate(self.hull[:-1]):
            if self.counts[o]:
                return o, self.hull[i + 1]
        return None


def _gain(seg, a: str, b: str) -> float:
    """Seconds saved per byte moving a block from option a to b."""
    ca, cb = seg.options[a], seg.options[b]
    return (ca.seconds_per_block - cb.seconds_per_block) / max(cb.bytes_per_block - ca.bytes_per_block, 1)


def _fixed(costs: Costs) -> int:
    """The base probe less its blocks' option bytes: what every plan holds besides them."""
    return costs.base_peak - sum((2 if s.scanned else 1) * s.options[costs.reference].bytes_per_block
                                 for s in costs.segments)


def _evaluate(costs: Costs, choices: List[_Choice], rank: Dict[str, int]) -> Tuple[int, float]:
    """Predicted ``(peak, seconds)`` of block counts, without optimizer state.

    Runs are laid out as `_segment_plans` does and the backward meets them
    last first: while it works on a run, that run and every run before it
    still hold what they keep, and the run's option adds its extra working
    memory (measured with the whole stack around it, relative to the
    reference). What a single (unscanned) block keeps or needs is measured
    as one change of the whole probe: it is counted as held throughout.
    """
    peak, seconds, live, worst = _fixed(costs), costs.base_seconds, 0, None
    for c in choices:
        ref = c.seg.options[costs.reference]
        seconds -= c.base * ref.seconds_per_block
        for o, n in _runs(c, rank):
            opt = c.seg.options[o]
            peak += n * (opt.bytes_per_block - opt.kept_per_block)
            seconds += n * opt.seconds_per_block
            if not c.seg.scanned:
                live += n * opt.kept_per_block
    for c in choices:
        for o, n in (_runs(c, rank) if c.seg.scanned else ()):
            opt = c.seg.options[o]
            live += n * opt.kept_per_block
            worst = live + opt.transient if worst is None else max(worst, live + opt.transient)
    return peak + (live if worst is None else worst), seconds


def _runs(c: _Choice, rank: Dict[str, int]):
    # Least memory first in depth order: the backward meets the runs that keep
    # the most first and frees them before the others.
    return [(o, n) for o, n in sorted(c.counts.items(), key=lambda kv: rank.get(kv[0], 0)) if n]


def _search(costs: Costs, room: int, cap: int, rank: Dict[str, int]) -> Optional[List[_Choice]]:
    """Greedy block counts with predicted peak <= ``room``, every scanned
    option's extra working memory <= ``cap``; None if the least does not fit."""
    choices = []
    for seg in costs.segments:
        names = [o for o in seg.options if not seg.scanned or seg.options[o].transient <= cap]
        if not names:
            return None
        choices.append(_Choice(seg, names, 2 if seg.scanned else 1))

    def fits(c, a, b, n=1):
        c.move(a, b, n)
        ok = _evaluate(costs, choices, rank)[0] <= room
        c.move(b, a, n)
        return ok

    if _evaluate(costs, choices, rank)[0] > room:
        return None
    # Up the hulls, where a byte buys the most time first.
    blocked = set()
    while True:
        steps = [(_gain(c.seg, *c.hull_step()), i) + c.hull_step() for i, c in enumerate(choices)
                 if i not in blocked and c.hull_step()]
        if not steps:
            break
        _, i, a, b = max(steps, key=lambda t: (t[0], -t[1]))
        if fits(choices[i], a, b):
            choices[i].move(a, b)
        else:
            blocked.add(i)
    # Then any single-block move that still fits and saves time, the largest saving first.
    while True:
        moves = [(c.seg.options[a].seconds_per_block - c.seg.options[b].seconds_per_block, i, a, b)
                 for i, c in enumerate(choices) for a, n in c.counts.items() if n for b in c.allowed]
        moves = sorted((m for m in moves if m[0] > 0), key=lambda t: (-t[0], t[1]))
        move = next((m for m in moves if fits(choices[m[1]], m[2], m[3])), None)
        if move is None:
            break
        choices[move[1]].move(move[2], move[3])
    for c in choices:
        _no_single_runs(c, fits)
    return choices


def _no_single_runs(c: _Choice, fits) -> None:
    """A scanned run of one block is inlined by XLA (a one-trip loop), another
    program than the probes measured: give it a second block, or move it to
    a neighbouring run, whichever fits and is faster."""
    if not c.seg.scanned or c.seg.depth < 2:
        return
    for o in [o for o, n in c.counts.items() if n == 1]:
        if c.counts[o] != 1:
            continue
        cands = [(c.seg.options[a].seconds_per_block - c.seg.options[o].seconds_per_block, a, o)
                 for a, n in c.counts.items() if a != o and n >= 3]
        cands += [(c.seg.options[b].seconds_per_block - c.seg.options[o].seconds_per_block, o, b)
                  for b, n in c.counts.items() if b != o and n >= 1]
        for _, a, b in sorted(cands, key=lambda t: (-t[0] if t[1] != o else t[0])):
            if fits(c, a, b):
                c.move(a, b)
                break
    # Where no such move fits (3 blocks as 1 + 2, say), step down the ladder:
    # the lone block joins the run below it, or the run above lends it one.
    while True:
        held = [o for o in c.allowed if c.counts[o]]
        lone = next((i for i, o in enumerate(held) if c.counts[o] == 1), None)
        if lone is None:
            return
        a, b = (held[lone], held[lone - 1]) if lone else (held[1], held[0])
        if not fits(c, a, b):
            return
        c.move(a, b)


def _caps(costs: Costs) -> List[int]:
    return sorted({0} | {o.transient for s in costs.segments if s.scanned for o in s.options.values()})


def _best(costs: Costs, room: int, rank: Dict[str, int]) -> Optional[Tuple[List[_Choice], int, float]]:
    """The fastest counts whose predicted peak (without optimizer) is <= ``room``."""
    best = None
    for cap in _caps(costs):
        choices = _search(costs, room, cap, rank)
        if choices is None:
            continue
        peak, seconds = _evaluate(costs, choices, rank)
        if peak <= room and (best is None or seconds < best[2] - 1e-15 or
                             (abs(seconds - best[2]) <= 1e-15 and peak < best[1])):
            best = (choices, peak, seconds)
    return best


def _floor(costs: Costs, rank: Dict[str, int]) -> int:
    """The least predicted peak of any plan the search starts from (without
    optimizer state): every block at its least-memory option, for the best
    cap on working memory."""
    least = None
    for cap in _caps(costs):
        choices = []
        for seg in costs.segments:
            names = [o for o in seg.options if not seg.scanned or seg.options[o].transient <= cap]
            if not names:
                break
            choices.append(_Choice(seg, names, 2 if seg.scanned else 1))
        else:
            peak, _ = _evaluate(costs, choices, rank)
            least = peak if least is None else min(least, peak)
    return least


def _segment_plans(choices: List[_Choice], rank: Dict[str, int]) -> Tuple[SegmentPlan, ...]:
    return tuple(SegmentPlan(c.seg.name, c.seg.scanned, tuple((n, o) for o, n in _runs(c, rank)))
                 for c in choices)


def make_plan(costs: Costs, budget: Any, *, options: Optional[Sequence[Option]] = None, optimizer_bytes: int = 0,
              offload_optimizer: Any = "auto", host_bytes_per_s: Optional[float] = None, margin: int = 0) -> Plan:
    """Choose the fastest plan under ``budget`` from measured `Costs`.

    Args:
      costs: from `measure_costs`.
      budget: bytes, a string such as ``'6GiB'``, or a fraction in (0, 1]
        of what plain autodiff keeps (``fixed + f * activations`` where
        the activations are those of the ``everything`` option).
      options: the options ``costs`` was measured with (default
        `default_options`), for the storages.
      optimizer_bytes: optimizer state (and master weights) the step keeps.
      offload_optimizer: ``'auto'`` (host memory when it does not fit, or
        when that is faster), True or False.
      host_bytes_per_s: host link bandwidth pricing an offloaded optimizer.
      margin: bytes of the budget the search leaves unused (what a
        compiled step needed beyond its prediction, see `plan_memory`).

    Raises:
      BudgetError: the budget is below the floor (named, with its parts).

    >>> import jax.numpy as jnp
    >>> from eae_jax.reconstruct import reconstruct
    >>> from eae_jax.reconstruct.costs import measure_costs
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w))
    >>> costs = measure_costs(stack, jnp.ones((4, 8, 8)), jnp.ones((2, 8)))
    >>> make_plan(costs, 10).peak
    Traceback (most recent call last):
    ...
    eae_jax.reconstruct.planner.BudgetError: memory budget 10 B is below the floor ...
    """
    options = {o.name: o for o in (default_options() if options is None else options)}
    rank = {name: i for i, name in enumerate(options)}
    if offload_optimizer not in ("auto", True, False):
        raise ValueError(f"offload_optimizer must be 'auto', True or False, got {offload_optimizer!r}")
    parsed = parse_budget(budget)
    floor = _floor(costs, rank)
    if isinstance(parsed, float):
        if not any("everything" in s.options for s in costs.segments):
            raise ValueError("a fractional budget is a fraction of what plain autodiff keeps: measure the costs "
                             "with the 'everything' option")
        every = _everything(costs, rank)
        fixed = costs.params + costs.grads
        parsed = int(fixed + optimizer_bytes + parsed * (every - fixed))
    host_rate = host_bytes_per_s or device_rates()[1]
    candidates = []
    if offload_optimizer in ("auto", False) or not optimizer_bytes:
        best = _best(costs, parsed - margin - optimizer_bytes, rank)
        if best:
            candidates.append((best, optimizer_bytes, False, 0.0))
    if offload_optimizer in ("auto", True) and optimizer_bytes:
        best = _best(costs, parsed - margin, rank)
        if best:
            candidates.append((best, 0, True, 2 * optimizer_bytes / host_rate))
    on_host = offload_optimizer is not False and optimizer_bytes > 0
    if not candidates:
        kept = 0 if on_host else optimizer_bytes
        opt = "in pinned host memory" if on_host else fmt_bytes(optimizer_bytes)
        hint = ""
        if optimizer_bytes and not on_host:
            hint = f"; with the optimizer state in host memory (offload_optimizer) it is {fmt_bytes(floor)}"
        if margin:
            raise BudgetError(f"memory budget {fmt_bytes(parsed)}: no plan fits once {fmt_bytes(margin)} are set "
                              f"aside (the runtime's reserve and what the compiled step needs beyond its "
                              f"prediction; predicted floor {fmt_bytes(floor + kept)})")
        raise BudgetError(f"memory budget {fmt_bytes(parsed)} is below the floor {fmt_bytes(floor + kept)} "
                          f"({parsed} < {floor + kept} bytes): parameters {fmt_bytes(costs.params)} + gradients "
                          f"{fmt_bytes(costs.grads)} + optimizer state {opt} + one block and what every block "
                          f"must keep {fmt_bytes(floor - costs.params - costs.grads)}{hint}")
    (choices, peak, seconds), opt_bytes, offloaded, extra_s = min(
        candidates, key=lambda c: (c[0][2] + c[3], c[2]))
    return Plan(parsed, _segment_plans(choices, rank), int(peak + opt_bytes), float(seconds + extra_s),
                int(floor + (0 if offloaded else optimizer_bytes)), costs.params, costs.grads, opt_bytes, offloaded,
                costs, options)


def _everything(costs: Costs, rank: Dict[str, int]) -> int:
    """Predicted peak of keeping every internal in every block (plain autodiff)."""
    choices = []
    for seg in costs.segments:
        c = _Choice(seg, list(seg.options), 2 if seg.scanned else 1)
        c.counts = {o: 0 for o in c.allowed}
        c.counts["everything" if "everything" in seg.options else costs.reference] = seg.depth
        choices.append(c)
    return _evaluate(costs, choices, rank)[0]
