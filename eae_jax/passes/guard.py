"""`nonfinite_guard`: deal with NaN/Inf adjoints."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.passes._util import require_float_spec
from eae_jax.passes.base import AdjointTransformation

_POLICIES = ("zero", "skip", "raise")


class GuardState(NamedTuple):
    """State of `nonfinite_guard` at one boundary.

    Attributes:
      count: int32 scalar, calls so far whose adjoint had a NaN/Inf entry.
      last_bad: int32 scalar, number of NaN/Inf entries in the last adjoint.

    Example:
      >>> import jax
      >>> from eae_jax.passes import nonfinite_guard
      >>> nonfinite_guard().init(jax.ShapeDtypeStruct((2,), "float32"), None)
      GuardState(count=Array(0, dtype=int32), last_bad=Array(0, dtype=int32))
    """

    count: jax.Array
    last_bad: jax.Array


class NonFiniteAdjointError(FloatingPointError):
    """Raised on the host by ``nonfinite_guard(policy='raise')``.

    Example:
      >>> from eae_jax.passes import NonFiniteAdjointError
      >>> issubclass(NonFiniteAdjointError, FloatingPointError)
      True
    """


def _raise_if_bad(boundary, bad, numel):
    bad = int(np.asarray(bad))
    if bad:
        raise NonFiniteAdjointError(
            f"nonfinite_guard: the adjoint at boundary {int(np.asarray(boundary))} has {bad} non-finite "
            f"(NaN/Inf) entries out of {int(numel)}"
        )


def nonfinite_guard(policy: str = "zero") -> AdjointTransformation:
    """Detect NaN/Inf entries in the adjoint and act on them.

    Policies:
      ``'zero'``: replace each non-finite entry by 0, keep the rest.
      ``'skip'``: if any entry is non-finite, zero the whole adjoint (nothing
      flows below this boundary in this step; parameter gradients of the
      blocks below become 0).
      ``'raise'``: leave the adjoint unchanged but call back to the host,
      which raises `NonFiniteAdjointError` naming the boundary. The callback
      runs while the compiled step executes, so the error surfaces as a
      runtime error of the jitted call (a ``jax.errors.JaxRuntimeError``
      whose message contains the guard's message), not at trace time.
      Asynchronous dispatch may delay it to the first use of the step's
      results.

    Every policy counts the calls with a non-finite adjoint in the state.

    Args:
      policy: ``'zero'``, ``'skip'`` or ``'raise'``.

    Returns:
      An `AdjointTransformation` with `GuardState`.

    Raises:
      ValueError: unknown policy.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import nonfinite_guard
      >>> g = jnp.array([1.0, jnp.nan, jnp.inf])
      >>> spec = jax.ShapeDtypeStruct(g.shape, g.dtype)
      >>> for policy in ("zero", "skip"):
      ...     p = nonfinite_guard(policy)
      ...     out, state = p.update(g, p.init(spec, None), None)
      ...     print(policy, out.tolist(), int(state.count), int(state.last_bad))
      zero [1.0, 0.0, 0.0] 1 2
      skip [0.0, 0.0, 0.0] 1 2
    """
    if policy not in _POLICIES:
        raise ValueError(f"nonfinite_guard: policy must be one of {list(_POLICIES)}, got {policy!r}")
    name = f"nonfinite_guard({policy})"

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        return GuardState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def update(adjoint, state, ctx):
        finite = jnp.isfinite(adjoint)
        bad = jnp.sum(~finite, dtype=jnp.int32)
        any_bad = bad > 0
        new_state = GuardState(state.count + any_bad.astype(jnp.int32), bad)
        zeros = jnp.zeros_like(adjoint)
        if policy == "zero":
            out = jnp.where(finite, adjoint, zeros)
        elif policy == "skip":
            out = jnp.where(any_bad, zeros, adjoint)
        else:
            jax.debug.callback(_raise_if_bad, ctx.boundary, bad, adjoint.size)
            out = adjoint
        return out, new_state

    return AdjointTransformation(init, update, name)
