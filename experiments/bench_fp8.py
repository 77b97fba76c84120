"""fp8 seams on a real GPU: FFN seam vs bf16 vs Flax, reconstruct train steps,
and a 300-step language-model training run, fp8 against bf16.

Sections (none given = all; each one can run in its own call):

    python experiments/bench_fp8.py --ffn     # FFN seam at (8192, 2048, 5632) and (8192, 4096, 11008)
    python experiments/bench_fp8.py --e2e     # reconstruct train step: medium and 7B-like configs
    python experiments/bench_fp8.py --train   # 300-step LM training, final losses compared
    python experiments/bench_fp8.py --smoke   # tiny sizes, runs on CPU in well under a minute

Timing: every function is jitted, compiled once (compile time reported), run
``--warmup`` times, then ``--iters`` times with ``jax.block_until_ready`` after
each call; the median is reported ("ms", latency: includes the host's launch
of the call). "pipe ms" is throughput: ``--iters`` calls dispatched back to
back and synchronised once, median of 3 rounds (what a training loop sees).
"graph" (FFN section) is throughput of ``--graph-copies`` calls inside one
jitted function, each on its own input and its own parameters (nothing
computed once for all copies), per call: the seam as one layer
of a larger program, with no host dispatch per call.
The eae FFN rows time the forward as `fp8.apply` runs it (the ledger's
statistics are computed only where a backward or the caller asks for them,
as Flax computes its amax only for its backward); "fwd+ledger" times
`fp8.apply_with_ledger`, which returns the call's counts and amax too.
Train steps feed their outputs back (real steps, params donated).

What "fp8" means here: `eae_jax.fp8` seams (e4m3 forward GEMMs on
``float8_e4m3fn`` operands, e5m2 gradients with current per-tensor scaling
in the backward), static calibrated activation scales unless a row says
otherwise, guards on (one ``lax.cond`` per seam call) unless "unguarded",
e4m3 weight scales per output channel unless "delayed-w" (per tensor, from
the amax observed in an earlier step; the forward-only "fwd" timing then has no
weight reduction at all, the forward+backward one observes the amax) or
"cast-w" (delayed, the weights cast to fp8 before the call). The
e2e step runs every ``--guards`` variant (one ``lax.cond`` per block call,
a step decision, none) against one bf16 step, compiled one by one and
timed in the same process (a medium step compiles in about 100 s on the
H200: give each config its own device call).
Cosines are against the bf16 seam (the issue's reference): "bare" on the
seam output, "boundary" on ``residual + output`` with a N(0, 1) residual
stream (the seam input is its RMSNorm). The fp8 GEMM count is the number of
``__cublas$lt$matmul$f8`` custom calls in the compiled HLO (a scan body
counts once).

Output: a table per section and a summary against the issue's targets, and
JSON in ``$OUT`` (default ``experiments/results``): ``bench_fp8.json`` for a
full run, ``bench_fp8_<sections>.json`` for a partial one (``_smoke`` added
with ``--smoke``), rewritten after every section.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

# Run from a checkout without installing: the repository root holds eae_jax.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eae_jax  # noqa: E402
from eae_jax import fp8  # noqa: E402
from eae_jax.blocks import BlockConfig, decoder_block, init_stack, init_swiglu, rms_norm, swiglu

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------- helpers
def hlo_counts(compiled) -> Dict[str, int]:
    """GEMM kinds in a compiled executable's HLO text."""
    try:
        text = compiled.as_text()
    except Exception:  # some backends do not expose it
        return {}
    return {
        "cublas_fp8": text.count('"__cublas$lt$matmul$f8"'),
        "cublas_all": len(re.findall(r'"__cublas\$[^"]*"', text)),
        "triton_gemm": text.count("__triton_gemm"),
        # Conditionals, loops and copies in the program text (a scan body
        # counts once, not per layer).
        "conditionals": text.count(" conditional("),
        "whiles": text.count(" while("),
        "copies": len(re.findall(r"\bcopy\(", text)),
        # Reductions (amax, counts): what a forward computes beyond its GEMMs.
        "reduces": len(re.findall(r"\breduce\(", text)),
    }


def lowered_fp8_dots(lowered) -> int:
    """dot_generals with an fp8 operand in the lowered StableHLO (any backend)."""
    n = 0
    for line in lowered.as_text().splitlines():
        if "stablehlo.dot_general" in line and "xf8E" in line.split(":")[-1]:
            n += 1
    return n


def compile_fn(fn: Callable, args: tuple, donate: tuple = (),
               options: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Lower and compile ``fn`` for ``args`` (``options``: XLA compiler options)."""
    t = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    return {"compiled": compiled, "lowered": lowered, "compile_s": time.perf_counter() - t}


def compile_all(jobs: Dict[str, tuple]) -> Dict[str, Dict[str, Any]]:
    """`compile_fn` for ``{name: (fn, args, donate)}``, one after another.

    Not concurrently: XLA autotunes GEMMs and fusions on the GPU while it
    compiles, and concurrent compilations time their candidates against each
    other's kernels (on the H200 four concurrent medium train steps did not
    finish compiling in 240 s; one alone takes about 100 s).
    """
    out = {}
    for name, job in jobs.items():
        out[name] = compile_fn(*job)
        log(f"  compiled {name} in {out[name]['compile_s']:.0f} s")
    return out


def timed(fn: Callable, args: tuple, warmup: int, iters: int, feed: Optional[Callable] = None,
          donate: tuple = (), built: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Compile ``fn`` for ``args`` (or take ``built`` from `compile_fn`), run
    it, return timings and HLO counts.

    ``feed(args, out) -> args`` makes the next call's arguments from the last
    output (training loops); without it every call gets the same arguments.
    """
    built = built or compile_fn(fn, args, donate)
    compiled, lowered, compile_s = built["compiled"], built["lowered"], built["compile_s"]
    out = None
    for _ in range(warmup):
        out = compiled(*args)
        jax.block_until_ready(out)
        if feed:
            args = feed(args, out)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) * 1e3)
        if feed:
            args = feed(args, out)
    # Throughput: the same calls dispatched back to back, one sync per round
    # (how a training loop runs: the host enqueues step i+1 while the device
    # runs step i), so the per-call launch latency is hidden.
    rounds = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
            if feed:
                args = feed(args, out)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t) * 1e3 / iters)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "pipelined_ms": statistics.median(rounds),
            "calls": warmup + iters + len(rounds) * iters,
            "compile_s": compile_s, "hlo": hlo_counts(compiled), "lowered_fp8_dots": lowered_fp8_dots(lowered),
            "out": out, "args": args}


