"""`clip_by_norm`: rescale an adjoint whose norm exceeds a bound."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.passes._util import abs_max, norm_f32, require_float_spec
from eae_jax.passes.base import AdjointTransformation
from eae_jax.passes.schedule import ScalarOrSchedule, hyper


class ClipState(NamedTuple):
    """State of `clip_by_norm` at one boundary.

    Attributes:
      norm: float32 scalar, the adjoint's norm before clipping (last call).
      clipped: bool scalar, whether the last call rescaled the adjoint.

    Example:
      >>> import jax
      >>> from eae_jax.passes import clip_by_norm
      >>> clip_by_norm(1.0).init(jax.ShapeDtypeStruct((4,), "float32"), None)
      ClipState(norm=Array(0., dtype=float32), clipped=Array(False, dtype=bool))
    """

    norm: jax.Array
    clipped: jax.Array


def _scaled_norm(adjoint, norm):
    """``max|g| * ||g / max|g|||`` (at least float32 precision), for an adjoint
    whose plain float32 norm overflowed; ``norm`` when ``g`` has a NaN/Inf."""
    w = adjoint.astype(jnp.promote_types(adjoint.dtype, jnp.float32))
    m = abs_max(w)  # traced under the cond even for an empty adjoint (never taken: norm 0)
    scaled = (m * norm_f32(w / m)).astype(jnp.float32)
    return jnp.where(jnp.all(jnp.isfinite(w)), scaled, norm)


def clip_by_norm(max_norm: ScalarOrSchedule) -> AdjointTransformation:
    """Clip one adjoint's Euclidean norm to ``max_norm``.

    The norm is computed in float32 (when that overflows for a finite
    adjoint, it is recomputed scaled by ``max|g|``, so a huge adjoint is
    clipped rather than zeroed). When it exceeds ``max_norm`` the adjoint
    is multiplied by ``max_norm / (norm + 1e-6)`` in at least float32 and
    rounded once to its dtype (a float16 adjoint is not zeroed by a factor
    below float16's range), otherwise it is returned unchanged; this is the
    seed's ``ClipPass``. Unlike `optax.clip_by_global_norm` the bound applies
    to each boundary's adjoint separately. An empty (size-0) adjoint has
    norm 0 and is returned unchanged (state: norm 0, not clipped), as in
    every built-in pass.

    Args:
      max_norm: positive Python float, or a schedule of the step
        (`eae_jax.passes.schedule`; a value <= 0 it gives later zeroes
        every adjoint with a nonzero norm).

    Returns:
      An `AdjointTransformation` with `ClipState` (last input norm and
      whether it clipped).

    Raises:
      TypeError / ValueError: ``max_norm`` is not a positive number.
      TypeError (at init): the adjoint spec is not a floating array spec.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import clip_by_norm
      >>> p = clip_by_norm(1.0)
      >>> g = jnp.array([3.0, 4.0])
      >>> out, state = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)
      >>> [round(float(x), 4) for x in out], float(state.norm), bool(state.clipped)
      ([0.6, 0.8], 5.0, True)
      >>> out, state = p.update(jnp.array([0.6, 0.8]), state, None)     # norm 1.0: not above the bound
      >>> bool(state.clipped)
      False
    """
    name = "clip_by_norm"
    bound = hyper(name, "max_norm", max_norm, low=0.0, low_open=True)

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        return ClipState(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.bool_))

    def update(adjoint, state, ctx):
        del state
        max_norm = bound.value if bound.fixed else jnp.maximum(bound.at(ctx.step), 0.0)
        norm = norm_f32(adjoint)
        # A large finite adjoint (an entry above ~1.8e19, or many large ones)
        # overflows the float32 sum of squares; an infinite norm would make the
        # factor 0 and zero the adjoint. Recompute that norm scaled by max|g|.
        norm = jax.lax.cond(jnp.isinf(norm), _scaled_norm, lambda a, n: n, adjoint, norm)
        clip = norm > max_norm
        # The product in (at least) float32, rounded once: a factor cast to
        # float16 underflows to 0 below 6e-8 and would zero the adjoint, and a
        # bfloat16 factor misses the bound by up to 0.4%.
        wide = jnp.promote_types(adjoint.dtype, jnp.float32)
        factor = (max_norm / (norm + 1e-6)).astype(wide)
        clipped = (adjoint.astype(wide) * factor).astype(adjoint.dtype)
        return jnp.where(clip, clipped, adjoint), ClipState(norm, clip)

    return AdjointTransformation(init, update, f"clip_by_norm({bound.label})")
