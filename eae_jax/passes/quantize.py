"""Reduced-precision round trips of the adjoint: `cast_roundtrip`, `int8_fake_quant`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from eae_jax.dtypes import dtype_name, parse_compute_dtype
from eae_jax.passes._util import abs_max, divide_exact, require_float_spec, round_trip
from eae_jax.passes.base import AdjointTransformation, stateless


def cast_roundtrip(dtype: Any) -> AdjointTransformation:
    """Cast the adjoint to ``dtype`` and back (round to nearest even).

    The seed's ``FP16Pass`` generalised: ``'fp16'`` reproduces it exactly,
    ``'bf16'`` does the same through bfloat16. Values beyond the narrow
    format's range become ``inf`` (fp16) as a real cast would. fp8 names are
    accepted too, but a raw fp8 cast has no scale (most adjoints underflow,
    e4m3 overflows to NaN); use `fp8_quant` for fp8. The rounding is kept
    even when XLA would fold a down-then-up cast pair (see
    ``eae_jax.passes._util.round_trip``).

    Args:
      dtype: a name accepted by `eae_jax.dtypes.parse_compute_dtype`
        (``fp16``, ``bf16``, ...) or a floating dtype.

    Returns:
      A stateless `AdjointTransformation`; the adjoint keeps its dtype.

    Raises:
      ValueError: unknown or non-floating dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.passes import EmptyState, cast_roundtrip
      >>> p = cast_roundtrip("bf16")
      >>> out, _ = p.update(jnp.array([1.0 + 2**-9, 3.0]), EmptyState(), None)   # bf16 keeps 8 bits
      >>> p.name, out.tolist(), out.dtype.name
      ('cast_roundtrip(bf16)', [1.0, 3.0], 'float32')
    """
    target = parse_compute_dtype(dtype)
    name = f"cast_roundtrip({dtype_name(target)})"

    return stateless(lambda adjoint, ctx: round_trip(adjoint, target, adjoint.dtype), name)


class Int8State(NamedTuple):
    """State of `int8_fake_quant` at one boundary.

    Attributes:
      scale: float32 scalar, ``max|g| / 127`` of the last adjoint (0 for an
        all-zero adjoint, which is left untouched).

    Example:
      >>> import jax
      >>> from eae_jax.passes import int8_fake_quant
      >>> int8_fake_quant().init(jax.ShapeDtypeStruct((3,), "float32"), None)
      Int8State(scale=Array(0., dtype=float32))
    """

    scale: jax.Array


def int8_fake_quant() -> AdjointTransformation:
    """Per-tensor symmetric int8 fake quantization of the adjoint.

    In float32: ``scale = max|g| / 127``, ``q = clip(round(g / scale), -127,
    127)`` (round half to even), result ``(q * scale)`` cast back to the
    adjoint's dtype. An all-zero adjoint is returned unchanged, and so is an
    empty (size-0) one, which counts as all-zero (scale 0), as in every
    built-in pass; a tiny one
    (``max|g| < 127 * finfo(float32).tiny``, whose scale would be subnormal
    and flushed to zero) is quantized scaled up by ``2**64`` and scaled
    back, instead of turning into NaN. This is the
    seed's ``Int8QuantizationPass``; the scale it used is kept in the state
    (the seed's ``metadata['quantization_scale']``). Both divisions are
    IEEE divisions like torch's, so the result equals the seed's bit for bit
    (XLA would otherwise multiply by a reciprocal and move rounding ties;
    this costs one adjoint-sized float32 temporary).

    Returns:
      An `AdjointTransformation` with `Int8State`.

    Raises:
      TypeError (at init): the adjoint spec is not a floating array spec.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import int8_fake_quant
      >>> p = int8_fake_quant()
      >>> g = jnp.array([127.0, 0.5, 1.5, -2.5])      # scale 1: ties round to even
      >>> out, state = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)
      >>> out.tolist(), float(state.scale)
      ([127.0, 0.0, 2.0, -2.0], 1.0)
    """
    name = "int8_fake_quant"

    def init(spec, key):
        del key
        require_float_spec(name, spec)
        return Int8State(jnp.zeros((), jnp.float32))

    def update(adjoint, state, ctx):
        del state, ctx
        t = adjoint.astype(jnp.float32)
        max_abs = abs_max(t)  # 0 for an empty adjoint
        scale = divide_exact(max_abs, 127.0)  # IEEE division, as torch does (see divide_exact)
        is_zero = max_abs == 0
        # A tiny adjoint (max|g| < 127 * smallest normal) has a subnormal
        # scale, which XLA flushes to 0 (then 0/0 gives NaN). Quantize it
        # scaled up by an exact power of two and scale the result back; for
        # every other adjoint the factor is 1 and the result bit-identical.
        boost = jnp.where(max_abs < 127.0 * jnp.finfo(jnp.float32).tiny, jnp.float32(2.0 ** 64), jnp.float32(1.0))
        t_b = t * boost
        scale_b = divide_exact(max_abs * boost, 127.0)
        # A zero tensor would divide 0/0; it is returned as is, so divide by 1.
        safe = jnp.where(is_zero, jnp.ones_like(scale_b), scale_b)
        q = jnp.clip(jnp.round(divide_exact(t_b, safe)), -127.0, 127.0)
        out = ((q * safe) * (1.0 / boost)).astype(adjoint.dtype)
        return jnp.where(is_zero, adjoint, out), Int8State(scale)

    return AdjointTransformation(init, update, name)