def repeated(fn: Callable, args: tuple, vary: int, copies: int):
    """``(run, run_args)``: ``run(*run_args)`` is ``copies`` calls of ``fn``
    (see `in_graph`), returning their outputs as a list."""
    if copies < 1 or not 0 <= vary < len(args):
        raise ValueError(f"need copies >= 1 and 0 <= vary < {len(args)}, got copies={copies}, vary={vary}")
    xs = tuple(jnp.roll(args[vary], i, axis=0) for i in range(copies))
    rests = (args[:vary] + args[vary + 1:],) * copies

    def run(rests_, xs_):
        return [fn(*r[:vary], x, *r[vary:]) for r, x in zip(rests_, xs_)]

    return run, (rests, xs)


def in_graph(fn: Callable, args: tuple, vary: int, copies: int, warmup: int, iters: int) -> Dict[str, Any]:
    """Time ``copies`` calls of ``fn`` inside one jitted function: how the
    call runs as part of a larger program (a layer of a train step), with no
    host dispatch between calls.

    Call ``i`` gets ``args[vary]`` rolled by ``i`` rows (same values, so the
    same scales and saturation) and its own parameters for the other
    arguments (the same buffers passed once per call): XLA cannot compute
    anything once for all copies, as it would for one set of weights (their
    quantization would be shared; an ``optimization_barrier`` does not stop
    that, CSE runs after barriers are expanded). Returns `timed`'s record
    with ``per_call_ms`` (median latency / copies) and
    ``per_call_pipelined_ms`` (throughput / copies).
    """
    rec = timed(*repeated(fn, args, vary, copies), warmup, iters)
    rec["copies"] = copies
    rec["per_call_ms"] = rec["median_ms"] / copies
    rec["per_call_pipelined_ms"] = rec["pipelined_ms"] / copies
    return rec


def fp8_calls(state, cot) -> float:
    """The fp8 calls a seam state's cotangent (or forward observations) counted."""
    return float(fp8.state.observations(state, cot)["counts"]["fp8_calls"])


def cos(a, b) -> float:
    return float(fp8.cosine(jnp.asarray(a), jnp.asarray(b)))


