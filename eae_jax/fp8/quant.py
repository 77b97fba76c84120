"""fp8 arithmetic: scales, quantization, and `fp8_linear`, the one fp8 GEMM.

One scale convention (this package and the ``fp8_quant`` pass): a scale is
the dequantization factor ``amax * 2**margin / fp8_max``; quantizing is
``x * (1 / scale)`` clipped and cast, dequantizing ``q * scale``.
`fp8_linear` multiplies fp8 arrays directly (e4m3 forward, e5m2 gradients):
XLA folds ``quantize -> dequantize -> dot`` back into a bf16 GEMM. Scales
factor out of the contraction and multiply the result; a row scale that does
not factor out of a backward contraction is folded into the gradient. The
type of the weight says where it comes from: `LiveWeight`, `CastWeight` or
`FrozenWeight`. Weights are ``(out, in)``, the contracting-last layout the
fp8 GEMM wants. docs/fp8.md has the design and its measurements.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import observe as obs_lib
from eae_jax.dtypes import FP8_DTYPES, FP8_FORMATS, fp8_dtype

E4M3 = FP8_FORMATS["e4m3"]
E5M2 = FP8_FORMATS["e5m2"]

#: Output dtypes of the fp8 GEMM (not float16: unscaled e4m3 products reach 448**2 each).
GEMM_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def fp8_max(fmt: Any = "e4m3") -> float:
    """Largest finite magnitude of an fp8 format (448 for e4m3, 57344 for e5m2).

    >>> fp8_max("e4m3"), fp8_max(jnp.float8_e5m2)
    (448.0, 57344.0)
    """
    return float(jnp.finfo(fp8_dtype(fmt)).max)


def scale_from_amax(amax: Any, fmt: Any = "e4m3", margin: float = 0.0) -> jax.Array:
    """float32 scale ``amax * 2**margin / fp8_max`` (any shape): ``x / scale``
    spans the range with ``margin`` binades of headroom. A zero or non-finite
    amax gives 1; scales stay normal float32 numbers (finite inverses).

    >>> float(scale_from_amax(jnp.float32(3.5)))  # 3.5 / 448
    0.0078125
    """
    amax = jnp.asarray(amax, jnp.float32)
    # One float32 constant factor (a division by a constant may be rewritten into a multiply, differently rounded).
    factor = np.float32(2.0 ** margin / fp8_max(fmt))
    scale = jnp.clip(amax * factor, jnp.finfo(jnp.float32).tiny, jnp.finfo(jnp.float32).max)
    return jnp.where(jnp.isfinite(amax) & (amax > 0), scale, jnp.ones_like(scale))


def quantize(x: jax.Array, scale: Any, fmt: Any = "e4m3") -> jax.Array:
    """``clip(x * (1 / scale), -max, max)`` cast to fp8 in float32: values
    beyond the range saturate (a plain cast gives NaN in e4m3fn).

    >>> quantize(jnp.array([1.0, 1000.0]), 0.5).astype(jnp.float32)
    Array([  2., 448.], dtype=float32)
    """
    dtype, fmax = fp8_dtype(fmt), fp8_max(fmt)
    scaled = x.astype(jnp.float32) * (1.0 / jnp.asarray(scale, jnp.float32))
    return jnp.clip(scaled, -fmax, fmax).astype(dtype)


def dequantize(q: jax.Array, scale: Any, dtype: Any = jnp.float32) -> jax.Array:
    """``q * scale`` in ``dtype`` (a seam never dequantizes before a dot).

    >>> dequantize(quantize(jnp.array([3.0]), 0.5), 0.5)
    Array([3.], dtype=float32)
    """
    return (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(dtype)


def row_amax(x: jax.Array) -> jax.Array:
    """float32 ``max |x|`` over the last axis, kept: ``(..., 1)``.

    >>> row_amax(jnp.array([[1.0, -3.0]]))
    Array([[3.]], dtype=float32)
    """
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)


def fp8_matmul(a: jax.Array, b: jax.Array, out_dtype: Any, precise: bool = False) -> jax.Array:
    """``a @ b.T`` on fp8 ``(M, K)`` and ``(N, K)``: the `jax.lax.dot_general` XLA
    rewrites into cuBLASLt's fp8 GEMM. ``precise``: ``Precision.HIGHEST``,
    float32-promoted accumulation instead of Hopper's fast fp8 accumulation.

    >>> fp8_matmul(quantize(jnp.ones((1, 4)), 1.0), quantize(jnp.ones((1, 4)), 1.0), jnp.float32)
    Array([[4.]], dtype=float32)
    """
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_matmul needs fp8 operands, got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_matmul expects (M, K) and (N, K), got {a.shape} and {b.shape}")
    precision = jax.lax.Precision.HIGHEST if precise else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=out_dtype)


def _gemm_out(dtype: Any) -> jnp.dtype:
    return jnp.dtype(dtype) if jnp.dtype(dtype) in GEMM_OUT_DTYPES else jnp.dtype(jnp.float32)


def _round_up_to_bf16(v: jax.Array) -> jax.Array:
    """The smallest bf16 value ``>= v`` (positive finite ``v``; others unchanged)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    up = jax.lax.bitcast_convert_type((bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(v) & (v > 0) & jnp.isfinite(up), up, v)


def output_scale(x_scale: Any, w_scale: Any, out_dtype: Any) -> Tuple[jax.Array, jax.Array]:
    """``(c, x_scale_used)``: the factor an fp8 GEMM's output is multiplied by and
    the activation scale to quantize with. For scalar scales and a bf16
    output ``c`` is ``x_scale * w_scale`` rounded up to a bf16 value (at most
    2**-8 more headroom), the form XLA folds into cuBLASLt's GEMM; otherwise
    ``(x_scale * w_scale, x_scale)``.

    >>> c, xs = output_scale(jnp.float32(0.3), jnp.float32(0.7), jnp.bfloat16)
    >>> bool(c == c.astype(jnp.bfloat16).astype(jnp.float32)), bool(xs >= 0.3)
    (True, True)
    """
    xs, ws = jnp.asarray(x_scale, jnp.float32), jnp.asarray(w_scale, jnp.float32)
    if xs.ndim or ws.ndim or jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
        return xs * (ws if ws.ndim == 0 else ws[None, :]), xs
    c = _round_up_to_bf16(xs * ws)
    return c, jnp.where(c == xs * ws, xs, c / ws)


def _scale_output(acc: jax.Array, c: jax.Array, out_dtype: Any, exact: bool) -> jax.Array:
    """``acc * c`` in ``out_dtype``; in that dtype directly when ``c`` is an
    exact scalar of it (the form XLA folds into the GEMM), else in float32."""
    if exact and c.ndim == 0 and acc.dtype == jnp.dtype(out_dtype):
        return acc * c.astype(acc.dtype)
    return (acc.astype(jnp.float32) * c).astype(out_dtype)


# ---------------------------------------------------------------------- weight sources
class LiveWeight(NamedTuple):
    """A weight quantized in every call: ``blocks``, the ``(N_i, K)`` row blocks of
    one weight (gate and up; q, k, v); ``scale`` None (per output channel, from
    the weight) or a float32 per-tensor scale (delayed: beyond ``448 * scale``
    values saturate).

    >>> LiveWeight((jnp.ones((3, 4)),)).scale is None
    True
    """

    blocks: Tuple[jax.Array, ...]
    scale: Optional[jax.Array] = None


class CastWeight(NamedTuple):
    """A live weight cast once for every call of a step (`cast_weight`): ``q``,
    the ``(N, K)`` e4m3 bytes of ``blocks`` at the scalar ``scale``, is read;
    ``blocks`` receive the gradient; ``amax`` is their observed amax. Results
    equal `LiveWeight` ``(blocks, scale)`` bit for bit.

    >>> cast_weight((jnp.ones((2, 4)),), jnp.float32(0.01)).q.dtype == E4M3
    True
    """

    blocks: Tuple[jax.Array, ...]
    q: jax.Array
    scale: jax.Array
    amax: jax.Array


class FrozenWeight(NamedTuple):
    """A weight quantized once per output channel (inference), no gradient:
    ``w ~= q * scale[:, None]``, ``q`` ``(N, K)`` e4m3, ``scale`` ``(N,)``.

    >>> quantize_weight(jnp.ones((3, 4))).scale.shape
    (3,)
    """

    q: jax.Array
    scale: jax.Array


def _blocks(w: Any) -> Tuple[jax.Array, ...]:
    return tuple(w) if isinstance(w, (tuple, list)) else (w,)


def _check_2d(blocks) -> None:  # ValueError unless every block is (out, in)
    if any(b.ndim != 2 for b in blocks):
        raise ValueError(f"a linear weight must be (out, in), got shapes {[b.shape for b in blocks]}")


def _join(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def quantize_weight(w: Any, margin: float = 0.0) -> FrozenWeight:
    """Per-output-channel e4m3 quantization of a weight or of its row blocks
    (quantized apart: only fp8 bytes are joined).

    >>> float(dequantize(*quantize_weight(jnp.full((1, 2), 3.5)))[0, 0])
    3.5
    """
    blocks = _blocks(w)
    _check_2d(blocks)
    scales = [scale_from_amax(row_amax(b)[:, 0], E4M3, margin) for b in blocks]
    return FrozenWeight(_join([quantize(b, s[:, None]) for b, s in zip(blocks, scales)]), _join(scales))


def weight_amax(w: Any) -> jax.Array:
    """float32 ``max |w|`` over a weight or all its row blocks.

    >>> float(weight_amax((jnp.ones((2, 2)), -3 * jnp.ones((1, 2)))))
    3.0
    """
    return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(b.astype(jnp.float32))) for b in _blocks(w)])


