"""`clip_by_norm`: rescale an adjoint whose norm exceeds a bound."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.passes._util import norm_f32, require_float_spec, require_number
from eae_jax.passes.base import AdjointTransformation


class ClipState(NamedTuple):
    """State of `clip_by_norm` at one boundary.

    Attributes:
      norm: float32 scalar, the adjoint's norm before clipping (last call).
      clipped: bool scalar, whether the last call rescaled the adjoint.
    """

    norm: jax.Array
    clipped: jax.Array


def clip_by_norm(max_norm: float) -> AdjointTransformation:
    """Clip one adjoint's Euclidean norm to ``max_norm``.

    The norm is computed in float32. When it exceeds ``max_norm`` the adjoint
    is multiplied by ``max_norm / (norm + 1e-6)`` (the factor cast to the
    adjoint's dtype first), otherwise it is returned unchanged; this is the
    seed's ``ClipPass``. Unlike `optax.clip_by_global_norm` the bound applies
    to each boundary's adjoint separately.

    Args:
      max_norm: positive Python float.

    Returns:
      An `AdjointTransformation` with `ClipState` (last input norm and
      whether it clipped).

    Raises:
      TypeError / ValueError: ``max_norm`` is not a positive number.
    """
    name = "clip_by_norm"
    max_norm = require_number(name, "max_norm", max_norm, low=0.0, low_open=True)

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        return ClipState(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.bool_))

    def update(adjoint, state, ctx):
        del state, ctx
        norm = norm_f32(adjoint)
        clip = norm > max_norm
        factor = (max_norm / (norm + 1e-6)).astype(adjoint.dtype)
        return jnp.where(clip, adjoint * factor, adjoint), ClipState(norm, clip)

    return AdjointTransformation(init, update, f"clip_by_norm({max_norm:g})")