def tree_min_cos(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return min(cos(x, y) for x, y in zip(la, lb))


def strip(rec: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in rec.items() if k not in ("out", "args")}


def env_info() -> Dict[str, Any]:
    dev = jax.devices()[0]
    info = {"jax": jax.__version__, "backend": jax.default_backend(), "device": str(dev),
            "device_kind": getattr(dev, "device_kind", None),
            "compute_capability": getattr(dev, "compute_capability", None),
            "python": platform.python_version(), "argv": sys.argv}
    try:
        import flax

        info["flax"] = flax.__version__
    except Exception as err:  # flax is optional for the benchmark
        info["flax"] = f"unavailable: {err}"
    return info


def print_table(title: str, rows: List[Dict[str, Any]], cols: List[tuple]) -> None:
    print(f"\n== {title} ==")
    widths = [max(len(h), 10) for h, _ in cols]
    print("  ".join(h.rjust(w) for (h, _), w in zip(cols, widths)))
    for r in rows:
        cells = []
        for (h, f), w in zip(cols, widths):
            try:
                v = f(r)
            except Exception:
                v = None
            if v is None:
                s = "-"
            elif isinstance(v, float):
                s = f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
            else:
                s = str(v)
            cells.append(s.rjust(w))
        print("  ".join(cells))
    sys.stdout.flush()


# ---------------------------------------------------------------------- FFN seam
def _flax_ops():
    """Flax's fp8 dot_general ops available in this flax (version-robust)."""
    try:
        import flax.linen as nn
    except Exception as err:
        return {}, f"flax import failed: {err}"
    ops = {}
    for name in ("Fp8DirectDotGeneralOp", "Fp8DotGeneralOp"):
        cls = getattr(nn, name, None)
        if cls is None:
            try:
                from flax.linen import fp8_ops

                cls = getattr(fp8_ops, name, None)
            except Exception:
                cls = None
        if cls is not None:
            ops[name] = cls
            break  # the direct op when there is one; the qdq op only on old flax
    einsum = getattr(nn, "Fp8Einsum", None)
    if einsum is not None:
        ops["Fp8Einsum"] = einsum
    return ops, None


def _flax_swiglu(op_name: str, cls):
    import flax.linen as nn

    dn = (((1,), (1,)), ((), ()))

    class FlaxFp8SwiGLU(nn.Module):
        @nn.compact
        def __call__(self, x, wg, wu, wd):
            if op_name == "Fp8Einsum":
                g = cls(name="gate")("mk,nk->mn", x, wg)
                u = cls(name="up")("mk,nk->mn", x, wu)
                return cls(name="down")("mk,nk->mn", nn.silu(g) * u, wd)
            g = cls(name="gate")(x, wg, dn)
            u = cls(name="up")(x, wu, dn)
            return cls(name="down")(nn.silu(g) * u, wd, dn)

    return FlaxFp8SwiGLU()


FFN_SHAPES = {"1b": (8192, 2048, 5632), "7b": (8192, 4096, 11008)}
#: The eae FFN variants (``--ffn-variants`` keys): activation scaling,
#: guarded, fast-accumulation backward, delayed gradient scales, weight scaling.
FFN_VARIANTS = {
    "static": ("static", True, False, False, "channel"), "static-u": ("static", False, False, False, "channel"),
    "static-d": ("static", True, False, True, "channel"), "static-u-d": ("static", False, False, True, "channel"),
    "delayedw-d": ("static", True, False, True, "delayed"), "delayedw-u-d": ("static", False, False, True, "delayed"),
    # delayed weight scales with the weights cast to fp8 before the timed
    # call (fp8.cast_weights: once per train step, for its forward and its
    # recomputation); the row also times the cast with the forward.
    "castw-d": ("static", True, False, True, "cast"), "castw-u-d": ("static", False, False, True, "cast"),
    "row": ("row", True, False, False, "channel"), "fast-bwd": ("static", True, True, False, "channel"),
}


def ffn_section(args) -> List[Dict[str, Any]]:
    shapes = [(256, 64, 128)] if args.smoke else [FFN_SHAPES[k] for k in args.ffn_shapes]
    rows = []
    for (m, d, f) in shapes:
        log(f"FFN seam tokens={m} dim={d} ffn={f}")
        keys = jax.random.split(jax.random.key(0), 8)
        p32 = init_swiglu(keys[0], d, f)
        pb = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p32)
        ones = {"scale": jnp.ones((d,), jnp.float32)}

        def sample(k):
            r = jax.random.normal(k, (m, d), jnp.float32)
            return r.astype(jnp.bfloat16), rms_norm(ones, r).astype(jnp.bfloat16)

        resid, h = sample(keys[1])
        cal = [sample(keys[2]), sample(keys[3])]
        ct = (jax.random.normal(keys[4], (m, d), jnp.float32)).astype(jnp.bfloat16)
        flops = 6.0 * m * d * f

        y_bf16 = jax.jit(swiglu)(pb, h)
        y_f32 = jax.jit(lambda p, x: swiglu(p, x))(p32, h.astype(jnp.float32))

        def fb_of(apply, argnums):
            # The cotangent is the last argument, never a closed-over constant:
            # XLA would embed (and try to constant-fold) a multi-MB literal.
            def fb(*a):
                *a, ct_ = a

                def loss(*b):
                    return jnp.sum(apply(*b).astype(jnp.float32) * ct_.astype(jnp.float32))
                return jax.value_and_grad(loss, argnums=argnums)(*a)
            return fb

        def graph(fn, a, vary):
            # `in_graph` timing (``--graph-copies`` 0: off), outputs dropped.
            if not args.graph_copies:
                return None
            return strip(in_graph(fn, a, vary, args.graph_copies, args.warmup, args.iters))

        bf_fwd = timed(swiglu, (pb, h), args.warmup, args.iters)
        bf_fb = timed(fb_of(swiglu, (0, 1)), (pb, h, ct), args.warmup, args.iters)
        bf_gfwd = graph(swiglu, (pb, h), 1)
        bf_gfb = graph(fb_of(swiglu, (0, 1)), (pb, h, ct), 1)
        g_bf = bf_fb["out"][1]
        base = {"shape": [m, d, f]}
        rows.append({**base, "variant": "bf16 (eae_jax swiglu)", "fwd": strip(bf_fwd), "fb": strip(bf_fb),
                     "graph_fwd": bf_gfwd, "graph_fb": bf_gfb, "cos_bare": 1.0, "cos_boundary": 1.0,
                     "cos_bare_vs_f32": cos(y_bf16, y_f32)})

        def record(name, fwd, fb, y, grads_dx=None, grads_w=None, extra=None, gfwd=None, gfb=None):
            r = {**base, "variant": name, "fwd": strip(fwd) if fwd else None, "fb": strip(fb) if fb else None,
                 "graph_fwd": gfwd, "graph_fb": gfb,
                 "cos_bare": cos(y, y_bf16),
                 "cos_boundary": cos(resid.astype(jnp.float32) + y.astype(jnp.float32),
                                     resid.astype(jnp.float32) + y_bf16.astype(jnp.float32)),
                 "cos_bare_vs_f32": cos(y, y_f32)}
            if fwd:
                r["fwd_speedup"] = bf_fwd["median_ms"] / fwd["median_ms"]
                r["fwd_speedup_pipelined"] = bf_fwd["pipelined_ms"] / fwd["pipelined_ms"]
                r["fwd_tflops"] = flops / fwd["median_ms"] / 1e9
            if fb:
                r["fb_speedup"] = bf_fb["median_ms"] / fb["median_ms"]
                r["fb_speedup_pipelined"] = bf_fb["pipelined_ms"] / fb["pipelined_ms"]
                r["fb_tflops"] = 3 * flops / fb["median_ms"] / 1e9
            for key, mine, bf in (("graph_fwd_speedup", gfwd, bf_gfwd), ("graph_fb_speedup", gfb, bf_gfb)):
                if mine and bf:
                    r[key] = bf["per_call_pipelined_ms"] / mine["per_call_pipelined_ms"]
            if grads_dx is not None:
                r["grad_cos_dx"] = cos(grads_dx, g_bf[1])
            if grads_w is not None:
                r["grad_cos_dw_min"] = min(cos(grads_w[k], g_bf[0][k]) for k in ("w_gate", "w_up", "w_down"))
            r.update(extra or {})
            rows.append(r)
            if getattr(args, "progress", None):
                args.progress("ffn", rows)  # a later timeout keeps what was measured

        log(f"  bf16: fwd {bf_fwd['median_ms']:.3f} ms, fwd+bwd {bf_fb['median_ms']:.3f} ms")
        rows[-1]["fwd_speedup"] = rows[-1]["fb_speedup"] = 1.0
        rows[-1]["fwd_speedup_pipelined"] = rows[-1]["fb_speedup_pipelined"] = 1.0
        if bf_gfwd:
            rows[-1]["graph_fwd_speedup"] = rows[-1]["graph_fb_speedup"] = 1.0
        rows[-1]["fwd_tflops"] = flops / bf_fwd["median_ms"] / 1e9
        rows[-1]["fb_tflops"] = 3 * flops / bf_fb["median_ms"] / 1e9

        # --- ours
        for key, (mode, guarded, fast_bwd, delayed, wscale) in FFN_VARIANTS.items():
            if args.ffn_variants and key not in args.ffn_variants:
                continue
            seam = fp8.ffn_seam(activation=mode, check_values=guarded, fast_accum_bwd=fast_bwd,
                                gradient="delayed" if delayed else "current",
                                weight="delayed" if wscale == "cast" else wscale)
            name = (f"eae fp8 {mode}" + ("" if guarded else " unguarded") + (" fast-accum bwd" if fast_bwd else "")
                    + (" delayed grads" if delayed else "")
                    + {"channel": "", "delayed": " delayed-w", "cast": " cast-w"}[wscale])
            try:
                bound = fp8.bind(seam, pb, [c[1] for c in cal], residuals=[c[0] for c in cal])
            except fp8.GateRefused as err:
                rows.append({**base, "variant": name, "error": f"GateRefused: {err}"})
                continue
            st = bound.state
            if delayed:
                # Gradient scales observed by one current-scaling backward, as
                # a training loop's first step would.
                current = seam.replace(gradient="current")
                observed = jax.jit(fb_of(lambda s, p, x: fp8.apply(current, s, p, x), (0, 1, 2)))(st, pb, h, ct)[1][0]
                st = fp8.fold_state(seam, st, observed)
                if not bool(jnp.all(st.grad_scales > 0)):
                    raise RuntimeError(f"{name}: the current-scaling backward observed no gradient scales")
            extra = {}
            if wscale == "cast":
                # The cast and the forward in one call, for comparison; the
                # rows below get the weights cast beforehand.
                def fwd_cast(s, p, x):
                    return fp8.apply_with_ledger(seam, fp8.cast_weights(seam, s, p), p, x)

                with_cast = timed(fwd_cast, (st, pb, h), args.warmup, args.iters)
                g_cast = graph(fwd_cast, (st, pb, h), 2)
                extra = {"fwd_with_cast": strip(with_cast), "graph_fwd_with_cast": g_cast,
                         "fwd_with_cast_speedup": bf_fwd["median_ms"] / with_cast["median_ms"],
                         "fwd_with_cast_speedup_pipelined": bf_fwd["pipelined_ms"] / with_cast["pipelined_ms"]}
                if g_cast and bf_gfwd:
                    extra["graph_fwd_with_cast_speedup"] = (bf_gfwd["per_call_pipelined_ms"]
                                                            / g_cast["per_call_pipelined_ms"])
                log(f"  {name}, cast inside the call: fwd {with_cast['median_ms']:.3f} ms "
                    f"({extra['fwd_with_cast_speedup']:.2f}x bf16, pipelined "
                    f"{extra['fwd_with_cast_speedup_pipelined']:.2f}x)")
                st = jax.jit(functools.partial(fp8.cast_weights, seam))(st, pb)
            # The forward as `fp8.apply` runs it (inference, or any call whose
            # counts are not asked for: the ledger statistics are left out,
            # as Flax's forward leaves out its amax), and with the ledger's
            # increments returned (`apply_with_ledger`: a second pass over
            # the GEMM output for the hidden's amax, and the input's).
            fwd = timed(lambda s, p, x: fp8.apply(seam, s, p, x), (st, pb, h), args.warmup, args.iters)
            fwd_l = timed(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x), (st, pb, h),
                          args.warmup, args.iters)
            y, inc = fwd_l["out"]
            fb = timed(fb_of(lambda s, p, x: fp8.apply(seam, s, p, x), (0, 1, 2)), (st, pb, h, ct),
                       args.warmup, args.iters)
            gfwd = graph(lambda s, p, x: fp8.apply(seam, s, p, x), (st, pb, h), 2)
            gfwd_l = graph(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x), (st, pb, h), 2)
            extra.update({"fwd_ledger": strip(fwd_l), "graph_fwd_ledger": gfwd_l,
                          "fwd_ledger_speedup": bf_fwd["median_ms"] / fwd_l["median_ms"],
                          "fwd_ledger_speedup_pipelined": bf_fwd["pipelined_ms"] / fwd_l["pipelined_ms"]})
            if gfwd_l and bf_gfwd:
                extra["graph_fwd_ledger_speedup"] = (bf_gfwd["per_call_pipelined_ms"]
                                                     / gfwd_l["per_call_pipelined_ms"])
            gfb = graph(fb_of(lambda s, p, x: fp8.apply(seam, s, p, x), (0, 1, 2)), (st, pb, h, ct), 2)
            _, (g_state, g_p, g_x) = fb["out"]
            record(name, fwd, fb, y, g_x, g_p, {
                **extra,
                "fp8_calls_fwd": fp8_calls(st, inc), "fp8_calls_fb": fp8_calls(st, g_state),
                "gate_worst_cos": bound.certification.worst_cos,
                "gate_bare_cos": min(bound.certification.bare_cosines)}, gfwd, gfb)
            if key in ("static", "static-u"):
                # Inference: weights quantized once (per channel), no
                # per-call weight work; forward only.
                frozen = bound.freeze(pb)
                fz = timed(lambda s, p, x: fp8.apply_with_ledger(seam, s, p, x), (st, frozen, h),
                           args.warmup, args.iters)
                record(name + " frozen-weights (inference)", fz, None, fz["out"][0],
                       extra={"fp8_calls_fwd": fp8_calls(st, fz["out"][1])})
                log(f"  {name} frozen-weights (inference): fwd {fz['median_ms']:.3f} ms "
                    f"({bf_fwd['median_ms'] / fz['median_ms']:.2f}x bf16), pipelined "
                    f"{bf_fwd['pipelined_ms'] / fz['pipelined_ms']:.2f}x")
            log(f"  {name}: fwd {fwd['median_ms']:.3f} ms ({bf_fwd['median_ms'] / fwd['median_ms']:.2f}x bf16), "
                f"fwd+bwd {fb['median_ms']:.3f} ms ({bf_fb['median_ms'] / fb['median_ms']:.2f}x)")

        # --- flax, same inputs, same run
        ops, problem = ({}, None) if args.no_flax else _flax_ops()
        if problem:
            rows.append({**base, "variant": "flax", "error": problem})
        for op_name, cls in ops.items():
            try:
                mod = _flax_swiglu(op_name, cls)
                ws = (pb["w_gate"], pb["w_up"], pb["w_down"])
                variables = mod.init(jax.random.key(1), h, *ws)
                fb_fn = fb_of(lambda v, x, *w: mod.apply(v, x, *w), (0, 1, 2, 3, 4))
                fb_jit = jax.jit(fb_fn)
                # populate the amax histories / scales like a few training steps would
                for _ in range(3):
                    variables = fb_jit(variables, h, *ws, ct)[1][0]
                fwd = timed(lambda v, x, *w: mod.apply(v, x, *w), (variables, h) + ws, args.warmup, args.iters)
                fb = timed(fb_fn, (variables, h) + ws + (ct,), args.warmup, args.iters)
                g = fb["out"][1]
                gfwd = graph(lambda v, x, *w: mod.apply(v, x, *w), (variables, h) + ws, 1)
                gfb = graph(fb_fn, (variables, h) + ws + (ct,), 1)
                record(f"flax {op_name}", fwd, fb, fwd["out"], g[1],
                       {"w_gate": g[2], "w_up": g[3], "w_down": g[4]}, gfwd=gfwd, gfb=gfb)
                log(f"  flax {op_name}: fwd {fwd['median_ms']:.3f} ms, fwd+bwd {fb['median_ms']:.3f} ms")
            except Exception as err:  # report and keep going: flax is the comparison, not the subject
                rows.append({**base, "variant": f"flax {op_name}", "error": f"{type(err).__name__}: {err}"})
                traceback.print_exc()
    print_table("FFN seam (ms: median; speedup vs bf16; cos vs bf16)", rows, [
        ("shape", lambda r: "x".join(map(str, r["shape"]))),
        ("variant", lambda r: r["variant"][:34]),
        ("fwd ms", lambda r: r["fwd"]["median_ms"]),
        ("fwd x", lambda r: r.get("fwd_speedup")),
        ("f+b ms", lambda r: r["fb"]["median_ms"]),
        ("f+b x", lambda r: r.get("fb_speedup")),
        ("pipe fwd x", lambda r: r.get("fwd_speedup_pipelined")),
        ("pipe f+b x", lambda r: r.get("fb_speedup_pipelined")),
        ("graph fwd x", lambda r: r.get("graph_fwd_speedup")),
        ("graph f+b x", lambda r: r.get("graph_fb_speedup")),
        ("graph fwd+ledger x", lambda r: r.get("graph_fwd_ledger_speedup")),
        ("cos bare", lambda r: r.get("cos_bare")),
        ("dx cos", lambda r: r.get("grad_cos_dx")),
        ("dw cos", lambda r: r.get("grad_cos_dw_min")),
        ("cos bound", lambda r: r.get("cos_boundary")),
        ("f8 fwd", lambda r: r["fwd"]["hlo"].get("cublas_fp8")),
        ("f8 f+b", lambda r: r["fb"]["hlo"].get("cublas_fp8")),
        ("error", lambda r: r.get("error", "")[:60] or None),
    ])
    return rows


