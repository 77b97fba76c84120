"""fp8 arithmetic: scales, quantization and the fp8 GEMM with an fp8 backward.

Everything a seam multiplies goes through `fp8_linear`:

* forward: ``x`` (e4m3, one scale per tensor or per row) times ``w`` (e4m3,
  one scale per output channel, or one per tensor: ``weight_scaling``),
  both contracting on their last axis, with
  `jax.lax.dot_general` run directly on the ``float8_e4m3fn`` operands and a
  bf16/f16/f32 ``preferred_element_type``. The two scales are multiplied into
  the result afterwards. Both scale kinds factor out of the contraction
  (``sum_k x[m,k] w[n,k] = sx[m] sw[n] sum_k xq[m,k] wq[n,k]``), so they cost
  one elementwise multiply that XLA fuses into the consumer, not a second
  GEMM. When both are per-tensor and the output is bf16, the multiply is
  written as a bf16 GEMM output times a bf16-exact scalar (`output_scale`),
  the form XLA's GEMM rewriter folds into cuBLASLt's fp8 GEMM as its scale,
  so it costs nothing even where no consumer could absorb it.
* backward: the output gradient is quantized to ``float8_e5m2`` with a
  per-tensor scale computed from its current amax ("current scaling"; or,
  given a scale from an earlier step, with that: "delayed scaling") and
  multiplied with e4m3 operands: ``dx = g @ w`` against the weight
  requantized per *input* channel (that scale factors out of dgrad's
  contraction over the outputs) and ``dw = g^T @ x`` against the saved fp8
  activations, again as fp8 GEMMs with float32-promoted accumulation. A
  row scale that does not factor out of a backward contraction (per-row
  activations in wgrad, a frozen weight's output-channel scale in dgrad) is
  folded into the gradient before it is quantized (e5m2 has 30 binades of
  range, so that is free).

Weight scaling (``weight_scaling``): ``'channel'`` (one scale per output
channel; dgrad requantizes the weight per input channel from its
high-precision copy), ``'tensor'`` (one scale for the whole weight: one
amax reduction and one quantizing pass per call, a scalar output scale
instead of a per-column vector, and dgrad reads the forward's fp8 weight
transposed instead of requantizing) or ``'delayed'`` (per tensor too, with
the scale given by the caller, from the amax observed in an earlier step:
the quantizing pass no longer waits for a reduction over the weight, and
the amax it observes leaves as the cotangent of the scale handle, like the
gradient scales'). Per-tensor weight scales are what Flax's and
TransformerEngine's fp8 recipes use (delayed, from an amax history);
per-channel ones resolve weights whose rows differ in magnitude better.

Why operands are never dequantized before the dot: XLA folds
``quantize -> dequantize to bf16 -> dot`` back into a bf16 GEMM (the rounding
is kept, the speed is not). Only a dot whose operands *are* fp8 becomes
cuBLASLt's fp8 GEMM (``__cublas$lt$matmul$f8`` in the compiled HLO).

Weights are ``(out, in)`` = ``(N, K)``, torch's layout, which is the
contracting-last layout the fp8 GEMM wants; stored as ``(K, N)`` XLA would
transpose the weight on every call.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FP8_FORMATS = (E4M3, E5M2)
_FP8_NAMES = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "e4m3": E4M3, "e5m2": E5M2}

#: Output dtypes the fp8 GEMM can write (cuBLASLt's fp8 kernels accept these).
# float16 is not among them: an fp8 GEMM accumulates unscaled codes (e4m3
# products reach 448**2 per term), which overflow float16's 65504 range.
GEMM_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

#: How a live weight is scaled for the fp8 GEMM (see the module docstring).
WEIGHT_SCALINGS = ("channel", "tensor", "delayed")
#: The weight scalings with one scale per weight (a float32 scalar).
PER_TENSOR_WEIGHT_SCALINGS = ("tensor", "delayed")


def fp8_max(dtype: Any) -> float:
    """Largest finite magnitude of an fp8 format (448 for e4m3fn, 57344 for e5m2).

    Raises:
      ValueError: ``dtype`` is not one of the two fp8 formats.
    """
    return float(jnp.finfo(fp8_dtype(dtype)).max)


def fp8_dtype(dtype: Any) -> np.dtype:
    """The fp8 format named by ``dtype``: a dtype, or a name (``'float8_e4m3fn'``,
    or the library's ``'fp8_e4m3'`` / ``'fp8_e5m2'``).

    Raises:
      ValueError: anything but the two fp8 formats.
    """
    if isinstance(dtype, str) and dtype.strip().lower() in _FP8_NAMES:
        return _FP8_NAMES[dtype.strip().lower()]
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in FP8_FORMATS:
        raise ValueError(f"{dtype!r} is not an fp8 format; expected float8_e4m3fn (fp8_e4m3) or "
                         "float8_e5m2 (fp8_e5m2)")
    return resolved


def scale_from_amax(amax: jax.Array, dtype: Any = E4M3, margin: float = 0.0) -> jax.Array:
    """Per-tensor (or per-row/channel) scale ``amax * 2**margin / fp8_max``.

    ``x / scale`` then spans the fp8 range with ``margin`` binades of
    headroom. A zero or non-finite amax gives scale 1 (nothing to quantize,
    or nothing trustworthy to derive a scale from); the scale is clamped to
    the normal float32 range (a tiny amax would otherwise give a scale that
    flushes to 0).

    Args:
      amax: float array of absolute maxima (any shape).
      dtype: the fp8 format the scaled values are cast to.
      margin: headroom in powers of two (0: amax maps exactly to fp8_max).

    Returns:
      float32 array of ``amax``'s shape.
    """
    amax = jnp.asarray(amax, jnp.float32)
    # One float32 constant factor (a division by a constant may be rewritten into a multiply, differently rounded).
    scale = amax * np.float32(2.0 ** margin / fp8_max(dtype))
    good = jnp.isfinite(amax) & (amax > 0)
    # An amax below about 5e-36 gives a subnormal scale that flushes to 0 (1/scale = inf turns
    # zeros into NaN): clamp to the smallest normal float32, whose inverse is still finite.
    scale = jnp.clip(scale, jnp.finfo(jnp.float32).tiny, jnp.finfo(jnp.float32).max)
    return jnp.where(good, scale, jnp.ones_like(scale))


def quantize(x: jax.Array, scale: jax.Array, dtype: Any = E4M3) -> jax.Array:
    """``clip(x / scale, -max, max)`` cast to an fp8 format (round to nearest even).

    The division runs in float32 whatever ``x``'s dtype. Values beyond the
    fp8 range saturate to +-max (a plain cast would turn them into NaN for
    e4m3fn); NaN stays NaN.

    Args:
      x: float array.
      scale: float32, broadcastable to ``x`` (scalar, ``(rows, 1)`` or ``(N,)``).
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``.

    Returns:
      ``x``-shaped array of ``dtype``.
    """
    dtype = fp8_dtype(dtype)
    fmax = fp8_max(dtype)
    scaled = x.astype(jnp.float32) * (1.0 / jnp.asarray(scale, jnp.float32))
    return jnp.clip(scaled, -fmax, fmax).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``q * scale`` in ``dtype`` (for references and tests; seams never do this
    before a dot)."""
    return (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(dtype)


def row_amax(x: jax.Array) -> jax.Array:
    """Absolute maximum over the last axis, float32, keeping it: ``(..., 1)``."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)


def fp8_matmul(a: jax.Array, b: jax.Array, out_dtype: Any, precise: bool = False) -> jax.Array:
    """``a @ b.T`` on fp8 operands: ``a`` ``(M, K)``, ``b`` ``(N, K)`` -> ``(M, N)``.

    One `jax.lax.dot_general` contracting the last axis of both operands,
    with the accumulator written in ``out_dtype``. This exact form is what
    XLA rewrites into cuBLASLt's fp8 GEMM on Hopper/Ada (e4m3 x e4m3 and
    e5m2 x e4m3 are both accepted); on CPU XLA emulates it in float32.

    ``precise`` asks for ``Precision.HIGHEST``. At default precision XLA
    turns on cuBLASLt's fp8 *fast accumulation*, whose Hopper tensor-core
    accumulator is not periodically promoted to float32; HIGHEST keeps the
    fp8 kernel with float32 promotion (TransformerEngine's "split
    accumulator", its default for gradient GEMMs, whose contractions run over
    every token). On CPU both accumulate in float32.

    Raises:
      ValueError: operands not fp8, not 2-D, or contracting widths differ.
    """
    if a.dtype not in FP8_FORMATS or b.dtype not in FP8_FORMATS:
        raise ValueError(f"fp8_matmul needs fp8 operands, got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_matmul expects (M, K) and (N, K), got {a.shape} and {b.shape}")
    precision = jax.lax.Precision.HIGHEST if precise else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.dtype(out_dtype))


def gemm_out_dtype(dtype: Any) -> jnp.dtype:
    """The GEMM output dtype for an activation dtype (bf16/f32 kept, else f32:
    float16 would overflow on the unscaled fp8 products)."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in GEMM_OUT_DTYPES else jnp.dtype(jnp.float32)


class Fp8Weight(NamedTuple):
    """A weight quantized once ("frozen"), for inference.

    Attributes:
      q: ``(N, K)`` float8_e4m3fn.
      scale: ``(N,)`` float32 per-output-channel scale: ``w ~= q * scale[:, None]``.
    """

    q: jax.Array
    scale: jax.Array


def quantize_weight(w: jax.Array, dtype: Any = E4M3, margin: float = 0.0) -> Fp8Weight:
    """Per-output-channel quantization of a ``(N, K)`` weight.

    Raises:
      ValueError: ``w`` is not 2-D.
    """
    if w.ndim != 2:
        raise ValueError(f"a linear weight must be (out, in), got shape {w.shape}")
    scale = scale_from_amax(row_amax(w)[:, 0], dtype, margin)
    return Fp8Weight(quantize(w, scale[:, None], dtype), scale)


def _e5m2_grad(g32: jax.Array, fold: jax.Array, bound: jax.Array):
    """Quantize ``g * fold`` to e5m2 with the per-tensor scale ``bound / e5m2_max``.

    ``bound`` is an upper bound of ``|g * fold|`` (``amax(g) * max(fold)``), so
    one amax reduction over ``g`` serves both backward GEMMs.
    """
    scale = scale_from_amax(bound, E5M2)
    return quantize(g32 * fold, scale, E5M2), scale


def _round_up_to_bf16(v: jax.Array) -> jax.Array:
    """The smallest bfloat16-representable float32 ``>= v`` for a positive
    finite ``v`` (bf16 is float32 with the low 16 mantissa bits zero); other
    values unchanged."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    up = jax.lax.bitcast_convert_type((bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(v) & (v > 0) & jnp.isfinite(up), up, v)


def output_scale(x_scale: jax.Array, w_scale: jax.Array, out_dtype: Any):
    """The scale a per-tensor fp8 GEMM's bf16 output is multiplied by, and the
    activation scale to quantize with so that it is exact.

    For scalar ``x_scale`` and ``w_scale`` and a bfloat16 output, the product
    is rounded up to a bfloat16 value ``c`` and the activations are quantized
    with ``c / w_scale`` (at most 2**-8 above ``x_scale``: a hair more
    headroom, never more saturation). The output multiply is then
    ``acc * c`` in bfloat16 with no rounding of ``c``, the form XLA's GEMM
    rewriter folds into cuBLASLt's fp8 GEMM as its scale, so the scaling
    costs no pass over the output (a float32 multiply does not fold). Any
    other case returns ``(x_scale * w_scale, x_scale)`` unchanged (per-row or
    per-channel scales do not factor into one GEMM scale).

    Returns:
      ``(c, x_scale_to_quantize_with)``, both float32.
    """
    xs = jnp.asarray(x_scale, jnp.float32)
    ws = jnp.asarray(w_scale, jnp.float32)
    if xs.ndim or ws.ndim or jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
        return xs * (ws if ws.ndim == 0 else ws[None, :]), xs
    c = _round_up_to_bf16(xs * ws)
    return c, jnp.where(c == xs * ws, xs, c / ws)


def _scale_output(acc: jax.Array, c: jax.Array, out_dtype: Any, exact: bool) -> jax.Array:
    """``acc * c`` in ``out_dtype`` for an fp8 GEMM output ``acc``. When
    ``exact`` says ``c`` came from `output_scale` (a bf16-exact scalar for a
    bf16 output) and ``acc`` already has ``out_dtype``, the multiply is done
    in that dtype, the form XLA folds into the GEMM; otherwise in float32."""
    if exact and c.ndim == 0 and acc.dtype == jnp.dtype(out_dtype):
        return acc * c.astype(acc.dtype)
    return (acc.astype(jnp.float32) * c).astype(out_dtype)


def _linear_fwd_math(x, xs, wq, ws, out_dtype, fast):
    """Forward of an fp8 linear: ``(y, xq, xs)`` with the activation scale
    actually used (see `output_scale`)."""
    c, xs = output_scale(xs, ws, out_dtype)
    xq = quantize(x, xs, E4M3)
    acc = fp8_matmul(xq, wq, gemm_out_dtype(out_dtype), precise=not fast)
    return _scale_output(acc, c, out_dtype, exact=True), xq, xs


def quantize_weight_tensor(ws: Tuple[jax.Array, ...]) -> Fp8Weight:
    """``concatenate(ws)`` (row blocks of one ``(N, K)`` weight) quantized to
    e4m3 with one per-tensor scale from its amax: ``scale`` is a float32
    scalar. The concatenation only feeds the amax reduction and the
    quantizing elementwise pass, so XLA can fuse it into both (whether it
    does is the backend's choice) instead of writing it out.

    Raises:
      ValueError: a block is not 2-D.
    """
    if any(w.ndim != 2 for w in ws):
        raise ValueError(f"a linear weight must be (out, in), got shapes {[w.shape for w in ws]}")
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=0)
    scale = scale_from_amax(jnp.max(jnp.abs(w.astype(jnp.float32))), E4M3)
    return Fp8Weight(quantize(w, scale, E4M3), scale)


def quantize_weight_blocks(ws: Tuple[jax.Array, ...]) -> Fp8Weight:
    """`quantize_weight` of ``concatenate(ws)`` (row blocks of one ``(N, K)``
    weight, e.g. gate and up), without materialising the high-precision
    concatenation: each row's scale only depends on that row, so the blocks
    are quantized apart and only their fp8 bytes are joined.

    Raises:
      ValueError: a block is not 2-D.
    """
    parts = [quantize_weight(w) for w in ws]
    if len(parts) == 1:
        return parts[0]
    return Fp8Weight(jnp.concatenate([q.q for q in parts], axis=0), jnp.concatenate([q.scale for q in parts]))


def quantize_weight_delayed(ws: Tuple[jax.Array, ...], scale: jax.Array) -> Fp8Weight:
    """``concatenate(ws)`` quantized to e4m3 with a given per-tensor
    ``scale`` (float32 scalar; magnitudes beyond ``scale * 448`` saturate):
    one elementwise pass, no reduction to wait for. The high-precision
    concatenation only feeds that pass: on the H200 XLA fuses the two into
    one kernel, where quantizing the blocks apart and joining their fp8
    bytes took two kernels and a copy (21 us against 31 + 15 us for the 1B-like
    gate|up weight, `profile_fp8_seam.py`).

    Raises:
      ValueError: a block is not 2-D, or ``scale`` is not a scalar.
    """
    if any(w.ndim != 2 for w in ws):
        raise ValueError(f"a linear weight must be (out, in), got shapes {[w.shape for w in ws]}")
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"a per-tensor weight scale must be a scalar, got shape {scale.shape}")
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=0)
    return Fp8Weight(quantize(w, scale, E4M3), scale)


def cast_weight(ws: Tuple[jax.Array, ...], scale: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """A live weight cast to fp8 once for every call of a step: ``(q, amax)``.

    ``q`` is `quantize_weight_delayed`'s e4m3 ``concatenate(ws)`` at the
    delayed per-tensor ``scale`` (float32 scalar) and ``amax`` the float32
    ``max |concatenate(ws)|`` it observed (the next scale's source), both
    from one pass over the weight. `fp8_linear` with ``weight_cast=(q,
    amax)`` computes exactly what ``weight_scaling='delayed'`` computes from
    ``ws`` and ``scale``, without quantizing ``ws`` again.

    Raises:
      ValueError: a block is not 2-D, or ``scale`` is not a scalar.
    """
    return quantize_weight_delayed(ws, scale).q, weight_amax(ws)


def weight_amax(ws: Tuple[jax.Array, ...]) -> jax.Array:
    """float32 ``max |concatenate(ws)|`` (a per-tensor weight scale's amax)."""
    return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(w.astype(jnp.float32))) for w in ws])


def _dgrad_weight(ws: Tuple[jax.Array, ...]) -> Fp8Weight:
    """``w.T`` ``(K, N)`` for ``w = concatenate(ws)``, quantized per row of the
    transpose (per input channel of ``w``): the dgrad contraction runs over
    ``N``, so this scale factors out of it and the gradient needs no folding.
    The column amax spans every block; each block is transposed and
    quantized on its own."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0) for w in ws])
    scale = scale_from_amax(amax, E4M3)
    qs = [quantize(w.T, scale[:, None], E4M3) for w in ws]
    return Fp8Weight(qs[0] if len(qs) == 1 else jnp.concatenate(qs, axis=1), scale)


def _linear_bwd_math(g, xq, xs, w, x_dtype, w_dtype, fast, g_scale=None, w_tensor=None):
    """dx (and dw when ``w_dtype`` is given) from the output gradient ``g``,
    and the observed ``amax(|g|)``.

    ``w`` is the live weight as a tuple of row blocks (dgrad operand
    requantized per input channel; dw returned per block, ``(N_i, K)`` each) or an
    `Fp8Weight` (frozen: its per-output-channel scale is folded into ``g``
    for dgrad, and no dw). ``g_scale``: None for current scaling (the e5m2
    scale derived from this ``g``'s amax, which the quantization must wait
    for), else the float32 e5m2 scale to use (delayed scaling: the amax
    reduction no longer gates the quantization, so both can run in one
    pass over ``g``; values beyond the scale's range saturate).
    ``w_tensor``: the forward's per-tensor-scaled `Fp8Weight` of the live
    weight; dgrad then reads its fp8 bytes transposed instead of
    requantizing ``w`` per input channel.
    """
    g32 = g.astype(jnp.float32)
    gmax = jnp.max(jnp.abs(g32))
    per_tensor_x = xs.ndim == 0
    if g_scale is not None:
        # A never-observed delayed scale is 0: 1/0 made the gradients NaN. At the smallest normal
        # scale they saturate instead (finite), and `fold_state` counts the step in grad_clipped.
        g_scale = jnp.maximum(jnp.asarray(g_scale, jnp.float32), jnp.finfo(jnp.float32).tiny)

    def folded(fold):
        # e5m2 quantization of g * fold: current scaling bounds |g * fold| by
        # gmax * max(fold); delayed scales the given scale the same way.
        if g_scale is None:
            return _e5m2_grad(g32, fold, gmax * jnp.max(fold))
        scale = g_scale * jnp.max(fold)
        return quantize(g32 * fold, scale, E5M2), scale

    if isinstance(w, Fp8Weight):
        # dx[m,k] = sum_n g[m,n] ws[n] wq[n,k]: ws sits on the contraction axis.
        gq_d, gs_d = folded(w.scale[None, :])
        dx = fp8_matmul(gq_d, w.q.T, gemm_out_dtype(x_dtype), precise=not fast)
        return (dx.astype(jnp.float32) * gs_d).astype(x_dtype), None, gmax
    # One e5m2 quantization of g serves both GEMMs when x has a per-tensor
    # scale (static/delayed scaling): dgrad uses a weight scaled per input
    # channel (factors out of the N-contraction), wgrad multiplies the scalar
    # x scale into the result.
    gs = scale_from_amax(gmax, E5M2) if g_scale is None else g_scale
    if per_tensor_x:
        # The wgrad output scale gs * xs made bf16-exact by nudging gs up (at
        # most 2**-8: a hair more headroom), as `output_scale` does for the
        # forward, where XLA folds that multiply into the fp8 GEMM instead of
        # a pass over its output (measured there; in the backward not yet).
        # The dgrad's gs * w_scale cannot be exact at the same time.
        c_w, gs = output_scale(gs, xs, gemm_out_dtype(w_dtype))
    gq = quantize(g32, gs, E5M2)
    if w_tensor is None:
        wt = _dgrad_weight(w)
        dx = fp8_matmul(gq, wt.q, gemm_out_dtype(x_dtype), precise=not fast)
        dx = (dx.astype(jnp.float32) * gs * wt.scale[None, :]).astype(x_dtype)
    else:
        # The scalar weight scale factors out of dgrad's contraction as it
        # does out of the forward's: the same fp8 bytes, transposed.
        dx = fp8_matmul(gq, w_tensor.q.T, gemm_out_dtype(x_dtype), precise=not fast)
        dx = (dx.astype(jnp.float32) * (gs * w_tensor.scale)).astype(x_dtype)
    if per_tensor_x:
        gq_w, gs_w = gq, c_w
    else:
        # dw[n,k] = sum_m g[m,n] xs[m] xq[m,k]: a per-row x scale sits on the
        # contraction axis and is folded into g (e5m2 has the range for it).
        gq_w, gs_w = folded(xs)
    # One wgrad GEMM per row block of w, each reading its columns of the
    # gradient: the gradients land in the blocks' own buffers. One GEMM over
    # every block wrote a (N, K) result that two slices then copied out (a
    # read and a write of every weight gradient: 2 x 55 us at the 7B-like
    # gate|up on the H200, `profile_fp8_seam.py`; at the 1B-like shape XLA's
    # second transpose of the shared x eats the 2 x 15 us gain).
    xq_t, dws, start = xq.T, [], 0
    for block in w:
        rows = block.shape[0]
        g_block = gq_w if len(w) == 1 else gq_w[:, start:start + rows]
        dw = fp8_matmul(g_block.T, xq_t, gemm_out_dtype(w_dtype), precise=not fast)
        # Only the per-tensor scale is bf16-exact; a per-row x's folded scale
        # is a scalar too, but not exact.
        dws.append(_scale_output(dw, gs_w, w_dtype, exact=per_tensor_x))
        start += rows
    return dx, tuple(dws), gmax


def _grad_scale_arg(gs, delayed):
    """The e5m2 scale the backward quantizes with (None: current scaling)."""
    return gs if delayed and gs.shape != (0,) else None


def _live_weight(ws, mode, wsc):
    if mode == "delayed":
        return quantize_weight_delayed(ws, wsc)
    return quantize_weight_tensor(ws) if mode == "tensor" else quantize_weight_blocks(ws)


# ``fast``: static flags (forward fast accumulation, backward fast
# accumulation, delayed gradient scaling, weight scaling mode). ``wsc``: the
# delayed weight scale handle (zero-size otherwise).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_live(x, ws, xs, gs, wsc, fast):
    wq = _live_weight(ws, fast[3], wsc)
    return _linear_fwd_math(x, xs, wq.q, wq.scale, x.dtype, fast[0])[0]


def _linear_live_fwd(x, ws, xs, gs, wsc, fast):
    wq = _live_weight(ws, fast[3], wsc)
    y, xq, xs_used = _linear_fwd_math(x, xs, wq.q, wq.scale, x.dtype, fast[0])
    # The weight amax this call observed (delayed weight scaling): only a
    # differentiated call computes it, from the same values the quantizing
    # pass reads, so XLA can fuse the reduction into that pass.
    wmax = weight_amax(ws) if fast[3] == "delayed" else None
    # Residuals: the fp8 activations (half the bytes of bf16 ones), their
    # scale, the weight blocks themselves (primal inputs, so no copy), the
    # delayed gradient scale, a zero-size carrier of the activation dtype,
    # with per-tensor weight scaling the fp8 weight dgrad reads, and the
    # weight handle with its observation.
    per_tensor = fast[3] in PER_TENSOR_WEIGHT_SCALINGS
    return y, (xq, xs_used, ws, gs, jnp.zeros((0,), x.dtype), wq if per_tensor else None, (wsc, wmax))


def _linear_live_bwd(fast, res, g):
    xq, xs, ws, gs, xd, wq, (wsc, wmax) = res
    dx, dw, gmax = _linear_bwd_math(g, xq, xs, ws, xd.dtype, ws[0].dtype, fast[1], _grad_scale_arg(gs, fast[2]),
                                    w_tensor=wq)
    w_obs = jnp.zeros_like(wsc) if wmax is None else _observed(wsc, wmax)
    return dx, dw, jnp.zeros_like(xs), _observed(gs, gmax), w_obs


_linear_live.defvjp(_linear_live_fwd, _linear_live_bwd)


# A live weight whose e4m3 bytes ``q`` (at the delayed scale ``wsc``) and
# amax ``wamax`` were made beforehand (`cast_weight`): the forward and the
# backward are `_linear_live`'s in delayed weight scaling, reading ``q``
# instead of quantizing ``ws``; ``ws`` only receives the gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _linear_cast(x, ws, q, wsc, wamax, xs, gs, fast):
    return _linear_fwd_math(x, xs, q, wsc, x.dtype, fast[0])[0]


def _linear_cast_fwd(x, ws, q, wsc, wamax, xs, gs, fast):
    y, xq, xs_used = _linear_fwd_math(x, xs, q, wsc, x.dtype, fast[0])
    return y, (xq, xs_used, ws, gs, jnp.zeros((0,), x.dtype), Fp8Weight(q, wsc), (wsc, wamax))


def _linear_cast_bwd(fast, res, g):
    dx, dws, dxs, dgs, w_obs = _linear_live_bwd(fast, res, g)
    q, wamax = res[5].q, res[6][1]
    # The cast bytes and their amax are data, not functions of a parameter.
    return dx, dws, jnp.zeros_like(q), w_obs, jnp.zeros_like(wamax), dxs, dgs


_linear_cast.defvjp(_linear_cast_fwd, _linear_cast_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_frozen(x, wq, ws, xs, gs, fast):
    return _linear_fwd_math(x, xs, wq, ws, x.dtype, fast[0])[0]


def _linear_frozen_fwd(x, wq, ws, xs, gs, fast):
    y, xq, xs_used = _linear_fwd_math(x, xs, wq, ws, x.dtype, fast[0])
    return y, (xq, xs_used, wq, ws, gs, jnp.zeros((0,), x.dtype))


def _linear_frozen_bwd(fast, res, g):
    xq, xs, wq, ws, gs, xd = res
    dx, _, gmax = _linear_bwd_math(g, xq, xs, Fp8Weight(wq, ws), xd.dtype, None, fast[1],
                                _grad_scale_arg(gs, fast[2]))
    # A frozen weight is a constant: zero cotangents for it and its scale.
    return dx, jnp.zeros_like(wq), jnp.zeros_like(ws), jnp.zeros_like(xs), _observed(gs, gmax)


def _observed(gs, gmax):
    """The "cotangent" of a scale handle: the amax this call observed (how
    `eae_jax.fp8` gets it out of a compiled step, like the ledger's counts);
    nothing when no handle was given, 0 for a non-finite amax."""
    if gs.shape == (0,):
        return jnp.zeros_like(gs)
    return jnp.where(jnp.isfinite(gmax), gmax, 0.0).astype(gs.dtype)


_linear_frozen.defvjp(_linear_frozen_fwd, _linear_frozen_bwd)


def fp8_linear(x: jax.Array, w: Union[jax.Array, Tuple[jax.Array, ...], Fp8Weight], x_scale: jax.Array,
               fast_accum: Tuple[bool, bool] = (True, False), grad_scale: Any = None,
               delayed_grad: bool = False, weight_scaling: str = "channel",
               weight_scale: Any = None, weight_cast: Any = None) -> jax.Array:
    """``x @ w.T`` through an fp8 GEMM, differentiable with an fp8 backward.

    The forward quantizes ``x / x_scale`` to e4m3 and (for a live weight)
    ``w`` to e4m3, per output channel or per tensor (``weight_scaling``),
    runs `fp8_matmul` and multiplies both scales into the result. The
    backward quantizes the output gradient to e5m2 with a current per-tensor
    scale and runs two more fp8 GEMMs (see the module docstring); the dgrad
    GEMM reads the weight requantized per input channel (per-channel
    scaling) or the forward's fp8 weight (per-tensor), so with a per-tensor
    ``x_scale`` one quantization of the gradient serves both GEMMs. ``x_scale`` gets a zero cotangent (scales are
    calibrated, not trained); a live weight gets the straight-through
    gradient ``g^T x``; an `Fp8Weight` gets zeros.

    ``grad_scale`` is the output gradient's e5m2 scale handle: its
    cotangent is the gradient amax the backward observed (not a derivative:
    the way the next step's scale gets out of a compiled step, like the
    ledger's counts, see `eae_jax.fp8.ledger`). With ``delayed_grad`` the
    backward also quantizes the gradient with that scale ("delayed
    scaling") instead of one derived from this gradient's own amax, so the
    quantization need not wait for a reduction over the whole gradient.

    Args:
      x: ``(M, K)`` activations (bf16/f16/f32); the output has this dtype.
      w: ``(N, K)`` weight in a float dtype (quantized on every call, the
        training path), a tuple of such weights standing for their
        concatenation along ``N`` (e.g. gate and up: the same result without
        materialising the concatenated weight; the gradient is a tuple too),
        or an `Fp8Weight` (quantized once, inference).
      x_scale: float32 scalar (per-tensor) or ``(M, 1)`` (per-row) scale.
      fast_accum: ``(forward, backward)``: whether those GEMMs may use
        cuBLASLt's fp8 fast accumulation (see `fp8_matmul`). Default: fast
        forward (K is a model width), float32-promoted backward (the wgrad
        contraction runs over every token).
      grad_scale: None, or a float32 scalar: the e5m2 scale of the output
        gradient (used with ``delayed_grad``; its cotangent is the observed
        amax either way).
      delayed_grad: quantize the output gradient with ``grad_scale``
        (magnitudes beyond ``grad_scale * 57344`` saturate) instead of a
        scale from its own amax.
      weight_scaling: ``'channel'``, ``'tensor'`` or ``'delayed'``: a live
        weight's e4m3 scales (module docstring). An `Fp8Weight` keeps the
        scales it was quantized with.
      weight_scale: with ``weight_scaling='delayed'`` (and only then): the
        float32 scalar e4m3 scale of the whole (concatenated) weight, e.g.
        ``amax / 448`` from an earlier step; magnitudes beyond
        ``weight_scale * 448`` saturate. Its cotangent is the weight amax
        this call observed (not a derivative, like ``grad_scale``'s).
      weight_cast: with ``weight_scaling='delayed'`` (and only then, and a
        live weight): ``(q, amax)`` from `cast_weight` of ``w`` at
        ``weight_scale``, made once for every call of a step. The forward
        multiplies ``q`` instead of quantizing ``w`` (which then only
        receives the gradient) and ``amax`` leaves as ``weight_scale``'s
        cotangent; the results are those of ``weight_cast=None`` bit for
        bit as long as ``q`` was cast from this ``w``.

    Returns:
      ``(M, N)`` in ``x.dtype``.

    Raises:
      ValueError: non-float (or fp8) activations or live weights, zero
        rows, shapes that do not fit (or weight blocks that differ in
        input width or dtype), an ``x_scale`` / ``grad_scale`` /
        ``weight_scale`` of another shape, an unknown ``weight_scaling``,
        ``'delayed'`` without a ``weight_scale`` or a ``weight_scale``
        without ``'delayed'``, a ``weight_cast`` without ``'delayed'`` or of
        another shape or dtype than ``w``'s e4m3 bytes.
    """
    if x.ndim != 2:
        raise ValueError(f"fp8_linear expects 2-D activations (M, K), got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype in FP8_FORMATS:
        raise ValueError(f"fp8_linear expects float32/bfloat16/float16 activations, got {x.dtype}")
    if x.shape[0] == 0:
        # No rows: nothing to scale (an amax over zero elements has no value) and nothing to compute.
        raise ValueError("fp8_linear: activations have no rows (shape (0, K)); skip the call for an empty batch")
    # Fp8Weight is a NamedTuple: test it before taking tuples as blocks.
    blocks = None if isinstance(w, Fp8Weight) else (tuple(w) if isinstance(w, (tuple, list)) else (w,))
    if blocks is not None and any(not jnp.issubdtype(b.dtype, jnp.floating) or b.dtype in FP8_FORMATS
                                  for b in blocks):
        raise ValueError(f"fp8_linear: a live weight must be float32/bfloat16/float16 (it is quantized here), got "
                         f"{[str(b.dtype) for b in blocks]}; pass an Fp8Weight for weights already in fp8")
    for wshape in [w.q.shape] if blocks is None else [b.shape for b in blocks]:
        if len(wshape) != 2 or wshape[1] != x.shape[1]:
            raise ValueError(f"fp8_linear: activations {x.shape} do not fit weight {tuple(wshape)} (out, in)")
    if blocks is not None and (not blocks or len({b.dtype for b in blocks}) != 1):
        raise ValueError(f"fp8_linear: weight blocks must be one or more arrays of one dtype, "
                         f"got {[str(b.dtype) for b in blocks]}")
    x_scale = jnp.asarray(x_scale, jnp.float32)
    if x_scale.shape not in ((), (x.shape[0], 1)):
        raise ValueError(f"x_scale must be a scalar or ({x.shape[0]}, 1), got shape {x_scale.shape}")
    if weight_scaling not in WEIGHT_SCALINGS:
        raise ValueError(f"unknown weight_scaling {weight_scaling!r}; expected one of {WEIGHT_SCALINGS}")
    # Static flags of the custom VJPs: forward / backward fast accumulation,
    # delayed gradient scaling, weight scaling mode.
    fast = (bool(fast_accum[0]), bool(fast_accum[1]), bool(delayed_grad), weight_scaling)
    if grad_scale is None:
        if delayed_grad:
            raise ValueError("delayed_grad needs a grad_scale")
        gs = jnp.zeros((0,), jnp.float32)
    else:
        gs = jnp.asarray(grad_scale, jnp.float32)
        if gs.shape != ():
            raise ValueError(f"grad_scale must be a float32 scalar, got shape {gs.shape}")
    if blocks is None:
        if weight_scale is not None or weight_cast is not None:
            raise ValueError("a weight_scale or weight_cast was given with a frozen Fp8Weight, which keeps its own "
                             "scales (and fp8 bytes)")
        return _linear_frozen(x, w.q, w.scale, x_scale, gs, fast)
    if (weight_scaling == "delayed") != (weight_scale is not None):
        raise ValueError("weight_scaling='delayed' needs a weight_scale, and a weight_scale is only used with "
                         f"weight_scaling='delayed' (got weight_scaling={weight_scaling!r}, "
                         f"weight_scale={'None' if weight_scale is None else 'given'})")
    if weight_scale is None:
        wsc = jnp.zeros((0,), jnp.float32)
    else:
        wsc = jnp.asarray(weight_scale, jnp.float32)
        if wsc.shape != ():
            raise ValueError(f"weight_scale must be a float32 scalar, got shape {wsc.shape}")
    if weight_cast is None:
        return _linear_live(x, blocks, x_scale, gs, wsc, fast)
    if weight_scaling != "delayed":
        raise ValueError(f"a weight_cast needs weight_scaling='delayed' (its bytes carry the delayed scale), "
                         f"got {weight_scaling!r}")
    q, wamax = weight_cast
    rows = sum(b.shape[0] for b in blocks)
    if q.shape != (rows, x.shape[1]) or q.dtype != E4M3:
        raise ValueError(f"weight_cast bytes must be {E4M3} of shape {(rows, x.shape[1])} (the weight's), got "
                         f"{q.dtype} {q.shape}")
    wamax = jnp.asarray(wamax, jnp.float32)
    if wamax.shape != ():
        raise ValueError(f"weight_cast amax must be a float32 scalar, got shape {wamax.shape}")
    return _linear_cast(x, blocks, q, wsc, wamax, x_scale, gs, fast)


def reference_linear(x: jax.Array, w: jax.Array, x_scale: jax.Array, weight_scaling: str = "channel",
                     weight_scale: Any = None) -> np.ndarray:
    """Reference of `fp8_linear`'s forward for tests: the same quantization of
    both operands, then products and sums in float64 numpy. Returns float64."""
    if weight_scaling == "delayed":
        ws = ws_col = jnp.asarray(weight_scale, jnp.float32)
    elif weight_scaling == "tensor":
        ws = scale_from_amax(jnp.max(jnp.abs(w.astype(jnp.float32))), E4M3)
        ws_col = ws
    else:
        ws = scale_from_amax(row_amax(w)[:, 0], E4M3)
        ws_col = ws[:, None]
    # The activation scale the GEMM quantizes with (see `output_scale`).
    xs = output_scale(x_scale, ws, x.dtype)[1]
    xq = np.asarray(quantize(x, xs, E4M3).astype(jnp.float32), np.float64)
    wq = np.asarray(quantize(w, ws_col, E4M3).astype(jnp.float32), np.float64)
    xs = np.asarray(xs, np.float64)
    w_out = np.asarray(ws, np.float64) if np.ndim(ws) == 0 else np.asarray(ws, np.float64)[None, :]
    return (xq @ wq.T) * xs * w_out
