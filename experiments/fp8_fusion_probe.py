"""Where the fp8 FFN forward's non-GEMM time can go: two probes on the GPU.

    python experiments/fp8_fusion_probe.py [--shapes 1b,7b] [--iters 20] [--out DIR]

1. **Down-projection output scale.** The seam writes the fp8 GEMM as
   ``dot(x8, w8) * (sx * sw)``; cuBLASLt takes no such scale from XLA, so the
   multiply is its own pass when nothing downstream absorbs it. Variants of
   the down GEMM over an in-graph quantized hidden, each with the count of
   fp8 GEMMs in its compiled HLO, device time, and its error against the
   float32 product of the same fp8 values (0 when the GEMM really ran in
   fp8; a folded quantization shows as a bf16-sized error instead):

   * ``direct``: fp8 operands, bf16 accumulator output, scale after (the seam).
   * ``dq-bf16`` / ``dq-f32``: dequantize both operands (convert, times
     scale) in bf16 / f32 and dot them: the pattern XLA's GEMM rewriter
     matches to pass the scales to cuBLASLt.
   * ``dq-bf16-barrier`` / ``dq-f32-barrier``: the same with an
     `optimization_barrier` between quantizing and dequantizing the hidden.

2. **SwiGLU and the hidden's quantization.** XLA's fusion of
   ``quantize(silu(g) * u)`` over the gate|up GEMM output against a Pallas
   (Triton) kernel of the same arithmetic, at several tile shapes, with
   the fraction of fp8 codes that differ from XLA's.

Prints one table per probe and writes ``fp8_fusion_probe.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from eae_jax.blocks import init_swiglu, swiglu  # noqa: E402
from eae_jax.fp8 import CastWeight, LiveWeight, fp8_linear  # noqa: E402
from eae_jax.fp8.quant import E4M3, fp8_matmul, output_scale, quantize, scale_from_amax, weight_amax  # noqa: E402
from profile_fp8_seam import profile  # noqa: E402

SHAPES = {"tiny": (256, 128, 512), "1b": (8192, 2048, 5632), "7b": (8192, 4096, 11008)}


def down_variants():
    # Each takes (h, w8, sh, sw, w): the fp8 weight, its scale and the
    # high-precision weight it came from (only the library's form names it).
    def direct(h, w8, sh, sw, w):
        h8 = quantize(h, sh)
        return (fp8_matmul(h8, w8, jnp.bfloat16).astype(jnp.float32) * (sh * sw)).astype(jnp.bfloat16)

    def direct_bf16mul(h, w8, sh, sw, w):
        # The library's form (`eae_jax.fp8.quant.output_scale`): the weight
        # cast beforehand, as a train step's CastWeight.
        return fp8_linear(h, CastWeight((w,), w8, sw, sw * 448.0), sh)

    def dq(dtype, barrier):
        def f(h, w8, sh, sw, w):
            h8 = quantize(h, sh)
            if barrier:
                h8, sh_ = jax.lax.optimization_barrier((h8, sh))
            else:
                sh_ = sh
            a = h8.astype(dtype) * sh_.astype(dtype)
            b = w8.astype(dtype) * sw.astype(dtype)
            y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=dtype)
            return y.astype(jnp.bfloat16)
        return f

    return {"direct": direct, "direct-bf16mul": direct_bf16mul, "dq-bf16": dq(jnp.bfloat16, False), "dq-f32": dq(jnp.float32, False),
            "dq-bf16-barrier": dq(jnp.bfloat16, True), "dq-f32-barrier": dq(jnp.float32, True)}


def legacy_linear(x, blocks, ws, xs):
    """The seam's forward before `output_scale`: a float32 multiply after the GEMM."""
    wq = quantize(blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks), ws)
    acc = fp8_matmul(quantize(x, xs, E4M3), wq, x.dtype)
    return (acc.astype(jnp.float32) * (xs * ws)).astype(x.dtype)