# ---------------------------------------------------------------------- end to end
E2E_CONFIGS = {
    "medium": dict(dim=2048, heads=16, kv=4, ffn=5632, depth=16, batch=4, seq=2048),
    "7b": dict(dim=4096, heads=32, kv=8, ffn=11008, depth=8, batch=2, seq=4096),
}
SMOKE_E2E = {"tiny": dict(dim=64, heads=4, kv=2, ffn=128, depth=2, batch=2, seq=32)}


def _attention_impl(args) -> Optional[str]:
    if args.attention != "auto":
        return None if args.attention == "xla" else args.attention
    return "cudnn" if jax.default_backend() == "gpu" else None


def _sgd(params, grads, lr=1e-4):
    return jax.tree_util.tree_map(lambda p, g: p - lr * g.astype(p.dtype), params, grads)


def e2e_section(args) -> List[Dict[str, Any]]:
    configs = SMOKE_E2E if args.smoke else {k: E2E_CONFIGS[k] for k in args.configs.split(",")}
    rows = []
    for name, c in configs.items():
        impl = _attention_impl(args)
        for attempt in range(2):
            try:
                rows.append(_e2e_one(args, name, c, impl, rows))
                break
            except Exception as err:
                if impl == "cudnn" and attempt == 0:
                    log(f"  {name}: attention_impl='cudnn' failed ({type(err).__name__}: {str(err)[:200]}); "
                        "retrying with XLA attention")
                    impl = None
                    continue
                traceback.print_exc()
                rows.append({"config": name, "error": f"{type(err).__name__}: {err}"})
                break
    table = []
    for r in rows:
        for g in r.get("variants", {}) or [None]:
            table.append({**r, "guard": g, **(r["variants"][g] if g else {})})
    print_table("reconstruct train step (ms: median; fp8 = qkv, o and ffn seams; guard: where a failed check "
                "falls back, one lax.cond per block call / the step / none)", table, [
        ("config", lambda r: r["config"]),
        ("attention", lambda r: r.get("attention_impl")),
        ("guard", lambda r: r.get("guard")),
        ("bf16 ms", lambda r: r["bf16"]["median_ms"]),
        ("fp8 ms", lambda r: r["fp8"]["median_ms"]),
        ("speedup", lambda r: r.get("speedup")),
        ("pipe x", lambda r: r.get("speedup_pipelined")),
        ("fp8 TF/s", lambda r: r.get("fp8_tflops")),
        ("f8 GEMMs", lambda r: r["fp8"]["hlo"].get("cublas_fp8")),
        ("conds", lambda r: r["fp8"]["hlo"].get("conditionals")),
        ("whiles", lambda r: r["fp8"]["hlo"].get("whiles")),
        ("copies", lambda r: r["fp8"]["hlo"].get("copies")),
        ("gate cos", lambda r: r.get("gate_worst_cos")),
        ("fallbacks", lambda r: r.get("fallbacks")),
        ("error", lambda r: r.get("error", "")[:60] or None),
    ])
    return rows


