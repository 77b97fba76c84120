"""Pass hyper-parameters that follow a schedule of the training step.

A pass's numeric hyper-parameter (`clip_by_norm`'s ``max_norm``,
`decay`'s ``strength``, `gaussian_noise`'s ``std``) is a Python number or
an optax schedule, ``schedule(step) -> value``, such as
``optax.linear_schedule(1e-2, 0.0, 1000)``. The step is
`PassContext.step`: the carry's step under `eae_jax.reconstruct` (updates
folded in so far), the transform's update count under `to_optax`.

A schedule is checked once, at step 0, against the bounds of the
hyper-parameter; its later values are used as they come (each pass says
how it treats a value out of bounds).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.passes._util import require_number

#: A hyper-parameter: a Python number, or an optax schedule of the step
#: (``Callable[[step], value]``, what ``optax.Schedule`` names).
ScalarOrSchedule = Union[float, Callable[[Any], Any]]


class Hyper(NamedTuple):
    """A checked hyper-parameter: a fixed number or a schedule of the step.

    Attributes:
      value: the number (None for a schedule).
      schedule: the schedule (None for a number).

    >>> import optax
    >>> h = hyper("noise", "std", optax.linear_schedule(1.0, 0.0, 10), low=0.0)
    >>> h.fixed, h.label, float(h.at(jnp.int32(5)))
    (False, 'schedule', 0.5)
    """

    value: Optional[float]
    schedule: Optional[Callable[[Any], Any]]

    @property
    def fixed(self) -> bool:
        """Whether this is a plain number."""
        return self.schedule is None

    @property
    def label(self) -> str:
        """How pass names show it: the number, or ``'schedule'``."""
        return f"{self.value:g}" if self.fixed else "schedule"

    def at(self, step: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
        """The value at ``step`` (an int32 scalar, traced) as a scalar of ``dtype``."""
        if self.fixed:
            return jnp.asarray(self.value, dtype)
        return jnp.asarray(self.schedule(step)).astype(dtype)


def hyper(name: str, what: str, value: ScalarOrSchedule, *, finite: bool = False, **bounds: Any) -> Hyper:
    """Check a hyper-parameter that may be a schedule.

    Args:
      name: the pass, for errors.
      what: the hyper-parameter, for errors.
      value: a Python number or a schedule of the step.
      finite: refuse infinities.
      **bounds: ``low``, ``high``, ``low_open``, ``high_open`` as for a
        number; a schedule's value at step 0 must meet them (and
        ``finite``).

    Raises:
      TypeError / ValueError: a number out of bounds or of the wrong type, a
        schedule that fails at step 0 or gives no real scalar there, or
        whose value at step 0 is out of bounds; the message names the pass.

    >>> hyper("clip_by_norm", "max_norm", 0.5, low=0.0, low_open=True)
    Hyper(value=0.5, schedule=None)
    >>> hyper("clip_by_norm", "max_norm", lambda step: 0.0 * step, low=0.0, low_open=True)
    Traceback (most recent call last):
    ValueError: clip_by_norm: max_norm schedule at step 0: max_norm must be > 0.0, got 0.0
    """
    if not callable(value):
        return Hyper(_check(name, what, value, finite, bounds), None)
    try:
        first = np.asarray(value(jnp.int32(0)))
    except Exception as err:
        raise TypeError(f"{name}: the {what} schedule failed at step 0: {err}") from err
    if first.shape != () or not (np.issubdtype(first.dtype, np.floating) or np.issubdtype(first.dtype, np.integer)):
        raise TypeError(f"{name}: a {what} schedule must return a real scalar, got {first.dtype}{list(first.shape)} "
                        "at step 0")
    try:
        _check(name, what, float(first), finite, bounds)
    except ValueError as err:
        raise ValueError(f"{name}: {what} schedule at step 0: {str(err).split(': ', 1)[1]}") from None
    return Hyper(None, value)


def _check(name: str, what: str, value: Any, finite: bool, bounds: dict) -> float:
    value = require_number(name, what, value, **bounds)
    if finite and value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: {what} must be finite, got {value}")
    return value