def library_linear(x, blocks, ws, xs):
    """The library's forward: `fp8_linear` of a delayed per-tensor weight."""
    return fp8_linear(x, LiveWeight(blocks, ws), xs)


def ffn_forward(linear):
    """The bare fp8 FFN forward (delayed per-tensor weight scales, static
    activation scales) through ``linear(x, blocks, weight_scale, x_scale)``."""
    def f(p, x, xs, hs, wsc):
        a = linear(x, (p["w_gate"], p["w_up"]), wsc[0], xs)
        f_ = a.shape[1] // 2
        g, u = a[:, :f_], a[:, f_:]
        h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
        return linear(h, (p["w_down"],), wsc[1], hs)
    return f


def swiglu_xla(a, s_a, s_h):
    f = a.shape[1] // 2
    a = (a.astype(jnp.float32) * s_a).astype(jnp.bfloat16)
    g, u = a[:, :f], a[:, f:]
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)
    return quantize(h, s_h)


def swiglu_xla_via(mid):
    """The same, converting to e4m3 through ``mid`` (f16 / bf16): a probe of
    what XLA's f32 -> e4m3 conversion costs."""
    def f(a, s_a, s_h):
        f_ = a.shape[1] // 2
        a = (a.astype(jnp.float32) * s_a).astype(jnp.bfloat16)
        g, u = a[:, :f_], a[:, f_:]
        h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)
        return jnp.clip(h.astype(jnp.float32) / s_h, -448.0, 448.0).astype(mid).astype(E4M3)
    return f


def swiglu_library(a, s_a, s_h):
    """The library's form: the GEMM output scale is folded into the GEMM (see
    `eae_jax.fp8.quant.output_scale`), so ``a`` is used as is."""
    del s_a
    f = a.shape[1] // 2
    g, u = a[:, :f], a[:, f:]
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)
    return quantize(h, s_h)


def swiglu_math(kind):
    """`swiglu_library` with other arithmetic, to tell a memory-bound fusion
    from an instruction-bound one: ``floor`` (``g + u``, the same bytes with
    almost no math), ``tanh`` (sigmoid as ``0.5 + 0.5 tanh(g / 2)``, no
    division), ``bf16`` (silu and product in bfloat16)."""
    def f(a, s_a, s_h):
        del s_a
        f_ = a.shape[1] // 2
        g, u = a[:, :f_], a[:, f_:]
        if kind == "floor":
            h = g.astype(jnp.float32) + u.astype(jnp.float32)
        elif kind == "tanh":
            g32 = g.astype(jnp.float32)
            h = g32 * (0.5 + 0.5 * jnp.tanh(0.5 * g32)) * u.astype(jnp.float32)
        else:
            h = jax.nn.silu(g) * u
        return quantize(h.astype(jnp.bfloat16), s_h)
    return f