GUARDS = ("block", "step", "off")
#: ``<guard>+graphs``: the same step compiled with conditionals and while
#: loops inside CUDA graphs (XLA's command buffers; the default set is the
#: first six), where a conditional is a graph node decided on the device
#: instead of a predicate read back to the host.
GRAPH_CONDS = {"xla_gpu_enable_command_buffer":
               "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"}


def _guard_spec(spec: str) -> tuple:
    """``'block+graphs'`` -> ``('block', GRAPH_CONDS, False, 'channel')``;
    ``'off+delayed'`` -> ``('off', None, True, 'channel')`` (delayed gradient
    scaling); ``'+delayedw'`` / ``'+castw'`` set the last (delayed per-tensor
    weight scales, the weights cast to fp8 once at the start of the step or
    not); raises ValueError for an unknown guard or suffix, or two weight
    suffixes."""
    guard, *extras = spec.split("+")
    weight_kinds = {"delayedw", "castw"}
    if (guard not in GUARDS or any(e not in {"graphs", "delayed"} | weight_kinds for e in extras)
            or len(set(extras)) != len(extras) or len(weight_kinds & set(extras)) > 1):
        raise ValueError(spec)
    weights = "delayed" if "delayedw" in extras else "cast" if "castw" in extras else "channel"
    return guard, (GRAPH_CONDS if "graphs" in extras else None), "delayed" in extras, weights


def guard_variant(bound: "fp8.BoundBlock", guard: str) -> "fp8.BoundBlock":
    """The bound block with guard ``'block'`` / ``'step'`` (where a failed check
    falls back) or ``'off'`` (no value checks: every call runs fp8). Same
    calibration and gate for all. Raises ValueError otherwise."""
    if guard == "off":
        return bound.with_recipe(check_values=False)
    if guard not in GUARDS:
        raise ValueError(f"unknown guard {guard!r}; expected one of {GUARDS}")
    return bound.with_fallback(guard)