def cast_weight(w: Any, scale: Any) -> CastWeight:
    """A weight (or its row blocks) cast to e4m3 once at a per-tensor ``scale``,
    with the amax observed on the way (one pass; the join fuses into it).

    >>> cw = cast_weight(jnp.full((2, 4), 0.5), jnp.float32(0.5 / 448))
    >>> float(cw.amax), float(cw.q.astype(jnp.float32).max())
    (0.5, 448.0)
    """
    blocks = _blocks(w)
    _check_2d(blocks)
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"a per-tensor weight scale must be a scalar, got shape {scale.shape}")
    return CastWeight(blocks, quantize(_join(blocks), scale), scale, weight_amax(blocks))


def _weight_bytes(w):
    """``(e4m3 (N, K), scale (N,) or scalar, observed amax or None)`` of a weight source."""
    if isinstance(w, (FrozenWeight, CastWeight)):
        return w.q, w.scale, getattr(w, "amax", None)
    if w.scale is None:
        f = quantize_weight(w.blocks)
        return f.q, f.scale, None
    return quantize(_join(w.blocks), w.scale), w.scale, weight_amax(w.blocks)


def _dgrad_weight(blocks):
    """``(w.T quantized per row (K, N), its (K,) scale)``: a per-input-channel
    scale factors out of dgrad's contraction over N; blocks transposed apart."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(b.astype(jnp.float32)), axis=0) for b in blocks])
    scale = scale_from_amax(amax)
    parts = [quantize(b.T, scale[:, None]) for b in blocks]
    return (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)), scale


# ---------------------------------------------------------------------- the custom VJP
def _forward(fast, x, wq, ws, xs):
    c, xs = output_scale(xs, ws, x.dtype)
    xq = quantize(x, xs)
    return _scale_output(fp8_matmul(xq, wq, _gemm_out(x.dtype), precise=not fast), c, x.dtype, exact=True), xq, xs


def _backward(fast, g, xq, xs, w, wq, x_dtype, g_scale):
    """``(dx, per-block dw or None, amax(|g|))`` from the output gradient ``g``.
    ``g_scale``: None (current scaling: from this ``g``'s amax, a reduction
    the quantization waits for) or the delayed e5m2 scale."""
    g32 = g.astype(jnp.float32)
    gmax = jnp.max(jnp.abs(g32))
    if g_scale is not None:  # a never-observed (0) delayed scale saturates, finite, instead of 1/0
        g_scale = jnp.maximum(jnp.asarray(g_scale, jnp.float32), jnp.finfo(jnp.float32).tiny)

    def folded(fold):  # e5m2 of g * fold, bounded by gmax * max(fold)
        s = scale_from_amax(gmax * jnp.max(fold), E5M2) if g_scale is None else g_scale * jnp.max(fold)
        return quantize(g32 * fold, s, E5M2), s

    if isinstance(w, FrozenWeight):  # dx[m,k] = sum_n g[m,n] ws[n] wq[n,k]: ws folded into g
        gq, gs = folded(w.scale[None, :])
        dx = fp8_matmul(gq, w.q.T, _gemm_out(x_dtype), precise=not fast)
        return (dx.astype(jnp.float32) * gs).astype(x_dtype), None, gmax
    per_tensor_x, w_dtype = xs.ndim == 0, w.blocks[0].dtype
    gs = scale_from_amax(gmax, E5M2) if g_scale is None else g_scale
    if per_tensor_x:  # make the wgrad output scale gs * xs bf16-exact, as the forward's
        c_w, gs = output_scale(gs, xs, _gemm_out(w_dtype))
    gq = quantize(g32, gs, E5M2)
    if wq is None:
        wt, wt_scale = _dgrad_weight(w.blocks)
        dx = fp8_matmul(gq, wt, _gemm_out(x_dtype), precise=not fast).astype(jnp.float32) * gs * wt_scale[None, :]
    else:  # a per-tensor weight: the forward's bytes, transposed
        dx = fp8_matmul(gq, wq.T, _gemm_out(x_dtype), precise=not fast).astype(jnp.float32) * (gs * w.scale)
    gq_w, gs_w = (gq, c_w) if per_tensor_x else folded(xs)  # a per-row x scale is folded into g
    # One wgrad GEMM per row block, so each gradient lands in its own buffer
    # (one GEMM and slices copied them; docs/fp8.md).
    dws, start, xq_t = [], 0, xq.T
    for b in w.blocks:
        g_b = gq_w if len(w.blocks) == 1 else gq_w[:, start:start + b.shape[0]]
        dw = fp8_matmul(g_b.T, xq_t, _gemm_out(w_dtype), precise=not fast)
        dws.append(_scale_output(dw, gs_w, w_dtype, exact=per_tensor_x))
        start += b.shape[0]
    return dx.astype(x_dtype), tuple(dws), gmax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(fast, x, w, xs, gs, obs):
    wq, ws, _ = _weight_bytes(w)
    return _forward(fast[0], x, wq, ws, xs)[0]


def _linear_fwd(fast, x, w, xs, gs, obs):
    wq, ws, wmax = _weight_bytes(w)
    y, xq, xs_used = _forward(fast[0], x, wq, ws, xs)
    # Residuals: fp8 activations, the weight source (primal inputs, no copy)
    # and, for a per-tensor live weight, the fp8 bytes dgrad reads.
    keep = wq if ws.ndim == 0 and isinstance(w, LiveWeight) else None
    return y, (xq, xs_used, w, keep, gs, wmax, obs, jnp.zeros((0,), x.dtype))


def _linear_bwd(fast, res, g):
    xq, xs, w, wq, gs, wmax, obs, xd = res
    if wq is None and isinstance(w, CastWeight):
        wq = w.q
    dx, dws, gmax = _backward(fast[1], g, xq, xs, w, wq, xd.dtype, gs)
    zeros = functools.partial(jax.tree_util.tree_map, jnp.zeros_like)
    w_ct = zeros(w) if dws is None else w._replace(blocks=dws, **{k: jnp.zeros_like(getattr(w, k)) for k in
                                                                  w._fields[1:] if getattr(w, k) is not None})
    seen = None if obs is None else obs_lib.emit(obs, {"grad": gmax, "weight": jnp.float32(0) if wmax is None
                                                       else wmax})
    return dx, w_ct, jnp.zeros_like(xs), None if gs is None else jnp.zeros_like(gs), seen


_linear.defvjp(_linear_fwd, _linear_bwd)


def linear_observer() -> obs_lib.Handle:
    """The `eae_jax.observe` handle (reduce ``'max'``) an `fp8_linear` call
    reports to: ``grad``, the output gradient's amax, and ``weight``, a
    per-tensor-scaled weight's (0 otherwise).

    >>> sorted(obs_lib.value(linear_observer()))
    ['grad', 'weight']
    """
    return obs_lib.handle({"grad": jnp.zeros((), jnp.float32), "weight": jnp.zeros((), jnp.float32)}, "max")


_OBSERVER_TREE = jax.tree_util.tree_structure({"grad": 0, "weight": 0})


def _floating(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating) and a.dtype not in FP8_DTYPES


def fp8_linear(x: jax.Array, w: Any, x_scale: Any, *, grad_scale: Any = None,
               observer: Optional[obs_lib.Handle] = None, fast_accum: Tuple[bool, bool] = (True, False)) -> jax.Array:
    """``x @ w.T`` (``x`` ``(M, K)`` float32/bf16/f16, the output's dtype) through fp8
    GEMMs, with an fp8 backward. ``w``: an ``(N, K)`` array or tuple of row blocks
    (per-channel `LiveWeight`), a `LiveWeight`, `CastWeight` or `FrozenWeight`.
    ``x_scale``: scalar or ``(M, 1)`` (zero cotangent). ``grad_scale``: None
    (current: from the gradient's amax) or a scalar (delayed; beyond ``57344 *
    scale`` saturates). ``observer``: a `linear_observer`. ``fast_accum``:
    ``(forward, backward)`` may use fast fp8 accumulation.

    >>> fp8_linear(jnp.ones((2, 8)), jnp.full((3, 8), 3.5), 2.0 ** -8)
    Array([[28., 28., 28.],
           [28., 28., 28.]], dtype=float32)

    Raises ValueError naming what does not fit (dtypes, shapes, scales, observer).
    """
    if x.ndim != 2:
        raise ValueError(f"fp8_linear expects 2-D activations (M, K), got shape {x.shape}")
    if not _floating(x):
        raise ValueError(f"fp8_linear expects float32/bfloat16/float16 activations, got {x.dtype}")
    if x.shape[0] == 0:
        raise ValueError("fp8_linear: activations have no rows (shape (0, K)); skip the call for an empty batch")
    if not isinstance(w, (LiveWeight, CastWeight, FrozenWeight)):
        w = LiveWeight(_blocks(w))
    shapes = [w.q.shape] if isinstance(w, FrozenWeight) else [b.shape for b in w.blocks]
    if not isinstance(w, FrozenWeight) and (not w.blocks or len({b.dtype for b in w.blocks}) != 1
                                            or not all(_floating(b) for b in w.blocks)):
        raise ValueError(f"fp8_linear: a live weight must be one or more float32/bfloat16/float16 arrays of one "
                         f"dtype (it is quantized here), got {[str(b.dtype) for b in w.blocks]}")
    if any(len(shape) != 2 or shape[1] != x.shape[1] for shape in shapes):
        raise ValueError(f"fp8_linear: activations {x.shape} do not fit weight {shapes} (out, in)")
    if isinstance(w, CastWeight):
        rows = sum(s[0] for s in shapes)
        if w.q.shape != (rows, x.shape[1]) or w.q.dtype != E4M3 or jnp.shape(w.amax) != () or jnp.shape(w.scale):
            raise ValueError(f"fp8_linear: cast bytes must be {E4M3} of shape {(rows, x.shape[1])} with scalar "
                             f"scale and amax, got {w.q.dtype} {w.q.shape}, {jnp.shape(w.scale)}, {jnp.shape(w.amax)}")
    elif isinstance(w, LiveWeight) and w.scale is not None:
        w = w._replace(scale=jnp.asarray(w.scale, jnp.float32))
        if w.scale.shape != ():
            raise ValueError(f"a per-tensor weight scale must be a float32 scalar, got shape {w.scale.shape}")
    x_scale = jnp.asarray(x_scale, jnp.float32)
    if x_scale.shape not in ((), (x.shape[0], 1)):
        raise ValueError(f"x_scale must be a scalar or ({x.shape[0]}, 1), got shape {x_scale.shape}")
    if grad_scale is not None:
        grad_scale = jnp.asarray(grad_scale, jnp.float32)
        if grad_scale.shape != ():
            raise ValueError(f"grad_scale must be a float32 scalar, got shape {grad_scale.shape}")
    if observer is not None and (not isinstance(observer, obs_lib.Handle) or observer.treedef != _OBSERVER_TREE
                                 or observer.reduce != "max" or jnp.shape(observer.calls) != ()):
        raise ValueError("fp8_linear: observer must be one linear_observer() handle")
    return _linear((bool(fast_accum[0]), bool(fast_accum[1])), x, w, x_scale, grad_scale, observer)
