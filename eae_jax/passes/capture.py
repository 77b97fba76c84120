"""`capture`: hand the adjoint at a boundary back to the caller."""

from __future__ import annotations

from typing import NamedTuple

import jax

from eae_jax.passes._util import require_float_spec
from eae_jax.passes.base import AdjointTransformation


class CaptureState(NamedTuple):
    """State of `capture` at one boundary.

    Attributes:
      adjoint: the adjoint as it reached `capture` in the last backward pass
        (zeros before the first; shape and dtype of the adjoint).

    Example:
      >>> import jax
      >>> from eae_jax.passes import capture
      >>> capture().init(jax.ShapeDtypeStruct((2,), "float32"), None).adjoint.tolist()
      [0.0, 0.0]
    """

    adjoint: jax.Array


def capture() -> AdjointTransformation:
    """Store the adjoint in the state, unchanged.

    After the step, ``stack.state(carry)`` holds the adjoint at every
    boundary the pass ran at, so the caller can continue backprop outside
    the stack (e.g. ``jax.vjp`` of an embedding lookup with the adjoint at
    boundary 0). The value is the adjoint as it reaches `capture` in the
    chain: put it first to see the raw VJP output, last to see what flows
    on. Combine with `at_layers` to choose the boundary. The state (one
    adjoint-sized array) exists at every boundary, selected by `at_layers`
    or not; for the adjoint of the stack's input alone, differentiating
    with respect to ``x`` is cheaper.

    Returns:
      An `AdjointTransformation` with `CaptureState`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import capture
      >>> p = capture()
      >>> g = jnp.array([1.0, -2.0])
      >>> out, state = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)
      >>> out.tolist(), state.adjoint.tolist()
      ([1.0, -2.0], [1.0, -2.0])
    """
    name = "capture"

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        return CaptureState(jax.numpy.zeros(spec.shape, spec.dtype))

    def update(adjoint, state, ctx):
        del state, ctx
        return adjoint, CaptureState(adjoint)

    return AdjointTransformation(init, update, name)
