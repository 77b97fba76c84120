"""The fallback ledger: what every seam call actually ran, counted exactly.

Each seam carries a `Ledger` of float32 counters in its state. How the
counts get out of a compiled step without double counting:

* **Under differentiation** (training, `eae_jax.reconstruct`, ``jax.grad``)
  the seam's output passes through `count`, an identity with a
  ``jax.custom_vjp`` whose backward rule returns this call's increments
  (one call, fp8 or not, which reason, the amax seen) as the *cotangent of
  the ledger*. The caller differentiates with respect to the seam state as
  well and folds that cotangent in with `fold` (flax's fp8 ops return
  their amax histories the same way, "overwrite with gradient"). A
  cotangent is produced once per VJP, whatever ran forward: reconstruct
  runs a block forward once in the forward pass and again (recomputed) in
  the backward, but takes its VJP exactly once, so the count is one per
  call; ``jax.checkpoint`` and ``lax.scan`` (per-layer ledgers stacked on a
  leading axis) are exact for the same reason.
* **Without differentiation** (inference) use the forward-returning variant
  of a seam, which returns ``(y, increments)``; fold those the same way.

Count increments are additive (calls, fp8 calls, a count per reason), so a
ledger that several calls share in one step still gets exact totals. The
amax increments are added as well (autodiff sums the cotangents of a shared
input; ``vmap`` over calls sharing a state does the same): for shared calls
the recorded amax is an upper bound of their maximum, so the next delayed
scales are conservative (never saturating because of it, up to log2(calls)
binades coarser). Exact maxima: give each call its own state (per-layer
states stacked on a leading axis), call a seam once on the whole batch
(seams take any leading axes) rather than under ``vmap``, or differentiate
calls separately and combine their cotangents with
`eae_jax.fp8.combine_observations` (the training command does so for
microbatches). What
is derived in `fold` from one step's increments: ``consecutive`` (run of
calls that fell back for a reason of the seam's own, i.e. not ``'block'``
or ``'step'``;
reset by a step with any fp8 call, so a step mixing both resets it — the
conservative choice), ``detached`` (set for good once
``consecutive`` reaches ``detach_after``; the seam then takes its
high-precision path) and ``last_reason`` (the highest-numbered reason seen
in the step). With one call per ledger per step, the usual per-layer
setup, all of them are exact.

Counts are float32: exact up to 2**24 (16.7 M) calls per seam.

The host hears about fallbacks through a `LedgerMonitor`: once per seam and
reason, and once when a seam detaches. ``BoundSeam.fold`` /
``BoundBlock.fold`` with ``notify=True`` make one ``jax.debug.callback`` per
step for that, never one per seam call (on a GPU each callback waits for the
host); trace-time fallbacks are said when the seam is traced. Strict mode
(`strict_check`) is the exception: a host callback per call, raising.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Dict, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

#: Why a call ran the high-precision path. Value-dependent reasons are
#: decided in the graph; trace-time ones when the seam is traced.
REASONS = (
    "nonfinite",          # input had NaN/inf
    "saturation",         # fraction of input beyond the fp8 range (static scale) above threshold
    "hidden_saturation",  # same at the FFN's down-projection input
    "dtype",              # trace time: input dtype outside the contract
    "rows",               # trace time: row count outside the contract's bounds
    "device",             # trace time: platform without fp8 GEMMs, or not allowed
    "detached",           # the seam detached itself after too many consecutive fallbacks
    "block",              # another seam of the same block call fell back (block-level fallback)
    "step",               # a seam somewhere in the same train step fell back (step-level fallback)
)
VALUE_REASONS = REASONS[:3]
TRACE_REASONS = REASONS[3:6]
#: A fallback for these reasons is not the seam's own: it neither extends the
#: seam's run of consecutive fallbacks nor can detach it.
BLOCK_REASON = REASONS.index("block")
STEP_REASON = REASONS.index("step")
NUM_REASONS = len(REASONS)


def reason_index(name: str) -> int:
    """Index of a reason in `REASONS` (raises ValueError naming the valid ones)."""
    if name not in REASONS:
        raise ValueError(f"unknown fallback reason {name!r}; expected one of {REASONS}")
    return REASONS.index(name)


class Fp8FallbackWarning(RuntimeWarning):
    """A seam ran its high-precision path, or detached itself."""


class Ledger(NamedTuple):
    """Counters of one seam (all float32; any leading axes, e.g. layers).

    Attributes:
      calls: calls seen.
      fp8_calls: calls that ran the fp8 path (``calls - fp8_calls`` fell back).
      reasons: ``(..., len(REASONS))`` fallbacks per reason.
      amax: ``(..., points)`` last observed input amax at each quantization
        point (seam input; FFN hidden), 0 before any fp8 call.
      consecutive: current run of consecutive fallbacks.
      detached: 1.0 once the seam has detached itself.
      last_reason: index into `REASONS` of the last fallback's reason, -1 if none.
    """

    calls: jax.Array
    fp8_calls: jax.Array
    reasons: jax.Array
    amax: jax.Array
    consecutive: jax.Array
    detached: jax.Array
    last_reason: jax.Array


def init_ledger(points: int) -> Ledger:
    """A zeroed ledger for a seam with ``points`` quantization points."""
    z = jnp.zeros((), jnp.float32)
    return Ledger(z, z, jnp.zeros((NUM_REASONS,), jnp.float32), jnp.zeros((points,), jnp.float32), z, z,
                  jnp.full((), -1.0, jnp.float32))


def increments(code: jax.Array, amax: jax.Array) -> Ledger:
    """The increments of one call, shaped like a `Ledger`.

    Args:
      code: int32 scalar: -1 when the fp8 path ran, else an index into `REASONS`.
      amax: ``(points,)`` amax observed at the quantization points (non-finite
        entries are recorded as 0).

    Returns:
      A `Ledger` whose ``consecutive``, ``detached`` and ``last_reason`` are 0
      (those are derived by `fold`).
    """
    code = jnp.asarray(code, jnp.int32)
    amax = jnp.asarray(amax, jnp.float32)
    z = jnp.zeros((), jnp.float32)
    onehot = (jnp.arange(NUM_REASONS, dtype=jnp.int32) == code).astype(jnp.float32)
    # One call, derived from ``code`` so that under vmap it is batched like the other counts
    # (a constant 1 was not, and N mapped calls counted 1 call with N fp8 calls).
    one = (code >= -1).astype(jnp.float32)
    return Ledger(one, (code < 0).astype(jnp.float32), onehot,
                  jnp.where(jnp.isfinite(amax), amax, 0.0), z, z, z)


@jax.custom_vjp
def count(y: jax.Array, ledger: Ledger, inc: Ledger) -> jax.Array:
    """Identity on ``y`` whose VJP hands ``inc`` back as the ledger's cotangent.

    Put it on a seam's output; differentiate with respect to the ledger (it
    is part of the seam state) and `fold` the cotangent. ``inc`` itself gets
    a zero cotangent (it is computed from comparisons, not differentiable).
    """
    del ledger, inc
    return y


def _count_fwd(y, ledger, inc):
    del ledger
    return y, inc


def _count_bwd(inc, g):
    return g, inc, jax.tree_util.tree_map(jnp.zeros_like, inc)


count.defvjp(_count_fwd, _count_bwd)


def zeros_like_ledger(ledger: Ledger) -> Ledger:
    """All-zero increments shaped like ``ledger``."""
    return jax.tree_util.tree_map(jnp.zeros_like, ledger)


def own_fallbacks(inc: Ledger) -> jax.Array:
    """Per seam instance: calls of ``inc`` that fell back for a reason of their
    own, found in the graph (non-finite, saturation, detached), float32."""
    own = [REASONS.index(r) for r in VALUE_REASONS + ("detached",)]
    return jnp.sum(inc.reasons[..., own], axis=-1)


def as_step_fallback(inc: Ledger, bad: jax.Array) -> Ledger:
    """Increments of a train step that is thrown away and rerun in high
    precision when ``bad``: every call that ran fp8 is recounted as a
    fallback with reason ``'step'`` (the calls that failed keep their own
    reason). Unchanged when not ``bad``."""
    moved = jnp.where(bad, inc.fp8_calls, 0.0)
    reasons = inc.reasons.at[..., STEP_REASON].add(moved)
    return inc._replace(fp8_calls=inc.fp8_calls - moved, reasons=reasons)


def fold(ledger: Ledger, inc: Ledger, detach_after: Optional[int] = 32) -> Ledger:
    """Add one step's increments to a ledger and derive the run/detach state.

    Works elementwise over any leading axes (stacked per-layer ledgers).

    Args:
      ledger: the current ledger.
      inc: increments of this step: the ledger's cotangent (differentiated
        seams) or the sum of forward-returned increments.
      detach_after: consecutive fallbacks after which the seam detaches for
        good; None or 0 never detaches.

    Returns:
      The new `Ledger`.

    Raises:
      ValueError: ``inc`` is not shaped like ``ledger``.
    """
    if not isinstance(inc, Ledger):
        raise ValueError(f"ledger increments must be a Ledger, got {type(inc).__name__}")
    for name, a, b in zip(Ledger._fields, ledger, inc):
        if jnp.shape(a) != jnp.shape(b):
            raise ValueError(f"ledger increment {name!r} has shape {jnp.shape(b)}, ledger has {jnp.shape(a)}")
    calls = ledger.calls + inc.calls
    fp8_calls = ledger.fp8_calls + inc.fp8_calls
    reasons = ledger.reasons + inc.reasons
    fell_back = inc.calls - inc.fp8_calls - inc.reasons[..., BLOCK_REASON] - inc.reasons[..., STEP_REASON]
    consecutive = jnp.where(inc.fp8_calls > 0, 0.0, ledger.consecutive + fell_back)
    if detach_after:
        detached = jnp.maximum(ledger.detached, (consecutive >= detach_after).astype(jnp.float32))
    else:
        detached = ledger.detached
    idx = jnp.arange(NUM_REASONS, dtype=jnp.float32)
    newest = jnp.max(jnp.where(inc.reasons > 0, idx, -1.0), axis=-1)
    last_reason = jnp.where(newest >= 0, newest, ledger.last_reason)
    amax = jnp.where(inc.amax > 0, inc.amax, ledger.amax)
    return Ledger(calls, fp8_calls, reasons, amax, consecutive, detached, last_reason)


def report(ledger: Ledger, name: str = "seam") -> List[Dict[str, Any]]:
    """Host-side receipt of a ledger: one entry per seam instance.

    A ledger with leading axes (stacked layers) gives one entry per index,
    named ``name[i]`` (``name[i,j]`` for two axes). A seam state (anything
    with a ``ledger`` field holding a `Ledger`) is reported whole, by
    `eae_jax.fp8.state_report` (its gradient and weight scales too).

    Raises:
      TypeError: neither a `Ledger` nor a seam state.

    Returns:
      A list of dicts with ``seam``, ``calls``, ``fp8_calls``, ``fallbacks``,
      ``by_reason`` (only reasons seen), ``last_reason`` (None if none),
      ``consecutive``, ``detached`` (bool), ``amax``.
    """
    if not isinstance(ledger, Ledger):
        if isinstance(getattr(ledger, "ledger", None), Ledger):
            from eae_jax.fp8.seams import state_report  # seams builds on this module

            return state_report(ledger, name)
        raise TypeError(f"report needs a Ledger or a seam state, got {type(ledger).__name__}")
    arrs = Ledger(*[np.asarray(a) for a in ledger])
    lead = arrs.calls.shape
    out = []
    for index in np.ndindex(*lead) if lead else [()]:
        label = name if not index else f"{name}[{','.join(str(i) for i in index)}]"
        reasons = arrs.reasons[index]
        last = int(arrs.last_reason[index])
        calls = int(arrs.calls[index])
        fp8 = int(arrs.fp8_calls[index])
        out.append({
            "seam": label,
            "calls": calls,
            "fp8_calls": fp8,
            "fallbacks": calls - fp8,
            "by_reason": {REASONS[r]: int(reasons[r]) for r in range(NUM_REASONS) if reasons[r] > 0},
            "last_reason": REASONS[last] if last >= 0 else None,
            "consecutive": int(arrs.consecutive[index]),
            "detached": bool(arrs.detached[index] > 0),
            "amax": [float(a) for a in np.atleast_1d(arrs.amax[index])],
        })
    return out


class LedgerMonitor:
    """Host-side voice of the ledgers: warns once per seam and reason, and
    once when a seam detaches.

    One monitor belongs to one bound seam or block (it remembers what it has
    said; that memory is host state, not part of any computation).
    """

    def __init__(self):
        self._said = set()

    def _say(self, key, message):
        if key in self._said:
            return
        self._said.add(key)
        warnings.warn(message, Fp8FallbackWarning, stacklevel=3)

    def trace_fallback(self, seam: str, reason: str, detail: str) -> None:
        """A trace-time contract failure (said when the seam is traced)."""
        self._say((seam, reason), f"eae_jax.fp8: seam {seam!r} takes its high-precision path: {reason} "
                                  f"({detail}). Every call is counted in the ledger; this is said once.")

    def observe(self, entries: List[Dict[str, Any]]) -> None:
        """Warn about reasons and detachments seen in `report` entries."""
        for e in entries:
            for reason, n in e["by_reason"].items():
                if reason == "detached":
                    continue
                why = ("because another seam of the same block call fell back" if reason == "block"
                       else f"({reason})")
                self._say((e["seam"], reason),
                          f"eae_jax.fp8: seam {e['seam']!r} fell back to high precision {why}; "
                          f"{n} such call(s) so far. Further ones are counted in report() and not repeated here.")
            if e["detached"]:
                self._say((e["seam"], "detached"),
                          f"eae_jax.fp8: seam {e['seam']!r} fell back {e['consecutive']} times in a row "
                          f"(last: {e['last_reason']}) and has detached itself for good: it now always runs "
                          "high precision.")

    def observe_ledgers(self, ledgers: Dict[str, Ledger]) -> None:
        """`observe` for a dict of named (possibly stacked) ledgers of numpy/jax arrays."""
        for name, ledger in ledgers.items():
            self.observe(report(ledger, name))

    def notify(self, ledgers: Dict[str, Ledger]) -> None:
        """From inside a traced step: one ``jax.debug.callback`` handing the
        ledgers to `observe_ledgers` on the host."""
        jax.debug.callback(self.observe_ledgers, ledgers)


def _raise_strict(seam: str, code) -> None:
    from eae_jax.fp8.guards import GuardRefused

    code = int(code)
    if code >= 0:
        raise GuardRefused(f"eae_jax.fp8: seam {seam!r} refused a call in strict mode: {REASONS[code]}")


def strict_check(seam: str, code: jax.Array) -> None:
    """Strict mode, in the graph: a host callback that raises `GuardRefused`
    when ``code >= 0`` (surfacing as a ``JaxRuntimeError`` whose message
    names the seam and reason when the result is fetched)."""
    jax.debug.callback(functools.partial(_raise_strict, seam), code)
