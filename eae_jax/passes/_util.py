"""Small helpers shared by the built-in passes (private)."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp


def require_float_spec(name: str, spec: Any) -> None:
    """Raise TypeError naming the pass when ``spec`` is not a floating array spec.

    >>> require_float_spec("my_pass", jax.ShapeDtypeStruct((2,), jnp.float32))
    >>> require_float_spec("my_pass", jax.ShapeDtypeStruct((2,), jnp.int32))
    Traceback (most recent call last):
    ...
    TypeError: my_pass: adjoints are floating arrays; got dtype int32
    """
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

    >>> require_number("clip", "max_norm", 2, low=0.0, low_open=True)
    2.0
    >>> require_number("clip", "max_norm", 0.0, low=0.0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: clip: max_norm must be > 0.0, got 0.0
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
    """Validate a static Python int >= ``low``.

    >>> require_int("every_n_steps", "n", 3, low=1)
    3
    >>> require_int("every_n_steps", "n", True, low=1)
    Traceback (most recent call last):
    ...
    TypeError: every_n_steps: n must be a Python int, got True
    """
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

    >>> float(abs_max(jnp.array([1.0, -3.0]))), float(abs_max(jnp.zeros((0, 4))))
    (3.0, 0.0)
    """
    if t.size == 0:
        return jnp.zeros((), t.dtype)
    return jnp.max(jnp.abs(t))


def flat_f32(t: jax.Array) -> jax.Array:
    """``t`` as a float32 vector, for reductions as accurate on any shape as on a vector.

    XLA on CPU reduces a multi-axis array to a scalar as one sequential loop
    nest, whose rounding error grows with the entry count (1e-6 relative at
    a few thousand entries); a vector is reduced with vector accumulators
    (1e-8). Under jit XLA moves a plain reshape past the elementwise ops and
    folds it into the reduction, so the flattened view is put behind an
    optimization barrier; it is a bitcast of ``t``'s buffer (no copy), and
    the cast to float32 stays fused into the reduction that follows.

    >>> flat_f32(jnp.ones((2, 3), jnp.bfloat16)).shape
    (6,)
    """
    return jax.lax.optimization_barrier(t.reshape(-1)).astype(jnp.float32)


def sum_f32(t: jax.Array) -> jax.Array:
    """Sum of every entry of ``t`` in float32 (over `flat_f32`).

    >>> float(sum_f32(jnp.ones((3, 7, 11, 13))))
    3003.0
    """
    return jnp.sum(flat_f32(t))


def norm_f32(g: jax.Array) -> jax.Array:
    """Euclidean norm of ``g`` computed in float32 (the seed's ``vector_norm(t.float())``).

    The one float32 norm of the library: the sum of squares runs over
    `flat_f32`, so a ``(B, S, D)`` adjoint's norm is as accurate as a
    vector's (and, on CPU, at least as accurate as torch's).

    >>> float(norm_f32(jnp.full((2, 8), 0.5)))
    2.0
    """
    v = flat_f32(g)
    return jnp.sqrt(jnp.sum(v * v))


def round_trip(x: jax.Array, dtype: Any, back: Any) -> jax.Array:
    """Cast ``x`` to ``dtype`` and back to ``back``, guaranteed to round.

    XLA may simplify a ``convert(convert(x, narrow), wide)`` pair away when
    excess precision is allowed (``xla_allow_excess_precision``, on by default
    on GPU). The optimization barrier between the two casts keeps the narrow
    value materialised, so the rounding the pass promises really happens.

    >>> round_trip(jnp.array([1.0 + 2**-12]), jnp.float16, jnp.float32).tolist()   # below fp16's ulp at 1
    [1.0]
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

    >>> divide_exact(jnp.array([1.0, 3.0]), 2.0).tolist()
    [0.5, 1.5]
    """
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape)
    return a / jax.lax.optimization_barrier(b)
