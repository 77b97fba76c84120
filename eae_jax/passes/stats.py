"""`statistics`: summary statistics of the adjoint, returned through the pass state."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.passes._util import flat_f32, require_float_spec
from eae_jax.passes.base import AdjointTransformation

_INT32_MAX = 2**31 - 1


class StatsState(NamedTuple):
    """Statistics of the last adjoint seen at one boundary (float32 unless noted).

    Attributes:
      mean, std, min, max, norm: float32 scalars; ``std`` is the population
        standard deviation (``ddof=0``, the seed's ``unbiased=False``), 0 for a
        single element; ``norm`` the Euclidean norm.
      numel: int32 scalar, number of entries.
      has_nan, has_inf: bool scalars.

    Example:
      >>> import jax
      >>> from eae_jax.passes import statistics
      >>> statistics().init(jax.ShapeDtypeStruct((3,), "float32"), None).numel
      Array(0, dtype=int32)
    """

    mean: jax.Array
    std: jax.Array
    min: jax.Array
    max: jax.Array
    norm: jax.Array
    numel: jax.Array
    has_nan: jax.Array
    has_inf: jax.Array


def _moments(t: jax.Array):
    """``(mean, population std, Euclidean norm)`` of ``t`` in float32, every
    sum over the flattened entries (`flat_f32`: as accurate on any shape)."""
    v = flat_f32(t)
    n = jnp.float32(v.size)
    mean = jnp.sum(v) / n
    # Two-pass population variance: stabler than E[x^2] - E[x]^2.
    std = jnp.sqrt(jnp.sum(jnp.square(v - mean)) / n)
    return mean, std, jnp.sqrt(jnp.sum(v * v))


def _scaled_moments(t: jax.Array, moments):
    """`_moments` of a finite ``t`` computed on ``t / max|t|`` and scaled back
    (the overflow-free form; ``moments`` are the plain ones, unused)."""
    del moments
    m = jnp.max(jnp.abs(t))
    mean, std, norm = _moments(t / m)
    return mean * m, std * m, norm * m


def _zero_stats() -> StatsState:
    """All statistics 0/False, ``numel`` 0: the initial state, and that of an empty adjoint.

    Every field is its own array: a state whose fields share one buffer
    cannot be donated (``jit(..., donate_argnums=...)`` refuses to donate
    a buffer twice), and training donates its state.
    """
    return StatsState(*(jnp.zeros((), dtype) for dtype in (jnp.float32,) * 5 + (jnp.int32, jnp.bool_, jnp.bool_)))


def statistics() -> AdjointTransformation:
    """Observe the adjoint without changing it.

    The seed's ``LoggingPass``: computes ``mean, std, min, max, norm, numel,
    has_nan, has_inf`` of the adjoint (in float32; for a finite adjoint whose
    squares or sum overflow float32, computed on it scaled by its largest
    magnitude, so they stay finite when representable) and keeps them in the
    state, so after a jitted step ``stack.state(carry)`` holds them for every
    boundary (scanned segments: one entry per boundary along the leading
    axis). `eae_jax.events.emit_step_events` turns them into events.

    An empty (size-0) adjoint is a legal adjoint and passes through like any
    other (as in every built-in pass); its statistics are ``numel`` 0,
    ``norm`` 0, ``has_nan``/``has_inf`` False, and ``mean, std, min, max``
    (undefined over no entries) reported as 0 -- the state `init` gives,
    i.e. that of an all-zero adjoint with ``numel`` 0 saying it is empty.

    Returns:
      An `AdjointTransformation` with `StatsState`.

    Raises:
      TypeError (at init): the adjoint spec is not a floating array spec.
      ValueError (at init): the adjoint has more than 2**31-1 entries.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import statistics
      >>> p = statistics()
      >>> g = jnp.array([3.0, 4.0])
      >>> out, s = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)
      >>> [float(v) for v in (s.mean, s.std, s.min, s.max, s.norm)], int(s.numel), bool(s.has_nan)
      ([3.5, 0.5, 3.0, 4.0, 5.0], 2, False)
    """
    name = "statistics"

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        numel = math.prod(spec.shape)
        if numel > _INT32_MAX:
            raise ValueError(f"statistics: adjoint of shape {tuple(spec.shape)} has more than 2**31-1 entries")
        return _zero_stats()

    def update(adjoint, state, ctx):
        del state, ctx
        if adjoint.size == 0:
            # min/max have no identity; mean/std would be 0/0. Static shape: a trace-time choice.
            return adjoint, _zero_stats()
        t = adjoint.astype(jnp.float32)
        has_nan, has_inf = jnp.any(jnp.isnan(t)), jnp.any(jnp.isinf(t))
        moments = _moments(t)
        # A finite adjoint with large entries (the squares overflow above
        # ~1.8e19, the sum above ~3.4e38 / numel) would report an infinite
        # norm or std: recompute those moments on t / max|t| and scale back.
        overflow = ~(has_nan | has_inf) & ~jnp.all(jnp.isfinite(jnp.stack(moments)))
        mean, std, norm = jax.lax.cond(overflow, _scaled_moments, lambda t_, m: m, t, moments)
        new = StatsState(
            mean=mean,
            std=std,
            min=jnp.min(t),
            max=jnp.max(t),
            norm=norm,
            numel=jnp.asarray(t.size, jnp.int32),
            has_nan=has_nan,
            has_inf=has_inf,
        )
        return adjoint, new

    return AdjointTransformation(init, update, name)
