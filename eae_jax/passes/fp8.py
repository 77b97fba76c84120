"""`fp8_quant`: real float8 quantize-dequantize of the adjoint with a per-tensor scale."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.passes._util import abs_max, require_float_spec, require_int, round_trip
from eae_jax.passes.base import AdjointTransformation

_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_SCALINGS = ("current", "delayed")


class Fp8State(NamedTuple):
    """State of `fp8_quant` at one boundary.

    Attributes:
      scale: float32 scalar. With ``scaling='current'`` the scale the last
        call used; with ``'delayed'`` the scale the *next* call will use
        (computed from ``amax_history``); 0 before the first call.
        Dequantized values are ``fp8 * (1 / scale)``.
      amax_history: float32 ``(history_len,)`` with the newest ``max|g|`` at
        index 0 (``(1,)`` for current scaling: the last amax).
    """

    scale: jax.Array
    amax_history: jax.Array


def fp8_format_max(format: str) -> float:
    """Largest finite value of the fp8 format ``'e4m3'`` (448) or ``'e5m2'`` (57344)."""
    if format not in _FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(_FORMATS)}, got {format!r}")
    return float(jnp.finfo(_FORMATS[format]).max)


#: Largest scale used: its inverse, the dequantization factor, is the smallest
#: normal float32 (a larger scale's inverse would be subnormal, flushed to 0).
_MAX_SCALE = 2.0 ** 126


def _scale_from_amax(amax, fp8_max, margin, fallback):
    """``min(fp8_max / amax / 2**margin, 2**126)``; ``fallback`` where amax is 0 or not finite."""
    good = jnp.isfinite(amax) & (amax > 0)
    safe = jnp.where(good, amax, jnp.ones_like(amax))
    return jnp.where(good, jnp.minimum((fp8_max / safe) / (2.0 ** margin), _MAX_SCALE), fallback)


def fp8_quant(format: str = "e4m3", scaling: str = "current", history_len: int = 16,
              margin: int = 0) -> AdjointTransformation:
    """Quantize the adjoint to float8 and dequantize it (real fp8 rounding).

    In float32: ``q = cast_fp8(clip(g * scale, -fp8_max, fp8_max))``,
    result ``float32(q) * (1 / scale)`` cast back to the adjoint's dtype, with
    ``fp8_max`` 448 (``e4m3``, `jnp.float8_e4m3fn`) or 57344 (``e5m2``,
    `jnp.float8_e5m2`). The clip saturates values a stale scale would push
    out of range (e4m3fn has no inf and would give NaN). The cast rounds to
    nearest even, including fp8 subnormals; XLA cannot fold the cast pair
    away (see ``eae_jax.passes._util.round_trip``).

    Scaling:
      ``'current'``: ``scale = fp8_max / amax / 2**margin`` from this
      adjoint's ``amax = max|g|``.
      ``'delayed'`` (Transformer-Engine style): the scale comes from the
      maximum of the amaxes of the previous ``history_len`` calls at this
      boundary (the amax history); then the current amax is pushed into the
      history (rolled each call, newest at index 0; a non-finite amax is
      recorded as 0, i.e. ignored) and the scale for the next call is stored.
      While the history holds no positive amax (first call) the current amax
      is used. A scale whose amax is 0 or non-finite falls back to 1.0.
      Scales are capped at ``2**126`` so that ``1 / scale`` stays a normal
      float32: a tiny adjoint (amax below about ``fp8_max * 2**-126``) would
      otherwise get an infinite scale or a subnormal inverse (flushed to 0)
      and come out NaN or zero.

    An empty (size-0) adjoint is a legal adjoint: it is returned unchanged
    and counts as an all-zero one (``amax = 0``: the scale falls back to
    1.0 and a 0 is recorded in the history), as in every built-in pass.

    Args:
      format: ``'e4m3'`` or ``'e5m2'``.
      scaling: ``'current'`` or ``'delayed'``.
      history_len: length of the amax history (delayed scaling), >= 1.
      margin: int >= 0; the scale is divided by ``2**margin`` to leave
        headroom.

    Returns:
      An `AdjointTransformation` with `Fp8State`.

    Raises:
      ValueError: unknown format or scaling, bad ``history_len``/``margin``.
      TypeError (at init): the adjoint spec is not a floating array spec.
    """
    fp8_max = fp8_format_max(format)
    fp8_dtype = _FORMATS[format]
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

    def qdq(t, scale):
        q = round_trip(jnp.clip(t * scale, -fp8_max, fp8_max), fp8_dtype, jnp.float32)
        # Dequantize by multiplying with the inverse scale (as fp8 GEMMs take
        # scale_inv); written out so no backend decides between q/s and q*(1/s).
        return q * (1.0 / scale)

    def update(adjoint, state, ctx):
        del ctx
        t = adjoint.astype(jnp.float32)
        amax = abs_max(t)  # 0 for an empty adjoint
        if scaling == "current":
            scale = _scale_from_amax(amax, fp8_max, margin, jnp.ones_like(amax))
            new_state = Fp8State(scale, amax[None])
        else:
            prev = jnp.max(state.amax_history)
            # No informative amax recorded yet (first call, or only zero /
            # non-finite adjoints so far): fall back to the current amax.
            used = _scale_from_amax(jnp.where(prev > 0, prev, amax), fp8_max, margin, jnp.ones_like(amax))
            recorded = jnp.where(jnp.isfinite(amax), amax, jnp.zeros_like(amax))
            history = jnp.roll(state.amax_history, 1).at[0].set(recorded)
            nxt = _scale_from_amax(jnp.max(history), fp8_max, margin, used)
            scale, new_state = used, Fp8State(nxt, history)
        return qdq(t, scale).astype(adjoint.dtype), new_state

    return AdjointTransformation(init, update, name)
