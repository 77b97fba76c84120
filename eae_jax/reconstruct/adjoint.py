"""The pass chain applied at one boundary of the backward pass, with statistics."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.passes._util import norm_f32
from eae_jax.passes.base import AdjointTransformation, PassContext, apply_pass


class AtBoundary(NamedTuple):
    """Applies ``passes`` to the adjoint arriving at a boundary.

    Calling it returns ``(adjoint, state, norm_in, norm_out)``: the adjoint
    after the passes, the pass state, and the float32 norms before and after
    them (zeros without ``stats``; a boundary without an adjoint, such as
    int token ids, passes ``None`` through).

    >>> from eae_jax.passes import identity
    >>> at = AtBoundary(identity(), jnp.int32(0), 2, True)
    >>> g, state, n_in, n_out = at(jnp.array([3.0, 4.0]), None, 1)
    >>> float(n_in), float(n_out)
    (5.0, 5.0)
    """

    passes: AdjointTransformation
    step: jax.Array
    num: int
    stats: bool

    def __call__(self, g, state, boundary):
        if g is None:
            zero = jnp.zeros((), jnp.float32)
            return None, state, zero, zero
        norm_in = norm_f32(g) if self.stats else jnp.zeros((), jnp.float32)
        b = jnp.asarray(boundary, jnp.int32)
        with jax.named_scope("passes"):
            g, state = apply_pass(self.passes, g, state, PassContext(b, b, self.step, self.num))
        norm_out = norm_f32(g) if (self.stats and self.passes.name != "identity") else norm_in
        return g, state, norm_in, norm_out

    def in_scan(self, gh, gg, state, boundary):
        """The same inside a reverse scan: a non-float block input passes
        nothing on, so the loop keeps the incoming adjoint ``gg`` (and its type)."""
        gh, state, norm_in, norm_out = self(gh, state, boundary)
        return (gg if gh is None else gh), state, norm_in, norm_out

    def tied(self, g, state, boundary):
        """The same outside a scan, the adjoint that flows on waiting for the
        statistics and pass state (`tie`)."""
        return tie(self(g, state, boundary))


def tie(out: Any):
    """``(g, state, norm_in, norm_out)`` with ``g`` waiting for the rest.

    Nothing downstream needs the statistics and pass state but the step's
    outputs, so outside a scan XLA's scheduler would compute them after the
    last block and keep every block's input adjoint (one boundary each)
    alive until then; in a scan body the loop orders them already.

    >>> g, n = tie((jnp.ones(2), jnp.float32(1)))
    >>> g.shape
    (2,)
    """
    g, rest = out[0], out[1:]
    if g is None:
        return out
    return jax.lax.optimization_barrier((g,) + tuple(rest))