def _e2e_one(args, name, c, impl, done: List[Dict[str, Any]]) -> Dict[str, Any]:
    log(f"e2e {name}: {c}, attention_impl={impl}, guards {args.guards}")
    cfg = BlockConfig(dim=c["dim"], num_heads=c["heads"], num_kv_heads=c["kv"], ffn_hidden_dim=c["ffn"],
                      compute_dtype="bf16", max_seq_len=c["seq"], attention_impl=impl)
    keys = jax.random.split(jax.random.key(0), 4)
    params = init_stack(keys[0], cfg, c["depth"])
    x = jax.random.normal(keys[1], (c["batch"], c["seq"], c["dim"]), jnp.float32).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[2], x.shape, jnp.float32)
    x_cal = jax.random.normal(keys[3], (1, c["seq"], c["dim"]), jnp.float32).astype(jnp.bfloat16)
    tokens = c["batch"] * c["seq"]
    flops = 4.0 * tokens * c["depth"] * cfg.block_flops_per_token(c["seq"])  # fwd + recompute + 2x bwd

    seams = fp8.block_seams(activation=args.scaling)
    t = time.perf_counter()
    bound = fp8.bind_block(cfg, params, [x_cal], seams)
    bind_s = time.perf_counter() - t
    log(f"  bind_block {bind_s:.0f} s, worst gate cos "
        + ", ".join(f"{n} {cc['worst_cos']:.6f}" for n, cc in bound.certification.items()))
    # One calibration for every guard variant: they differ only in how a
    # failed check falls back (the scales and the gate are the same), and
    # in how output gradients are scaled. Delayed variants start from the
    # gradient scales a current variant observed, so those run first.
    specs = sorted(args.guards, key=lambda g: _guard_spec(g)[2])
    if any(_guard_spec(g)[2] for g in specs) and all(_guard_spec(g)[2] for g in specs):
        raise ValueError("a '+delayed' variant needs a current-scaling variant in --guards to observe "
                         "the gradient scales it starts from")
    # '+delayedw' / '+castw': the same activation scales with delayed
    # per-tensor weight scales (the gate above ran with per-channel ones;
    # bench_fp8 --ffn gates every scaling).
    variants = {}
    for spec in specs:
        guard, _, delayed, weights = _guard_spec(spec)
        variants[spec] = guard_variant(bound, guard).with_recipe(
            params, gradient="delayed" if delayed else "current", weight="delayed" if weights == "cast" else weights)

    stack = eae_jax.reconstruct(decoder_block(cfg))

    def step_bf16(params, x, ct):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(stack(p, x).astype(jnp.float32) * ct))(params)
        return _sgd(params, g), loss

    def step_fp8_of(b, cast=False):
        stack8 = eae_jax.reconstruct(b.block_fn())

        def step_fp8(params, state, x, ct):
            if cast:
                # Once per step, for the forward and the recomputation.
                state = b.cast_weights(state, params)

            def loss_fn(params, state):
                return jnp.mean(stack8({"params": params, "fp8": state}, x).astype(jnp.float32) * ct)

            loss, (gp, gs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, state)
            if b.fallback == "step":
                # The step decides once: a failed check drops the update (the
                # training command then reruns the step in high precision).
                new_state, bad = b.fold_step(state, gs)
                return jax.lax.cond(bad, lambda ops: ops[0], lambda ops: _sgd(*ops), (params, gp)), new_state, loss
            return _sgd(params, gp), b.fold(state, gs), loss

        return step_fp8

    # Each variant trains its own copy of the params (the step donates them).
    copies = {g: jax.tree_util.tree_map(jnp.copy, params) for g in variants}
    jobs = {"bf16": (step_bf16, (params, x, ct), (0,))}
    jobs.update({g: (step_fp8_of(b, _guard_spec(g)[3] == "cast"), (copies[g], b.state, x, ct), (0,),
                     _guard_spec(g)[1])
                 for g, b in variants.items()})
    built = compile_all(jobs)

    bf = timed(step_bf16, (params, x, ct), args.warmup, args.iters,
               feed=lambda a, out: (out[0],) + tuple(a[1:]), donate=(0,), built=built["bf16"])
    log(f"  bf16 step {bf['median_ms']:.1f} ms")
    del bf["args"]
    row = {"config": name, **c, "attention_impl": impl, "bf16": strip(bf), "bf16_loss_last": float(bf["out"][1]),
           "bf16_tflops": flops / bf["median_ms"] / 1e9,
           "bind_s": bind_s, "gate_worst_cos": min(cc["worst_cos"] for cc in bound.certification.values()),
           "gate_bare_cos": {n: min(cc["bare_cos_per_layer"]) for n, cc in bound.certification.items()},
           "all_fp8_block_cos_min": min(bound.certification["ffn"]["all_fp8_block_cos_per_layer"]),
           "scaling": args.scaling, "variants": {}}
    observed = None
    for g, b in variants.items():
        state0 = b.state
        if _guard_spec(g)[2]:
            state0 = {n: s._replace(grad_scales=observed[n].grad_scales) for n, s in b.state.items()}
            b.require_grad_scales(state0)
        f8 = timed(None, (copies[g], state0, x, ct), args.warmup, args.iters,
                   feed=lambda a, out: (out[0], out[1]) + tuple(a[2:]), donate=(0,), built=built[g])
        log(f"  fp8 step, guard {g}: {f8['median_ms']:.1f} ms")
        state = f8["out"][1]
        if not _guard_spec(g)[2]:
            observed = state
        report = b.report(state)
        steps = f8["calls"]
        del f8["args"]
        row["variants"][g] = {
            "fp8": strip(f8), "fp8_loss_last": float(f8["out"][2]),
            "speedup": bf["median_ms"] / f8["median_ms"],
            "speedup_pipelined": bf["pipelined_ms"] / f8["pipelined_ms"],
            "fp8_tflops": flops / f8["median_ms"] / 1e9,
            "fallbacks": sum(e["fallbacks"] for e in report),
            "calls_exact": all(e["calls"] == steps for e in report),
            "fp8_fraction": sum(e["fp8_calls"] for e in report) / max(1, sum(e["calls"] for e in report)),
            "grad_clipped": sum(sum(e.get("grad_clipped", [])) for e in report),
            "weight_clipped": sum(sum(e.get("weight_clipped", [])) for e in report),
        }
        args.progress("e2e", done + [row])  # a later timeout keeps what was measured
    return row


# ---------------------------------------------------------------------- LM training
def _markov_batches(rng, steps, batch, seq, vocab, order=1):
    """Markov token streams of the given order: each context of ``order``
    previous tokens has 4 likely successors (p = .55, .25, .12, .08).

    The entropy is about 1.13 nats, so a model that learns the transitions
    drops far below the uniform ``ln(vocab)``: a run that stalls shows. Order 1
    (``vocab * 4`` transitions) is learnable within a few hundred steps at
    the sizes used here; order 2 (``vocab**2 * 4``) is not. Cheap to
    generate and identical for every run.
    """
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order}")
    succ = rng.integers(0, vocab, size=(vocab,) * order + (4,))
    probs = np.array([0.55, 0.25, 0.12, 0.08])
    toks = np.empty((steps, batch, seq + 1), np.int32)
    toks[:, :, :order] = rng.integers(0, vocab, size=(steps, batch, order))
    choice = rng.choice(4, size=(steps, batch, seq + 1), p=probs)
    for t in range(order, seq + 1):
        ctx = tuple(toks[:, :, t - order + i] for i in range(order))
        toks[:, :, t] = succ[ctx + (choice[:, :, t],)]
    return toks


