"""Host-side events: a small synchronous pub/sub bus and the step-to-events bridge.

Nothing in the jitted step emits events (that would need Python side
effects inside ``jit``). Instead the step returns what it measured (the
``stats`` of `Reconstructed.update` and the pass states in the carry) and,
after the step, `emit_step_events` turns those arrays into the seed's
event sequence on an `EventBus`::

    bus = EventBus()
    bus.subscribe("PassApplied", print)
    attach_json_logging(bus)                      # optional: one JSON line per event
    loss, params, carry, stats = step(params, carry, batch)
    emit_step_events(bus, stack, stats, carry, loss=loss)

Event names are the seed's (`EventType`); payload keys follow the seed where
it defines them (``layer_id``, ``block``, ``grad_norm``, ``pass_name``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.carry import AdjointCarry
from eae_jax.passes.base import runs_at


class EventType:
    """Event names (the seed's, so subscribers written for it keep working).

    Example:
      >>> from eae_jax.events import EventType
      >>> EventType.PASS_APPLIED, len(EventType.ALL)
      ('PassApplied', 14)
    """

    FORWARD_STARTED = "ForwardStarted"
    FORWARD_FINISHED = "ForwardFinished"
    BLOCK_RECONSTRUCTED = "BlockReconstructed"
    ADJOINT_CREATED = "AdjointCreated"
    ADJOINT_MODIFIED = "AdjointModified"
    MEMORY_ALLOCATED = "MemoryAllocated"
    MEMORY_RELEASED = "MemoryReleased"
    SCHEDULER_STEP = "SchedulerStep"
    KERNEL_LAUNCH = "KernelLaunch"
    COMMUNICATION_START = "CommunicationStart"
    COMMUNICATION_FINISH = "CommunicationFinish"
    TRAIN_STEP_STARTED = "TrainStepStarted"
    TRAIN_STEP_FINISHED = "TrainStepFinished"
    PASS_APPLIED = "PassApplied"

    #: every name above
    ALL = (
        FORWARD_STARTED, FORWARD_FINISHED, BLOCK_RECONSTRUCTED, ADJOINT_CREATED, ADJOINT_MODIFIED,
        MEMORY_ALLOCATED, MEMORY_RELEASED, SCHEDULER_STEP, KERNEL_LAUNCH, COMMUNICATION_START,
        COMMUNICATION_FINISH, TRAIN_STEP_STARTED, TRAIN_STEP_FINISHED, PASS_APPLIED,
    )


@dataclass
class Event:
    """One event: its type name, a payload of plain Python values, and the host time it was emitted.

    Example:
      >>> from eae_jax.events import Event
      >>> event = Event("PassApplied", {"pass_name": "clip_by_norm(1)"}, timestamp=0.0)
      >>> event.type, event.payload["pass_name"]
      ('PassApplied', 'clip_by_norm(1)')
    """

    type: str
    payload: Dict[str, Any] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)


class EventBus:
    """Synchronous publish/subscribe on the host.

    ``subscribe(event_type, fn)`` registers ``fn(event)``; ``'*'`` receives
    every event. ``emit`` calls the subscribers of the type, then the
    ``'*'`` subscribers, in subscription order; an exception in a
    subscriber propagates to the caller of ``emit``. Recording
    (`start_recording`) keeps every emitted event, handy in tests.

    Example:
      >>> from eae_jax.events import EventBus
      >>> bus, seen = EventBus(), []
      >>> _ = bus.subscribe("TrainStepStarted", lambda e: seen.append(e.payload["step"]))
      >>> bus.start_recording()
      >>> _ = bus.emit("TrainStepStarted", step=3)
      >>> seen, [e.type for e in bus.stop_recording()]
      ([3], ['TrainStepStarted'])
    """

    def __init__(self) -> None:
        self._subscribers: Dict[str, List[Callable[[Event], None]]] = {}
        self._log: List[Event] = []
        self._recording = False

    def subscribe(self, event_type: str, callback: Callable[[Event], None]) -> Callable[[Event], None]:
        """Register ``callback`` for ``event_type`` (or ``'*'``); returns the callback.

        Raises:
          TypeError: ``event_type`` is not a string or ``callback`` not callable.
        """
        if not isinstance(event_type, str) or not event_type:
            raise TypeError(f"event_type must be a non-empty string (an EventType name or '*'), got {event_type!r}")
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        self._subscribers.setdefault(event_type, []).append(callback)
        return callback

    def unsubscribe(self, event_type: str, callback: Callable[[Event], None]) -> None:
        """Remove a callback registered with `subscribe`; unknown ones are ignored."""
        callbacks = self._subscribers.get(event_type, [])
        if callback in callbacks:
            callbacks.remove(callback)

    def emit(self, event_type: str, **payload: Any) -> Event:
        """Build an `Event` with ``payload`` and deliver it; returns it.

        Raises:
          TypeError: ``event_type`` is not a non-empty string, or is ``'*'``.
        """
        if not isinstance(event_type, str) or not event_type or event_type == "*":
            raise TypeError(f"cannot emit an event of type {event_type!r}")
        event = Event(event_type, payload)
        if self._recording:
            self._log.append(event)
        for callback in list(self._subscribers.get(event_type, ())):
            callback(event)
        for callback in list(self._subscribers.get("*", ())):
            callback(event)
        return event

    def start_recording(self) -> None:
        """Start keeping emitted events (clears the previous log)."""
        self._recording = True
        self._log = []

    def stop_recording(self) -> List[Event]:
        """Stop recording and return the events recorded."""
        self._recording = False
        return list(self._log)

    @property
    def log(self) -> List[Event]:
        """A copy of the recorded events."""
        return list(self._log)

    def events_of_type(self, event_type: str) -> List[Event]:
        """Recorded events of one type."""
        return [e for e in self._log if e.type == event_type]


# ---------------------------------------------------------------------------- JSON logging
def _json_default(value: Any) -> Any:
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, (np.ndarray, jax.Array)):
        return np.asarray(value).tolist()
    return str(value)


def event_to_json(event: Event) -> str:
    """One JSON object: ``{"event": type, "timestamp": t, **payload}`` (NaN/Inf as JSON's NaN/Infinity).

    Example:
      >>> from eae_jax.events import Event, event_to_json
      >>> event_to_json(Event("TrainStepFinished", {"loss": float("nan")}, timestamp=1.5))
      '{"event": "TrainStepFinished", "timestamp": 1.5, "loss": NaN}'
    """
    return json.dumps({"event": event.type, "timestamp": event.timestamp, **event.payload}, default=_json_default)


def attach_json_logging(bus: EventBus, logger: Optional[logging.Logger] = None, level: int = logging.INFO,
                        event_type: str = "*") -> Callable[[Event], None]:
    """Log every event (or one type) as one JSON object per line through `logging`.

    Args:
      bus: the bus to listen to.
      logger: default ``logging.getLogger('eae_jax.events')``; configure its
        handlers as usual (nothing is attached here).
      level: the logging level of the records.
      event_type: ``'*'`` (default) or one event name.

    Returns:
      The subscriber, for ``bus.unsubscribe(event_type, it)``.

    Example:
      >>> import logging, sys
      >>> from eae_jax.events import EventBus, attach_json_logging
      >>> logger = logging.getLogger("eae_jax.events.example")
      >>> logger.addHandler(logging.StreamHandler(sys.stdout)); logger.setLevel(logging.INFO)
      >>> bus = EventBus()
      >>> handle = attach_json_logging(bus, logger=logger)
      >>> _ = bus.emit("TrainStepStarted", step=0)  # doctest: +ELLIPSIS
      {"event": "TrainStepStarted", "timestamp": ..., "step": 0}
      >>> bus.unsubscribe("*", handle)
    """
    logger = logger or logging.getLogger("eae_jax.events")

    def log_event(event: Event) -> None:
        if logger.isEnabledFor(level):
            logger.log(level, event_to_json(event))

    return bus.subscribe(event_type, log_event)


# ---------------------------------------------------------------------------- step -> events
def _scalar(x: Any) -> Any:
    """A 0-d numpy value as a plain Python bool/int/float."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return bool(x)
    if np.issubdtype(x.dtype, np.integer):
        return int(x)
    return float(x)


def summarize_state(state: Any) -> Dict[str, Any]:
    """Scalars describing one pass's state at one boundary (for `PassApplied` payloads).

    For a NamedTuple state: each scalar field as a Python value; each other
    numeric array field as ``<field>_norm`` (Euclidean norm, float64 on the
    host); nested containers (predictor params, optax states) and PRNG keys
    are left out. Other states give ``{}``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.events import summarize_state
      >>> from eae_jax.passes import ClipState
      >>> summarize_state(ClipState(norm=jnp.float32(2.0), clipped=jnp.bool_(True)))
      {'norm': 2.0, 'clipped': True}
    """
    out: Dict[str, Any] = {}
    if not (isinstance(state, tuple) and hasattr(state, "_fields")):
        return out
    for name, value in zip(state._fields, state):
        if value is None or not hasattr(value, "dtype"):
            continue
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            continue
        arr = np.asarray(value)
        if arr.ndim == 0:
            out[name] = _scalar(arr)
        elif jnp.issubdtype(arr.dtype, jnp.number):  # bfloat16 and the float8s too (numpy's test misses them)
            out[f"{name}_norm"] = float(np.linalg.norm(arr.astype(np.float64).ravel()))
    return out


def _segment_depths(stack, seg_states, num_boundaries: int, depths: Optional[Sequence[int]]) -> List[int]:
    if depths is not None:
        depths = [int(d) for d in depths]
        if len(depths) != len(stack.segments) or sum(depths) + 1 != num_boundaries:
            raise ValueError(
                f"depths {depths} do not fit this stack: {len(stack.segments)} segments and "
                f"{num_boundaries - 1} blocks"
            )
        return depths
    known: List[Optional[int]] = []
    for seg, st in zip(stack.segments, seg_states):
        if not seg.scanned:
            known.append(1)
            continue
        leaves = jax.tree_util.tree_leaves(st)
        known.append(int(np.shape(leaves[0])[0]) if leaves else None)
    unknown = [i for i, d in enumerate(known) if d is None]
    if len(unknown) > 1:
        raise ValueError(
            "cannot tell the depth of several scanned segments whose pass state is empty; pass depths= "
            "(the first value `Reconstructed.layout` returns)"
        )
    if unknown:
        known[unknown[0]] = num_boundaries - 1 - sum(d for d in known if d is not None)
    if sum(known) + 1 != num_boundaries:
        raise ValueError(f"pass state covers {sum(known)} blocks but the stats cover {num_boundaries - 1}")
    return known


def boundary_states(stack, state: Any, num_boundaries: int, depths: Optional[Sequence[int]] = None) -> List[Any]:
    """Split the decoded pass state into one state per boundary x0..xL.

    Args:
      stack: the `Reconstructed` stack.
      state: ``stack.state(carry)`` (numpy or jax arrays).
      num_boundaries: ``L + 1`` (the length of the step's stats arrays).
      depths: blocks per segment, needed only when the depth of more than
        one scanned segment cannot be read off its state.

    Returns:
      A list of length ``L + 1``; entry i is the pass state of boundary i
      (``None`` for a boundary that carries no adjoint, e.g. int tokens).

    Raises:
      ValueError: the state does not fit the stack or the depth is ambiguous.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import eae_jax
      >>> from eae_jax import passes
      >>> from eae_jax.events import boundary_states
      >>> stack = eae_jax.reconstruct(lambda w, x: jnp.tanh(x * w), passes=passes.clip_by_norm(1.0))
      >>> w, x = jnp.ones((3, 2)), jnp.ones(2)
      >>> carry = stack.init(w, x)
      >>> states = boundary_states(stack, stack.state(carry), num_boundaries=4)
      >>> len(states), type(states[1]).__name__
      (4, 'ClipState')
    """
    if not isinstance(state, dict) or set(state) != {"segments", "top"}:
        raise ValueError("state must be stack.state(carry): a dict with 'segments' and 'top'")
    seg_states = list(state["segments"])
    depths = _segment_depths(stack, seg_states, num_boundaries, depths)
    out: List[Any] = []
    for seg, st, n in zip(stack.segments, seg_states, depths):
        if not seg.scanned:
            out.append(st)
        else:
            for j in range(n):
                out.append(None if st is None else jax.tree_util.tree_map(lambda a, j=j: a[j], st))
    out.append(state["top"])
    return out


def _block_names(stack, depths: List[int]) -> List[str]:
    names = []
    for seg, n in zip(stack.segments, depths):
        names.extend([f"{seg.name}/{j}" for j in range(n)] if seg.scanned else [seg.name])
    return names


def emit_step_events(bus: EventBus, stack, stats: Dict[str, Any], state: Any = None, *, loss: Any = None,
                     depths: Optional[Sequence[int]] = None, **extra: Any) -> List[Event]:
    """Replay one finished train step as the seed's event sequence on ``bus``.

    Call it on the host after the jitted step returned. Order (as the seed
    emits them): ``TrainStepStarted(step)``, ``ForwardStarted(num_blocks)``,
    ``ForwardFinished(num_boundaries)``, ``AdjointCreated(layer_id=L,
    block='output', grad_norm)``, then for the output boundary and for every
    block i = L-1 .. 0: ``BlockReconstructed(block, block_index=i,
    layer_id=i+1, grad_norm, grad_norm_after_passes)`` (block i's VJP, norms
    of the adjoint it produced at boundary i; not for the output), then per
    pass ``PassApplied(pass_name, pass_index, layer_id, block_index,
    **summarize_state(its state))``, plus ``AdjointModified(pass_name,
    layer_id, mean, std, ...)`` for a `statistics` pass where it ran in
    this step (the seed's LoggingPass event); finally
    ``TrainStepFinished(step, loss, calls, **extra)``. Boundaries that
    carry no adjoint (int inputs) get no pass events and ``grad_norm=None``
    when ``state`` is given (without it they cannot be told apart and
    report the zero norm the step recorded).

    ``PassApplied`` is emitted at every boundary the chain runs at; a pass
    wrapped in `at_layers`/`every_n_steps` reports its (unchanged) state
    at the boundaries/steps it skipped.

    Args:
      bus: the `EventBus`.
      stack: the `Reconstructed` stack the step used.
      stats: the dict `Reconstructed.update` returned (needs
        ``adjoint_norm``, ``adjoint_norm_after_passes``, ``step``, ``calls``;
        a stack built with ``stats=False`` reports zeros).
      state: the new carry (`AdjointCarry`) or ``stack.state(carry)``;
        ``None`` skips the pass events.
      loss: optional loss value for ``TrainStepFinished``.
      depths: see `boundary_states`.
      **extra: more ``TrainStepFinished`` payload: arrays become Python
        scalars (0-d) or lists, other values are passed as they are.

    Returns:
      The emitted events, in order.

    Raises:
      ValueError / KeyError: stats or state that do not belong to ``stack``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import eae_jax
      >>> from eae_jax import passes
      >>> from eae_jax.events import EventBus, emit_step_events
      >>> stack = eae_jax.reconstruct(lambda w, x: jnp.tanh(x * w), passes=passes.clip_by_norm(1.0))
      >>> w, x = jnp.ones((2, 2)), jnp.ones(2)
      >>> carry = stack.init(w, x)
      >>> g_c = jax.grad(lambda c: stack(w, x, c).sum())(carry)
      >>> carry, stats = stack.update(carry, g_c)
      >>> events = emit_step_events(EventBus(), stack, stats, carry, loss=0.5)
      >>> [e.type for e in events][:4], events[-1].type
      (['TrainStepStarted', 'ForwardStarted', 'ForwardFinished', 'AdjointCreated'], 'TrainStepFinished')
    """
    missing = [k for k in ("adjoint_norm", "adjoint_norm_after_passes", "step", "calls") if k not in stats]
    if missing:
        raise KeyError(f"stats lacks {missing}; pass the dict returned by Reconstructed.update")
    host = jax.device_get({"stats": dict(stats), "loss": loss, "extra": extra})
    if isinstance(state, AdjointCarry):
        state = stack.state(state)
    host_state = jax.device_get(state) if state is not None else None
    s = host["stats"]
    norms = np.asarray(s["adjoint_norm"], np.float64)
    after = np.asarray(s["adjoint_norm_after_passes"], np.float64)
    num = int(norms.shape[0])
    step = _scalar(s["step"])
    if host_state is not None:
        per_boundary = boundary_states(stack, host_state, num, depths)
        seg_depths = _segment_depths(stack, list(host_state["segments"]), num, depths)
    else:
        per_boundary = [()] * num  # no states: boundaries unknown to be non-float, no pass events
        seg_depths = _segment_depths(stack, [None] * len(stack.segments), num, depths)
    names = _block_names(stack, seg_depths)
    members = stack.passes.members or (stack.passes,)
    chained = bool(stack.passes.members)

    events: List[Event] = []

    def emit(kind, **payload):
        events.append(bus.emit(kind, **payload))

    def pass_events(boundary: int):
        st = per_boundary[boundary]
        if st is None or host_state is None:
            return
        states = st if chained else (st,)
        for idx, (member, mstate) in enumerate(zip(members, states)):
            summary = summarize_state(mstate)
            emit(EventType.PASS_APPLIED, pass_name=member.name, pass_index=idx, layer_id=boundary,
                 block_index=boundary, **summary)
            # Only statistics measured in this step, at this boundary (not an at_layers / every_n_steps
            # pass's untouched state, which would read as zero or stale statistics).
            if type(mstate).__name__ == "StatsState" and runs_at(member, boundary, num, step):
                emit(EventType.ADJOINT_MODIFIED, pass_name=member.name, layer_id=boundary, block_index=boundary,
                     **summary)

    def norm_or_none(values, i):
        return None if per_boundary[i] is None else float(values[i])

    emit(EventType.TRAIN_STEP_STARTED, step=step)
    emit(EventType.FORWARD_STARTED, step=step, num_blocks=num - 1)
    emit(EventType.FORWARD_FINISHED, step=step, num_boundaries=num)
    top = num - 1
    emit(EventType.ADJOINT_CREATED, step=step, layer_id=top, block="output", grad_norm=norm_or_none(norms, top),
         grad_norm_after_passes=norm_or_none(after, top))
    pass_events(top)
    for i in reversed(range(num - 1)):
        emit(EventType.BLOCK_RECONSTRUCTED, step=step, block=names[i], block_index=i, layer_id=i + 1,
             grad_norm=norm_or_none(norms, i), grad_norm_after_passes=norm_or_none(after, i))
        pass_events(i)
    finished = {"step": step, "calls": _scalar(s["calls"])}
    if host["loss"] is not None:
        finished["loss"] = _scalar(host["loss"])
    for key, value in host["extra"].items():
        if isinstance(value, (np.ndarray, np.generic)):  # arrays came back from the device as numpy
            value = _scalar(value) if np.ndim(value) == 0 else np.asarray(value).tolist()
        finished[key] = value
    emit(EventType.TRAIN_STEP_FINISHED, **finished)
    return events