def swiglu_pallas(bt, bf, warps):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    def kernel(s_ref, g_ref, u_ref, o_ref):
        s_a = s_ref[0]
        inv_h = s_ref[1]
        g = (g_ref[...].astype(jnp.float32) * s_a).astype(jnp.bfloat16).astype(jnp.float32)
        u = (u_ref[...].astype(jnp.float32) * s_a).astype(jnp.bfloat16).astype(jnp.float32)
        h = (g * jax.nn.sigmoid(g) * u).astype(jnp.bfloat16).astype(jnp.float32)
        o_ref[...] = jnp.clip(h * inv_h, -448.0, 448.0).astype(E4M3)

    def f(a, s_a, s_h):
        t, f2 = a.shape
        f_ = f2 // 2
        nb = f_ // bf
        scales = jnp.stack([s_a, 1.0 / s_h]).astype(jnp.float32)
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((t, f_), E4M3),
            grid=(t // bt, nb),
            in_specs=[pl.BlockSpec((2,), lambda i, j: (0,)),
                      pl.BlockSpec((bt, bf), lambda i, j: (i, j)),
                      pl.BlockSpec((bt, bf), lambda i, j: (i, j + nb))],
            out_specs=pl.BlockSpec((bt, bf), lambda i, j: (i, j)),
            compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1),
            interpret=jax.default_backend() == "cpu",
        )(scales, a, a)
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,7b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiles", default="32x512x4,64x256x4,64x512x8,128x256x8,16x1024x4,128x128x4")
    ap.add_argument("--sections", default="down,ffn,swiglu", help="comma list of down, ffn, swiglu")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")))
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    os.makedirs(args.out, exist_ok=True)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    results = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "down": [], "swiglu": []}
    key = jax.random.PRNGKey(0)
    for name in args.shapes.split(","):
        t, d, f = SHAPES[name]
        k1, k2, k3 = jax.random.split(key, 3)
        h = jax.random.normal(k1, (t, f), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(k2, (d, f), jnp.float32) * 0.02
        sw = jnp.max(jnp.abs(w)) / 448.0
        w8 = quantize(w, sw)
        sh = jnp.max(jnp.abs(h.astype(jnp.float32))) / 448.0
        exact = jax.jit(lambda h, w8, sh, sw: jax.lax.dot_general(
            quantize(h, sh).astype(jnp.float32), w8.astype(jnp.float32), (((1,), (1,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST) * (sh * sw))(h, w8, sh, sw)
        sh_lib = output_scale(sh, sw, jnp.bfloat16)[1]
        exact_lib = jax.jit(lambda h, w8, sh, sw: jax.lax.dot_general(
            quantize(h, sh).astype(jnp.float32), w8.astype(jnp.float32), (((1,), (1,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST) * (sh * sw))(h, w8, sh_lib, sw)
        norm = float(jnp.max(jnp.abs(exact)))
        print(f"\n== down GEMM {t}x{f} @ {d}x{f} ==")
        print(f"{'variant':<18} {'fp8 GEMMs':>9} {'busy us':>8} {'wall ms':>8} {'max err/max':>12}  top kernels")
        for vname, fn in (down_variants().items() if "down" in sections else []):
            try:
                rec = profile(f"down-{name}-{vname}", fn, (h, w8, sh, sw, w), args.iters, args.out)
                y = jax.jit(fn)(h, w8, sh, sw, w)
                # direct-bf16mul quantizes with the adjusted scale of `output_scale`.
                ex = exact_lib if vname == "direct-bf16mul" else exact
                err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ex))) / norm
                top = "; ".join(f"{n[:40]} {us:.1f}" for n, us, _ in rec["kernels"][:4])
                print(f"{vname:<18} {rec['fp8_gemms']:>9} {rec['busy_us']:>8.1f} {rec['median_ms']:>8.3f} "
                      f"{err:>12.2e}  {top}")
                results["down"].append({"shape": name, "variant": vname, "fp8_gemms": rec["fp8_gemms"],
                                        "busy_us": rec["busy_us"], "wall_ms": rec["median_ms"], "rel_err": err,
                                        "kernels": rec["kernels"][:6]})
            except Exception as e:  # a variant that does not compile is a result too
                print(f"{vname:<18} FAILED {type(e).__name__}: {str(e)[:300]}")
                results["down"].append({"shape": name, "variant": vname, "error": repr(e)[:2000]})
        pb = jax.tree_util.tree_map(lambda v: v.astype(jnp.bfloat16), init_swiglu(k1, d, f))
        x = jax.random.normal(k2, (t, d), jnp.float32).astype(jnp.bfloat16)
        xs = scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))))
        hb = jax.nn.silu(x @ pb["w_gate"].T) * (x @ pb["w_up"].T)
        hs = scale_from_amax(jnp.max(jnp.abs(hb.astype(jnp.float32))))
        wsc = jnp.stack([scale_from_amax(weight_amax((pb["w_gate"], pb["w_up"]))),
                         scale_from_amax(weight_amax((pb["w_down"],)))])
        ref = swiglu(pb, x).astype(jnp.float32)
        print(f"\n== FFN forward {t}x{d}x{f} (delayed per-tensor weight scales, static activation scales) ==")
        print(f"{'variant':<10} {'fp8 GEMMs':>9} {'busy us':>8} {'wall ms':>8} {'cos vs bf16':>11}  top kernels")
        ffns = [("bf16", lambda p, x_, *_: swiglu(p, x_)), ("legacy", ffn_forward(legacy_linear)),
                ("library", ffn_forward(library_linear))]
        for vname, fn in (ffns if "ffn" in sections else []):
            rec = profile(f"ffn-{name}-{vname}", fn, (pb, x, xs, hs, wsc), args.iters, args.out)
            y = jax.jit(fn)(pb, x, xs, hs, wsc).astype(jnp.float32)
            cos = float(jnp.sum(y * ref) / jnp.sqrt(jnp.sum(y * y) * jnp.sum(ref * ref)))
            top = "; ".join(f"{n[:36]} {us:.1f}" for n, us, _ in rec["kernels"][:8])
            print(f"{vname:<10} {rec['fp8_gemms']:>9} {rec['busy_us']:>8.1f} {rec['median_ms']:>8.3f} {cos:>11.5f}  {top}")
            results.setdefault("ffn", []).append({"shape": name, "variant": vname, "busy_us": rec["busy_us"],
                                                  "wall_ms": rec["median_ms"], "cos": cos,
                                                  "fp8_gemms": rec["fp8_gemms"], "kernels": rec["kernels"][:10]})
        a = (jax.random.normal(k3, (t, 2 * f), jnp.float32) * 3.0).astype(jnp.bfloat16)
        s_a = jnp.float32(0.5)
        s_h = jnp.float32(20.0 / 448.0)
        ref = jax.jit(swiglu_xla)(a, s_a, s_h)
        ref_lib = jax.jit(swiglu_library)(a, s_a, s_h)
        print(f"\n== SwiGLU + e4m3 quantization of a {t}x{2 * f} bf16 GEMM output ==")
        print(f"{'variant':<22} {'busy us':>8} {'wall ms':>8} {'GB/s':>7} {'codes differing':>16}")
        nbytes = t * 2 * f * 2 + t * f
        cases = [("xla", swiglu_xla), ("xla-via-f16", swiglu_xla_via(jnp.float16)),
                 ("xla-via-bf16", swiglu_xla_via(jnp.bfloat16)), ("library", swiglu_library),
                 ("floor", swiglu_math("floor")), ("tanh", swiglu_math("tanh")), ("bf16-math", swiglu_math("bf16"))]
        for tile in [t_ for t_ in args.tiles.split(",") if t_]:
            bt, bf, warps = (int(v) for v in tile.split("x"))
            if f % bf == 0 and t % bt == 0:
                cases.append((f"pallas-{bt}x{bf}-w{warps}", swiglu_pallas(bt, bf, warps)))
        for vname, fn in (cases if "swiglu" in sections else []):
            try:
                rec = profile(f"swiglu-{name}-{vname}", fn, (a, s_a, s_h), args.iters, args.out)
                q = jax.jit(fn)(a, s_a, s_h)
                # The library-form variants against the library's codes, the others against "xla".
                base = ref_lib if vname in ("library", "floor", "tanh", "bf16-math") else ref
                diff = float(jnp.mean((q.view(jnp.uint8) != base.view(jnp.uint8)).astype(jnp.float32)))
                print(f"{vname:<22} {rec['busy_us']:>8.1f} {rec['median_ms']:>8.3f} "
                      f"{nbytes / rec['busy_us'] / 1e3:>7.0f} {diff:>16.2e}")
                results["swiglu"].append({"shape": name, "variant": vname, "busy_us": rec["busy_us"],
                                          "wall_ms": rec["median_ms"], "codes_differing": diff})
            except Exception as e:
                print(f"{vname:<22} FAILED {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)
                results["swiglu"].append({"shape": name, "variant": vname, "error": repr(e)[:2000]})
    with open(os.path.join(args.out, "fp8_fusion_probe.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
