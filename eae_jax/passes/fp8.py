"""`fp8_quant`: real float8 quantize-dequantize of the adjoint with a per-tensor scale.

Scales follow `eae_jax.fp8.quant`'s convention (the one the fp8 seams use):
``scale = amax * 2**margin / fp8_max``, quantized ``x * (1 / scale)``,
dequantized ``q * scale``; formats come from `eae_jax.dtypes.FP8_FORMATS`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.dtypes import FP8_FORMATS
from eae_jax.fp8.quant import dequantize, fp8_max, quantize, scale_from_amax
from eae_jax.passes._util import abs_max, require_float_spec, require_int
from eae_jax.passes.base import AdjointTransformation

_SCALINGS = ("current", "delayed")


class Fp8State(NamedTuple):
    """``scale``: the dequantization scale the last call used (current) or the
    next will (delayed; while the history holds no nonzero amax, the one the
    last call used); ``amax_history``: newest first (``(1,)`` when current).

    >>> Fp8State(jnp.zeros(()), jnp.zeros((1,))).amax_history.shape
    (1,)
    """

    scale: jax.Array
    amax_history: jax.Array


def fp8_format_max(format: str) -> float:
    """Largest finite value of the fp8 format ``'e4m3'`` (448) or ``'e5m2'`` (57344).

    >>> fp8_format_max("e5m2")
    57344.0
    """
    if format not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FP8_FORMATS)}, got {format!r}")
    return fp8_max(format)


def fp8_quant(format: str = "e4m3", scaling: str = "current", history_len: int = 16,
              margin: int = 0) -> AdjointTransformation:
    """Quantize the adjoint to float8 and dequantize it (real fp8 rounding, kept
    from being folded away): ``cast_fp8(clip(g * (1 / scale)))`` times
    ``scale``, clipped to 448 (``e4m3``) or 57344 (``e5m2``). ``'current'``
    scaling takes ``scale = amax * 2**margin / fp8_max`` of this adjoint;
    ``'delayed'`` (TransformerEngine style) takes the max of the previous
    ``history_len`` amaxes (this one while none), then records this amax (0
    if not finite). A 0 or non-finite amax gives scale 1; an empty adjoint
    passes through and counts as all zeros.

    >>> p = fp8_quant("e4m3")
    >>> g = jnp.array([448.0, 1.1])
    >>> out, state = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)
    >>> out.tolist(), float(state.scale)
    ([448.0, 1.125], 1.0)

    Raises ValueError for an unknown format or scaling, a bad ``history_len``
    or ``margin``; TypeError at init for a non-float adjoint.
    """
    fp8_format_max(format)  # validates the name
    if scaling not in _SCALINGS:
        raise ValueError(f"fp8_quant: scaling must be one of {list(_SCALINGS)}, got {scaling!r}")
    history_len = require_int("fp8_quant", "history_len", history_len, low=1)
    margin = require_int("fp8_quant", "margin", margin, low=0)
    name = f"fp8_quant({format}, {scaling})"
    hist = history_len if scaling == "delayed" else 1

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        return Fp8State(jnp.zeros((), jnp.float32), jnp.zeros((hist,), jnp.float32))

    def update(adjoint, state, ctx):
        del ctx
        t = adjoint.astype(jnp.float32)
        amax = abs_max(t)  # 0 for an empty adjoint
        if scaling == "current":
            scale = scale_from_amax(amax, format, margin)
            new_state = Fp8State(scale, amax[None])
        else:
            prev = jnp.max(state.amax_history)
            scale = scale_from_amax(jnp.where(prev > 0, prev, amax), format, margin)
            history = jnp.roll(state.amax_history, 1).at[0].set(jnp.where(jnp.isfinite(amax), amax, 0.0))
            top = jnp.max(history)
            new_state = Fp8State(jnp.where(top > 0, scale_from_amax(top, format, margin), scale), history)
        # The barrier keeps XLA from folding the fp8 cast pair away (excess precision on GPU).
        q = jax.lax.optimization_barrier(quantize(t, scale, format))
        return dequantize(q, scale).astype(adjoint.dtype), new_state

    return AdjointTransformation(init, update, name)