def train_section(args) -> Dict[str, Any]:
    import optax

    from eae_jax.models import LMConfig, cross_entropy, init_lm, lm_stack, merge_grads, split_params
    from eae_jax.models.llama import embed

    if args.smoke:
        c = dict(vocab=64, depth=2, dim=64, heads=4, kv=2, ffn=128, batch=4, seq=32, steps=20)
    else:
        c = dict(vocab=512, depth=4, dim=512, heads=8, kv=4, ffn=1536, batch=32, seq=256, steps=args.train_steps)
    impl = _attention_impl(args)
    cfg = LMConfig(vocab_size=c["vocab"], depth=c["depth"],
                   block=BlockConfig(dim=c["dim"], num_heads=c["heads"], num_kv_heads=c["kv"],
                                     ffn_hidden_dim=c["ffn"], compute_dtype="bf16", max_seq_len=c["seq"],
                                     attention_impl=impl))
    log(f"train: {c}, attention_impl={impl}")
    data = _markov_batches(np.random.default_rng(0), c["steps"], c["batch"], c["seq"], c["vocab"], args.markov_order)
    params0 = init_lm(jax.random.key(0), cfg)
    sched = optax.warmup_cosine_decay_schedule(0.0, 2e-3, max(1, c["steps"] // 10), c["steps"], 2e-4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))

    def run(kind, fast_bwd=False):
        params = jax.tree_util.tree_map(jnp.copy, params0)  # each run donates its own copy
        opt = tx.init(params)
        if kind == "bf16":
            stack = lm_stack(cfg)

            def step(params, opt, state, toks):
                def loss_fn(plist):
                    return cross_entropy(stack(plist, toks[:, :-1]), toks[:, 1:])

                loss, g = jax.value_and_grad(loss_fn)(split_params(params, cfg))
                updates, opt = tx.update(merge_grads(g, cfg), opt, params)
                return optax.apply_updates(params, updates), opt, state, loss

            state = None
        else:
            cal = jnp.asarray(data[0][:, :-1])
            seams = fp8.block_seams(activation=args.train_scaling, fast_accum_bwd=fast_bwd,
                                    weight=args.train_weight_scaling)
            bound = fp8.bind_block(cfg.block, params["blocks"], [embed(params["embed"], cal, jnp.bfloat16)], seams)
            stack = lm_stack(cfg, block_fn=bound.block_fn())
            state = bound.state

            def step(params, opt, state, toks):
                def loss_fn(plist):
                    return cross_entropy(stack(plist, toks[:, :-1]), toks[:, 1:])

                e, b, h = split_params(params, cfg)
                loss, g = jax.value_and_grad(loss_fn)([e, {"params": b, "fp8": state}, h])
                grads = merge_grads([g[0], g[1]["params"], g[2]], cfg)
                updates, opt = tx.update(grads, opt, params)
                return optax.apply_updates(params, updates), opt, bound.fold(state, g[1]["fp8"]), loss

        t = time.perf_counter()
        jstep = jax.jit(step, donate_argnums=(0, 1))
        losses, times = [], []
        for i in range(c["steps"]):
            t1 = time.perf_counter()
            params, opt, state, loss = jstep(params, opt, state, jnp.asarray(data[i]))
            losses.append(float(loss))  # syncs every step
            times.append((time.perf_counter() - t1) * 1e3)
        total = time.perf_counter() - t
        out = {"losses": losses, "step_ms_median": statistics.median(times[5:]) if len(times) > 6 else None,
               "total_s": total}
        if kind == "fp8":
            rep = bound.report(state)
            out["ledger"] = {"calls": sum(e["calls"] for e in rep), "fp8_calls": sum(e["fp8_calls"] for e in rep),
                             "fallbacks": sum(e["fallbacks"] for e in rep),
                             "detached": [e["seam"] for e in rep if e["detached"]],
                             "by_reason": {r: sum(e["by_reason"].get(r, 0) for e in rep) for r in fp8.REASONS
                                           if any(r in e["by_reason"] for e in rep)}}
            out["gate_worst_cos"] = min(cc["worst_cos"] for cc in bound.certification.values())
            out["weight_clipped"] = sum(sum(e.get("weight_clipped", [])) for e in rep)
        log(f"  {kind}: first loss {losses[0]:.4f}, last {losses[-1]:.4f}, {total:.1f} s")
        return out

    res = {"config": c, "scaling": args.train_scaling, "weight_scaling": args.train_weight_scaling,
           "attention_impl": impl, "markov_order": args.markov_order,
           "uniform_loss": float(np.log(c["vocab"]))}
    res["bf16"] = run("bf16")
    res["fp8"] = run("fp8")
    if args.train_fast_bwd:
        # The same fp8 run with cuBLASLt fast accumulation in the gradient
        # GEMMs (XLA's default for fp8 dots at default precision).
        res["fp8_fast_accum_bwd"] = run("fp8", fast_bwd=True)
    tail = max(1, min(20, c["steps"] // 5))
    lb, lf = np.mean(res["bf16"]["losses"][-tail:]), np.mean(res["fp8"]["losses"][-tail:])
    res.update(final_bf16=float(lb), final_fp8=float(lf), rel_diff=float(abs(lf - lb) / lb), tail_steps=tail,
               within_2pct=bool(abs(lf - lb) / lb <= 0.02))
    if "fp8_fast_accum_bwd" in res:
        lq = np.mean(res["fp8_fast_accum_bwd"]["losses"][-tail:])
        res.update(final_fp8_fast_accum_bwd=float(lq), rel_diff_fast_accum_bwd=float(abs(lq - lb) / lb))
    print_table(f"LM training, {c['steps']} steps (final = mean of last {tail} losses)", [res], [
        ("bf16 final", lambda r: r["final_bf16"]),
        ("fp8 final", lambda r: r["final_fp8"]),
        ("rel diff", lambda r: r["rel_diff"]),
        ("fast-bwd final", lambda r: r.get("final_fp8_fast_accum_bwd")),
        ("uniform", lambda r: r["uniform_loss"]),
        ("<=2%", lambda r: r["within_2pct"]),
        ("bf16 ms", lambda r: r["bf16"]["step_ms_median"]),
        ("fp8 ms", lambda r: r["fp8"]["step_ms_median"]),
        ("fp8 calls", lambda r: r["fp8"]["ledger"]["fp8_calls"]),
        ("fallbacks", lambda r: r["fp8"]["ledger"]["fallbacks"]),
    ])
    return res


# ---------------------------------------------------------------------- main
def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ffn", action="store_true", help="FFN seam micro-benchmark (with Flax side by side)")
    ap.add_argument("--e2e", action="store_true", help="reconstruct train steps, bf16 vs fp8 seams")
    ap.add_argument("--train", action="store_true", help="LM training run, fp8 vs bf16 final loss")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, CI): checks the script runs")
    ap.add_argument("--ffn-shapes", default="1b,7b",
                    help="FFN shapes: comma list of 1b (tokens 8192, dim 2048, ffn 5632), 7b (8192, 4096, 11008)")
    ap.add_argument("--ffn-variants", default="",
                    help=f"FFN: comma list of eae variants to run (default all): {', '.join(FFN_VARIANTS)}")
    ap.add_argument("--no-flax", action="store_true", help="FFN: leave out Flax's fp8 ops")
    ap.add_argument("--graph-copies", type=int, default=None,
                    help="FFN: also time this many calls inside one jitted function (no host dispatch between "
                         "them; 'graph' columns); 0: off (default 8, 2 with --smoke)")
    ap.add_argument("--configs", default="medium,7b", help="e2e configs: comma list of medium,7b")
    ap.add_argument("--scaling", default="static", choices=fp8.ACTIVATION_SCALINGS, help="e2e activation scaling")
    ap.add_argument("--guards", default="block,step,off",
                    help="e2e: comma list of guard variants timed against one bf16 step: "
                         "'block' (a lax.cond per block call), 'step' (checks, no cond in the "
                         "blocks: the step decides, a failed one is dropped), 'off' (no in-graph checks); "
                         "'<guard>+graphs' compiles it with conditionals and loops inside CUDA graphs; "
                         "'<guard>+delayed' scales output gradients from the amax observed in the previous "
                         "step (delayed scaling; needs a current-scaling variant in the list); "
                         "'<guard>+delayedw' uses delayed per-tensor weight scales, "
                         "'<guard>+castw' delayed ones with the weights cast to fp8 once per step")
    ap.add_argument("--train-scaling", default="delayed", choices=fp8.ACTIVATION_SCALINGS,
                    help="activation scaling for the training run (delayed follows drifting activations)")
    ap.add_argument("--train-weight-scaling", default="channel", choices=fp8.WEIGHT_SCALINGS,
                    help="e4m3 weight scaling of the training run's fp8 seams")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--markov-order", type=int, default=1, choices=(1, 2),
                    help="training data: Markov order of the token streams (1: learnable in 300 steps)")
    ap.add_argument("--train-fast-bwd", action="store_true",
                    help="also train with fp8 fast accumulation in the gradient GEMMs (the old default)")
    ap.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"),
                    help="attention kernel (auto: cudnn on GPU; both runs use the same)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=None, help="output folder (default $OUT or experiments/results)")
    args = ap.parse_args(argv)
    args.ffn_shapes = [k for k in args.ffn_shapes.split(",") if k]
    if not args.ffn_shapes or any(k not in FFN_SHAPES for k in args.ffn_shapes):
        ap.error(f"--ffn-shapes: expected a comma list of {sorted(FFN_SHAPES)}, got {args.ffn_shapes}")
    args.ffn_variants = [k for k in args.ffn_variants.split(",") if k]
    if any(k not in FFN_VARIANTS for k in args.ffn_variants):
        ap.error(f"--ffn-variants: expected a comma list of {list(FFN_VARIANTS)}, got {args.ffn_variants}")
    args.guards = [g for g in args.guards.split(",") if g]
    unknown = []
    for g in args.guards:
        try:
            _guard_spec(g)
        except ValueError:
            unknown.append(g)
    if unknown or not args.guards:
        ap.error(f"--guards: unknown {unknown}; expected a comma list of {GUARDS}, each optionally "
                 "with '+graphs' (conditionals inside CUDA graphs), '+delayed' (delayed gradient scaling) "
                 "and/or '+delayedw' / '+castw' (delayed per-tensor weight scales, cast once per step or not)")
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    if args.iters is None:
        args.iters = 3 if args.smoke else 12
    if args.graph_copies is None:
        args.graph_copies = 2 if args.smoke else 8
    if args.graph_copies < 0:
        ap.error(f"--graph-copies must be >= 0, got {args.graph_copies}")
    chosen = [k for k in ("ffn", "e2e", "train") if getattr(args, k)]
    if not chosen:
        args.ffn = args.e2e = args.train = True
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    # One file per section set, so split runs do not overwrite each other.
    name = "bench_fp8" + ("_smoke" if args.smoke else "") + ("_" + "_".join(chosen) if chosen else "")
    path = os.path.join(out_dir, name + ".json")
    results: Dict[str, Any] = {"env": env_info(), "args": vars(args)}
    log(f"env: {results['env']}")

    def save():
        # Written whole, then renamed: a run killed at its time limit leaves
        # the last complete file, never a truncated one.
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(results, fh, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
        os.replace(tmp, path)

    def progress(key, value):
        results[key] = value
        save()

    args.progress = progress

    for flag, section, key in ((args.ffn, ffn_section, "ffn"), (args.e2e, e2e_section, "e2e"),
                               (args.train, train_section, "train")):
        if not flag:
            continue
        t = time.perf_counter()
        try:
            results[key] = section(args)
        except Exception as err:  # keep the other sections' results
            traceback.print_exc()
            results[key] = {"error": f"{type(err).__name__}: {err}"}
        results.setdefault("section_seconds", {})[key] = time.perf_counter() - t
        save()
    summary(results)
    log(f"wrote {path}")
    return results


def summary(results: Dict[str, Any]) -> None:
    """The headline numbers of every section that ran, against the issue's targets."""
    rows = []
    for r in results.get("ffn", []) if isinstance(results.get("ffn"), list) else []:
        if "error" in r or r["variant"].startswith("bf16"):
            continue
        rows.append({"what": f"FFN {'x'.join(map(str, r['shape']))} {r['variant'][:30]}",
                     "fwd x": r.get("fwd_speedup"), "f+b x": r.get("fb_speedup"),
                     "pipe fwd x": r.get("fwd_speedup_pipelined"), "pipe f+b x": r.get("fb_speedup_pipelined"),
                     "graph fwd x": r.get("graph_fwd_speedup"), "graph f+b x": r.get("graph_fb_speedup"),
                     "cos bare": r.get("cos_bare"), "cos boundary": r.get("cos_boundary")})
    for r in results.get("e2e", []) if isinstance(results.get("e2e"), list) else []:
        for g, v in r.get("variants", {}).items():
            rows.append({"what": f"reconstruct step {r['config']}, guard {g}", "f+b x": v["speedup"],
                         "cos boundary": r["gate_worst_cos"]})
    tr = results.get("train")
    if isinstance(tr, dict) and "error" not in tr:
        rows.append({"what": f"LM training {tr['config']['steps']} steps: fp8/bf16 final loss rel diff",
                     "f+b x": tr["rel_diff"]})
    if rows:
        print_table("summary (targets: FFN fwd >= 1.6x / 1.75x, f+b >= 1.25x / 1.5x at 1B / 7B shapes; "
                    "boundary cos >= 0.999; step >= 1.2x medium, 1.35x 7B; LM loss within 2%)", rows, [
                        ("what", lambda r: r["what"]), ("fwd x", lambda r: r.get("fwd x")),
                        ("f+b x / diff", lambda r: r.get("f+b x")),
                        ("pipe fwd x", lambda r: r.get("pipe fwd x")), ("pipe f+b x", lambda r: r.get("pipe f+b x")),
                        ("graph fwd x", lambda r: r.get("graph fwd x")),
                        ("graph f+b x", lambda r: r.get("graph f+b x")), ("cos bare", lambda r: r.get("cos bare")),
                        ("cos boundary", lambda r: r.get("cos boundary"))])


if __name__ == "__main__":
    main()
