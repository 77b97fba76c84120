"""Small helpers shared by the built-in passes (private)."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp


def require_float_spec(name: str, spec: Any) -> None:
    """Raise TypeError naming the pass when ``spec`` is not a floating array spec."""
    if not hasattr(spec, "shape") or not hasattr(spec, "dtype"):
        raise TypeError(f"{name}: init expects a jax.ShapeDtypeStruct of the adjoint, got {spec!r}")
    if not jnp.issubdtype(spec.dtype, jnp.floating):
        raise TypeError(f"{name}: adjoints are floating arrays; got dtype {spec.dtype}")


def require_number(name: str, what: str, value: Any, *, low=None, high=None, low_open=False, high_open=False):
    """Validate a static Python number; returns it as float.

    Raises:
      TypeError: not a real number (bools and arrays are refused: these are
        static hyper-parameters, not traced values).
      ValueError: outside ``[low, high]`` (open ends with ``low_open`` /
        ``high_open``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: {what} must be a Python number, got {value!r}")
    value = float(value)
    if value != value:
        raise ValueError(f"{name}: {what} must not be NaN")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name}: {what} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name}: {what} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def require_int(name: str, what: str, value: Any, *, low: int = 0) -> int:
    """Validate a static Python int >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {what} must be a Python int, got {value!r}")
    if int(value) < low:
        raise ValueError(f"{name}: {what} must be >= {low}, got {value}")
    return int(value)


def abs_max(t: jax.Array) -> jax.Array:
    """``max|t|`` as a scalar of ``t``'s dtype; 0 for an empty ``t``.

    0 is the identity of a max over magnitudes, so a size-0 adjoint counts
    as an all-zero one (`jnp.max` of an empty array raises instead). The
    size is static, so this is a trace-time choice.
    """
    if t.size == 0:
        return jnp.zeros((), t.dtype)
    return jnp.max(jnp.abs(t))


def norm_f32(g: jax.Array) -> jax.Array:
    """Euclidean norm of ``g`` computed in float32 (the seed's ``vector_norm(t.float())``)."""
    g = g.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(g * g))


def round_trip(x: jax.Array, dtype: Any, back: Any) -> jax.Array:
    """Cast ``x`` to ``dtype`` and back to ``back``, guaranteed to round.

    XLA may simplify a ``convert(convert(x, narrow), wide)`` pair away when
    excess precision is allowed (``xla_allow_excess_precision``, on by default
    on GPU). The optimization barrier between the two casts keeps the narrow
    value materialised, so the rounding the pass promises really happens.
    """
    narrow = jax.lax.optimization_barrier(x.astype(dtype))
    return narrow.astype(back)


def divide_exact(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE ``a / b`` elementwise, with ``b`` a scalar (or broadcastable).

    XLA's algebraic simplifier turns ``a / broadcast(b)`` (and ``a / const``)
    into ``a * (1 / b)``, which is off by an ulp in ~20% of entries and so
    moves round-half ties. Where a pass promises the seed's exact division
    (``round(g / scale)``), the divisor is materialised at ``a``'s shape
    behind an optimization barrier so XLA sees a plain elementwise divide.
    This costs one temporary of ``a``'s size.
    """
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape)
    return a / jax.lax.optimization_barrier(b)
