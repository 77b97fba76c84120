"""`topk_compress`: magnitude sparsification of the adjoint with error feedback."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from eae_jax.passes._util import require_float_spec, require_number
from eae_jax.passes.base import AdjointTransformation


class TopKState(NamedTuple):
    """State of `topk_compress` at one boundary.

    Attributes:
      residual: float32 array of the adjoint's shape: what the last call
        dropped (added back before the next selection); ``None`` without
        error feedback.
      kept: int32 scalar, entries kept by the last call (>= k on ties).

    Example:
      >>> import jax
      >>> from eae_jax.passes import topk_compress
      >>> state = topk_compress(0.5).init(jax.ShapeDtypeStruct((4,), "float32"), None)
      >>> state.residual.tolist(), int(state.kept)
      ([0.0, 0.0, 0.0, 0.0], 0)
    """

    residual: Optional[jax.Array]
    kept: jax.Array


def num_kept(numel: int, ratio: float) -> int:
    """``k = max(1, int(numel * (1 - ratio)))``: entries `topk_compress` keeps (before ties).

    0 for ``numel == 0`` (an empty adjoint has nothing to keep).

    Example:
      >>> from eae_jax.passes.topk import num_kept
      >>> num_kept(10, 0.75), num_kept(10, 0.99), num_kept(0, 0.5)
      (2, 1, 0)
    """
    if numel == 0:
        return 0
    return max(1, int(numel * (1.0 - ratio)))


def topk_compress(ratio: float, error_feedback: bool = True) -> AdjointTransformation:
    """Keep the largest-magnitude entries of the adjoint, zero the rest.

    ``ratio`` is the fraction of entries *dropped* (the seed's
    ``AdjointState.compress(ratio)``): ``k = max(1, int(numel * (1 -
    ratio)))`` entries are kept, namely every entry whose ``|value|`` is >=
    the k-th largest ``|value|`` (so ties at the threshold can keep a few
    more than k). ``ratio=0`` keeps everything; ``ratio=0.9`` keeps 10%.

    With ``error_feedback`` the selection runs on ``acc = adjoint +
    residual`` (float32) and ``residual = acc - kept_part`` (the kept part
    after the cast back to the adjoint's dtype, so a low-precision adjoint's
    rounding is fed back too) is carried to the next call at this boundary, so dropped mass is delayed, not lost (the
    classic error-feedback scheme of sparsified SGD). Without it this is
    exactly ``AdjointState.compress(ratio)``.

    An empty (size-0) adjoint is a legal adjoint: it is returned unchanged
    with ``kept`` 0 and an empty residual, as in every built-in pass.

    Args:
      ratio: Python float in ``[0, 1)``.
      error_feedback: carry the residual in the state.

    Returns:
      An `AdjointTransformation` with `TopKState`. The output keeps the
      adjoint's dtype (the kept part is cast back).

    Raises:
      TypeError / ValueError: ``ratio`` outside ``[0, 1)``.
      TypeError (at init): the adjoint spec is not a floating array spec.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import topk_compress
      >>> p = topk_compress(0.5)                       # keep 2 of 4 entries
      >>> g = jnp.array([0.1, -3.0, 2.0, 0.5])
      >>> out, state = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)
      >>> out.tolist(), state.residual.tolist(), int(state.kept)
      ([0.0, -3.0, 2.0, 0.0], [0.10000000149011612, 0.0, 0.0, 0.5], 2)
    """
    ratio = require_number("topk_compress", "ratio", ratio, low=0.0, high=1.0, high_open=True)
    if not isinstance(error_feedback, bool):
        raise TypeError(f"topk_compress: error_feedback must be a bool, got {error_feedback!r}")
    name = f"topk_compress({ratio:g}{', ef' if error_feedback else ''})"

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        residual = jnp.zeros(spec.shape, jnp.float32) if error_feedback else None
        return TopKState(residual, jnp.zeros((), jnp.int32))

    def update(adjoint, state, ctx):
        del ctx
        acc = adjoint.astype(jnp.float32)
        if error_feedback:
            acc = acc + state.residual
        flat = jnp.abs(acc).reshape(-1)
        k = num_kept(flat.size, ratio)
        if k >= flat.size:
            kept_part = acc
            mask = jnp.ones(acc.shape, jnp.bool_)
        else:
            threshold = jax.lax.top_k(flat, k)[0][k - 1]  # the k-th largest magnitude
            mask = jnp.abs(acc) >= threshold
            kept_part = jnp.where(mask, acc, jnp.zeros_like(acc))
        out = kept_part.astype(adjoint.dtype)
        residual = (acc - out.astype(jnp.float32)) if error_feedback else None
        return out, TopKState(residual, jnp.sum(mask, dtype=jnp.int32))

    return AdjointTransformation(init, update, name)
