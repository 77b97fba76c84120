"""Where the time of the FFN seam goes: a per-kernel GPU profile, bf16 vs fp8 vs Flax.

    python experiments/profile_fp8_seam.py [--shape 8192,2048,5632] [--iters 10] [--out DIR]
    python experiments/profile_fp8_seam.py --step medium [--guards block,step,off]

``--step CONFIG`` profiles a whole reconstruct train step instead (the
configs of ``bench_fp8.py --e2e``, plus ``tiny``): bf16 and the fp8 block
with each guard variant. The gap between wall time and device busy time is
what the step spends waiting (on a GPU, every ``lax.cond`` reads its
predicate back to the host). On CPU the trace has host op events only, which
nest and overlap, so "busy" is not comparable with wall time there.

Each variant is jitted and compiled, warmed up, then run ``--iters`` times
under `jax.profiler.trace`. The trace's device events are grouped by kernel
(HLO instruction) name and summed per iteration, so the table says which
GEMMs and which elementwise fusions cost what. Each variant's compiled HLO
is written next to the JSON (``hlo/<variant>.txt``) to map a fusion name to
what it computes.

Variants (forward ``fwd`` and forward+backward ``fb`` of each):

* ``bf16``: `eae_jax.blocks.swiglu`.
* ``raw-current`` / ``raw-delayed``: the bare FFN through `eae_jax.fp8.fp8_linear`
  (no seam, no checks) with current / delayed scaling of the output
  gradients (delayed scales from one observed backward, 1 binade margin;
  the delayed variants observe the gradient amax, as a train step does).
* ``raw-delayedw-delayed``: per-tensor weight scales from an earlier
  observation (`eae_jax.fp8.LiveWeight` with a scale) and delayed gradient scales.
* ``raw-castw-delayed``: the same with the weights cast to fp8 beforehand
  (`eae_jax.fp8.cast_weights`, once per train step): no weight quantization
  in the call.
* ``raw-delayedw-stats``: its forward plus the amax / saturation
  statistics a seam call computes (forward only differs).
* ``raw-frozen``: the same forward with weights quantized once
  (`eae_jax.fp8.quantize_weight`, inference): no per-call weight work.
* ``raw-split`` / ``raw-split-delayed``: the same with gate and up as two
  GEMMs instead of one over their fp8 concatenation.
* ``eae``: `eae_jax.fp8` FFN seam, static scales, guards on.
* ``eae-unguarded``: the same with ``check_values=False``.
* ``eae-delayedw`` / ``eae-delayedw-unguarded``: both with delayed
  per-tensor weight scales.
* ``eae-castw-unguarded``: the unguarded seam with delayed weight scales
  and its weights cast beforehand.
* ``eae-castw-guarded``: the same with guards on, its forward as
  `eae_jax.fp8.apply` runs it (the checks decide a cond, so their
  statistics stay in the forward).
* ``flax``: ``flax.linen.Fp8DirectDotGeneralOp`` SwiGLU (when flax has it).

Output: one table per variant (top kernels, microseconds per iteration) and
``profile_fp8_seam.json`` in ``--out`` (default ``$OUT`` or
``experiments/results``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eae_jax import fp8, observe  # noqa: E402
from eae_jax.blocks import init_swiglu, rms_norm, swiglu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8 import guard_variant  # noqa: E402


def device_kernel_times(trace_dir: str, iters: int) -> Dict[str, Any]:
    """Sum device-side event durations by name from a profiler trace.

    Returns ``{'kernels': [(name, us_per_iter, calls_per_iter)], 'busy_us':
    total device time per iteration}``; host-only traces (CPU backend) give
    the host's XLA op events instead, so the script also runs on CPU.
    """
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"no trace file under {trace_dir}")
    with gzip.open(files[0]) as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in procs.items() if "GPU" in n or "gpu" in n or "device" in n.lower()}
    use = gpu_pids or set(procs)
    total = collections.defaultdict(float)
    calls = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in use:
            continue
        name = e.get("name", "?")
        if gpu_pids and procs.get(e["pid"], "").endswith("CPU"):
            continue
        total[name] += float(e.get("dur", 0.0))
        calls[name] += 1
    rows = sorted(((n, t / iters, calls[n] / iters) for n, t in total.items()), key=lambda r: -r[1])
    return {"kernels": rows, "busy_us": sum(t for _, t, _ in rows), "device_processes": sorted(procs[p] for p in use)}


def profile(name: str, fn: Callable, args: tuple, iters: int, out_dir: str) -> Dict[str, Any]:
    """Compile, time (wall, block_until_ready) and trace one function."""
    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t
    os.makedirs(os.path.join(out_dir, "hlo"), exist_ok=True)
    text = compiled.as_text()
    with open(os.path.join(out_dir, "hlo", name + ".txt"), "w") as fh:
        fh.write(text)
    for _ in range(3):
        jax.block_until_ready(compiled(*args))
    wall = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        wall.append((time.perf_counter() - t) * 1e3)
    tdir = tempfile.mkdtemp(prefix="eae_prof_")
    try:
        jax.profiler.start_trace(tdir)
        for _ in range(iters):
            jax.block_until_ready(compiled(*args))
        jax.profiler.stop_trace()
        prof = device_kernel_times(tdir, iters)
    finally:
        shutil.rmtree(tdir, ignore_errors=True)
    median = statistics.median(wall)
    return {"variant": name, "median_ms": median, "compile_s": compile_s,
            "fp8_gemms": text.count('"__cublas$lt$matmul$f8"'), "conditionals": text.count(" conditional("),
            **prof, "idle_ms": median - prof["busy_us"] / 1e3}


def print_profile(rec: Dict[str, Any], top: int) -> None:
    print(f"\n== {rec['variant']}: wall {rec['median_ms']:.3f} ms, device busy {rec['busy_us'] / 1e3:.3f} ms, "
          f"fp8 GEMMs {rec['fp8_gemms']}, conditionals {rec['conditionals']} ==")
    print(f"{'us/iter':>9} {'calls':>6}  kernel")
    for n, us, c in rec["kernels"][:top]:
        print(f"{us:9.1f} {c:6.1f}  {n[:110]}")
    sys.stdout.flush()


def variants(m: int, d: int, f: int, only: frozenset = frozenset()) -> List[tuple]:
    """The FFN variants at tokens ``m``, dim ``d``, ffn ``f``; the seams are
    bound only for the names in ``only`` (all when empty): binding is the
    slow part at the 7B-like shape."""
    def want(name):
        return not only or name in only

    keys = jax.random.split(jax.random.key(0), 6)
    pb = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(keys[0], d, f))
    ones = {"scale": jnp.ones((d,), jnp.float32)}
    x = rms_norm(ones, jax.random.normal(keys[1], (m, d), jnp.float32)).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[2], (m, d), jnp.float32).astype(jnp.bfloat16)
    streams = [jax.random.normal(k, (m, d), jnp.float32) for k in keys[3:5]]
    cal = [rms_norm(ones, r).astype(jnp.bfloat16) for r in streams]
    resid = [r.astype(jnp.bfloat16) for r in streams]

    def fb_of(apply):
        def fb(p, x_, ct_):
            return jax.grad(lambda p_, y_: jnp.sum(apply(p_, y_).astype(jnp.float32) * ct_.astype(jnp.float32)),
                            argnums=(0, 1))(p, x_)
        return fb

    out = [("bf16", swiglu, fb_of(swiglu), pb)]
    # The bare fp8 FFN through fp8_linear; its weight sources and the
    # observers (a train step's gradient / weight amax) ride in the params.
    xs = fp8.scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))))
    hs = fp8.seams.amax_points(fp8.ffn_seam(), pb, x)[1] / 448.0
    obs0 = jax.tree_util.tree_map(lambda *a: jnp.stack(a), fp8.linear_observer(), fp8.linear_observer())
    wsc0 = fp8.weight_scales_of(fp8.ffn_seam(), pb)
    frozen = (fp8.quantize_weight((pb["w_gate"], pb["w_up"])), fp8.quantize_weight(pb["w_down"]))

    def raw_ffn(p, x_, gscales, weight="channel", stats=False):
        def w(i, blocks):
            if weight == "frozen":
                return frozen[i]
            if weight == "cast":
                return fp8.CastWeight(blocks, p["cq"][i], p["wsc"][i], p["ca"][i])
            return fp8.LiveWeight(blocks, p["wsc"][i] if weight == "delayed" else None)

        def kw(i):
            ob = jax.tree_util.tree_map(lambda a: a[i], p["obs"]) if "obs" in p else None
            return {"grad_scale": None if gscales is None else gscales[i], "observer": ob}

        a = fp8.fp8_linear(x_, w(0, (p["w_gate"], p["w_up"])), xs, **kw(0))
        g, u = a[:, :f], a[:, f:]
        h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x_.dtype)
        y = fp8.fp8_linear(h, w(1, (p["w_down"],)), hs, **kw(1))
        # stats: plus the amax / saturation statistics a seam call takes for
        # its ledger and checks (their cost when XLA does not fuse them)
        return (y, fp8.state.value_stats(x_, xs), fp8.state.value_stats(h, hs)) if stats else y

    def raw_split(p, x_, gscales):
        # gate and up as two GEMMs sharing one quantization of x
        kw = [{"grad_scale": None if gscales is None else gscales[i]} for i in range(2)]
        g = fp8.fp8_linear(x_, p["w_gate"], xs, **kw[0])
        u = fp8.fp8_linear(x_, p["w_up"], xs, **kw[0])
        h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x_.dtype)
        return fp8.fp8_linear(h, p["w_down"], hs, **kw[1])

    seen = jax.grad(lambda p_: jnp.sum(raw_ffn(p_, x, None).astype(jnp.float32) * ct.astype(jnp.float32)))(
        {**pb, "obs": obs0})["obs"]
    observed = observe.receive(obs0, seen)[0]["grad"]
    gscales = jnp.where(observed > 0, observed * 2.0 / 57344.0, 1.0)
    observing = {**pb, "obs": obs0}
    casts = [fp8.cast_weight(g, wsc0[i]) for i, g in enumerate(((pb["w_gate"], pb["w_up"]), (pb["w_down"],)))]
    for label, fn, p in (
            ("raw-current", lambda p, x_: raw_ffn(p, x_, None), pb),
            ("raw-delayed", lambda p, x_: raw_ffn(p, x_, gscales), observing),
            # delayed gradient and weight scales: no reduction ahead of any quantization
            ("raw-delayedw-delayed", lambda p, x_: raw_ffn(p, x_, gscales, "delayed"), {**observing, "wsc": wsc0}),
            # weights cast beforehand (fp8.cast_weights, once per train step): no weight quantization
            ("raw-castw-delayed", lambda p, x_: raw_ffn(p, x_, gscales, "cast"),
             {**observing, "wsc": wsc0, "cq": tuple(c.q for c in casts), "ca": jnp.stack([c.amax for c in casts])}),
            # weights quantized once (inference); its backward computes dx only
            ("raw-frozen", lambda p, x_: raw_ffn(p, x_, None, "frozen"), pb),
            ("raw-split", lambda p, x_: raw_split(p, x_, None), pb),
            ("raw-split-delayed", lambda p, x_: raw_split(p, x_, gscales), pb)):
        out.append((label, fn, fb_of(fn), p))
    stats = lambda p, x_: raw_ffn(p, x_, None, "delayed", stats=True)  # noqa: E731
    out.append(("raw-delayedw-stats", stats, fb_of(lambda p, x_: stats(p, x_)[0]), {**pb, "wsc": wsc0}))
    for label, guarded, weight in (("eae", True, "channel"), ("eae-unguarded", False, "channel"),
                                   ("eae-delayedw", True, "delayed"), ("eae-delayedw-unguarded", False, "delayed")):
        if not want(label):
            continue
        seam = fp8.ffn_seam(check_values=guarded, weight=weight)
        st = fp8.bind(seam, pb, cal, residuals=resid).state
        # seam and state bound now: the names are rebound by the next
        # iteration and by the cast-weight variants below
        fwd = (lambda sm, s: lambda p, x_: fp8.apply_with_ledger(sm, s, p, x_)[0])(seam, st)
        app = (lambda sm, s: lambda p, x_: fp8.apply(sm, s, p, x_))(seam, st)
        out.append((label, fwd, fb_of(app), pb))
    # The unguarded seam given weights cast beforehand (delayed scales).
    if want("eae-castw-unguarded"):
        seam = fp8.ffn_seam(check_values=False, weight="delayed")
        st = fp8.cast_weights(seam, fp8.bind(seam, pb, cal, residuals=resid).state, pb)
        out.append(("eae-castw-unguarded", lambda p, x_: fp8.apply_with_ledger(seam, st, p, x_)[0],
                    fb_of(lambda p, x_: fp8.apply(seam, st, p, x_)), pb))
    # Guarded (the default seam) with cast weights, its forward as
    # `fp8.apply` runs it: the checks decide a cond, so their statistics stay.
    if want("eae-castw-guarded"):
        seam_g = fp8.ffn_seam(weight="delayed")
        st_g = fp8.cast_weights(seam_g, fp8.bind(seam_g, pb, cal, residuals=resid).state, pb)
        guarded = lambda p, x_: fp8.apply(seam_g, st_g, p, x_)  # noqa: E731
        out.append(("eae-castw-guarded", guarded, fb_of(guarded), pb))
    if not want("flax"):
        return [(name, fwd, fb, p, x, ct) for name, fwd, fb, p in out]
    try:
        import flax.linen as nn

        cls = getattr(nn, "Fp8DirectDotGeneralOp")
        dn = (((1,), (1,)), ((), ()))

        class FlaxSwiGLU(nn.Module):
            @nn.compact
            def __call__(self, x_, wg, wu, wd):
                g = cls(name="gate")(x_, wg, dn)
                u = cls(name="up")(x_, wu, dn)
                return cls(name="down")(nn.silu(g) * u, wd, dn)

        mod = FlaxSwiGLU()
        variables = mod.init(jax.random.key(1), x, pb["w_gate"], pb["w_up"], pb["w_down"])
        fparams = {"v": variables, **pb}

        def flax_apply(p, x_):
            return mod.apply(p["v"], x_, p["w_gate"], p["w_up"], p["w_down"])
        out.append(("flax", flax_apply, fb_of(flax_apply), fparams))
    except Exception as err:  # flax is the comparison, not the subject
        print(f"flax variant skipped: {type(err).__name__}: {err}")
    return [(name, fwd, fb, p, x, ct) for name, fwd, fb, p in out]


STEP_CONFIGS = {
    "tiny": dict(dim=64, heads=4, kv=2, ffn=128, depth=2, batch=2, seq=32),
    "medium": dict(dim=2048, heads=16, kv=4, ffn=5632, depth=16, batch=4, seq=2048),
    "7b": dict(dim=4096, heads=32, kv=8, ffn=11008, depth=8, batch=2, seq=4096),
}


def step_variants(c: Dict[str, int], guards: List[str]) -> List[tuple]:
    """``(name, step, args)``: a reconstruct train step (loss and gradients),
    bf16 and fp8 (qkv, o, ffn seams) with each guard variant."""
    import eae_jax
    from eae_jax.blocks import BlockConfig, decoder_block, init_stack

    cfg = BlockConfig(dim=c["dim"], num_heads=c["heads"], num_kv_heads=c["kv"], ffn_hidden_dim=c["ffn"],
                      compute_dtype="bf16", max_seq_len=c["seq"])
    keys = jax.random.split(jax.random.key(0), 4)
    params = init_stack(keys[0], cfg, c["depth"])
    x = jax.random.normal(keys[1], (c["batch"], c["seq"], c["dim"]), jnp.float32).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[2], x.shape, jnp.float32)
    x_cal = jax.random.normal(keys[3], (1, c["seq"], c["dim"]), jnp.float32).astype(jnp.bfloat16)
    stack = eae_jax.reconstruct(decoder_block(cfg))
    out = [("step-bf16", lambda p, x_, ct_: jax.value_and_grad(
        lambda q: jnp.mean(stack(q, x_).astype(jnp.float32) * ct_))(p), (params, x, ct))]
    bound = fp8.bind_block(cfg, params, [x_cal])
    for g in guards:
        # '<guard>+delayedw': delayed per-tensor weight scales; '<guard>+castw':
        # the same with the weights cast to fp8 once at the start of the step.
        guard, *extras = g.split("+")
        if any(e not in ("delayedw", "castw") for e in extras) or len(extras) > 1:
            raise ValueError(f"unknown step variant {g!r}: <guard>[+delayedw|+castw]")
        b = guard_variant(bound, guard)
        cast = extras == ["castw"]
        if extras:
            b = b.with_recipe(params, weight="delayed")
        stack8 = eae_jax.reconstruct(b.block_fn())

        def step(p, s, x_, ct_, stack8=stack8, b=b, cast=cast):
            if cast:
                s = b.cast_weights(s, p)
            loss, (gp, gs) = jax.value_and_grad(
                lambda q, t: jnp.mean(stack8({"params": q, "fp8": t}, x_).astype(jnp.float32) * ct_),
                argnums=(0, 1))(p, s)
            if b.fallback == "step":
                return loss, gp, b.fold_step(s, gs, notify=False)[0]
            return loss, gp, b.fold(s, gs, notify=False)

        out.append((f"step-fp8-{g}", step, (params, b.state, x, ct)))
    return out


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,2048,5632", help="tokens,dim,ffn")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--only", default="", help="comma list of variant names to run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--step", default=None, choices=sorted(STEP_CONFIGS),
                    help="profile a reconstruct train step of this config instead of the FFN seam")
    ap.add_argument("--guards", default="block,step,off", help="--step: comma list of fp8 guard variants")
    args = ap.parse_args(argv)
    m, d, f = (int(v) for v in args.shape.split(","))
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    if args.step:
        guards = [g for g in args.guards.split(",") if g]
        bad = [g for g in guards if g.split("+")[0] not in ("block", "step", "off")]
        if bad:
            ap.error(f"--guards: unknown {bad}; expected a comma list of block, step, off")
        results = {"step": args.step, "config": STEP_CONFIGS[args.step], "backend": jax.default_backend(),
                   "jax": jax.__version__, "runs": []}
        path = os.path.join(out_dir, f"profile_fp8_step_{args.step}.json")
        for name, fn, fargs in step_variants(STEP_CONFIGS[args.step], guards):
            if only and name not in only:
                continue
            rec = profile(name, fn, fargs, args.iters, out_dir)
            rec["kernels"] = rec["kernels"][:120]
            results["runs"].append(rec)
            print_profile(rec, args.top)
            with open(path, "w") as fh:  # after every variant: a timeout keeps what ran
                json.dump(results, fh, indent=1)
        return results
    results = {"shape": [m, d, f], "backend": jax.default_backend(), "jax": jax.__version__, "runs": []}
    for name, fwd, fb, p, x, ct in variants(m, d, f, frozenset(only)):
        if only and name not in only:
            continue
        for kind, fn, fargs in (("fwd", fwd, (p, x)), ("fb", fb, (p, x, ct))):
            rec = profile(f"{name}-{kind}", fn, fargs, args.iters, out_dir)
            rec["kernels"] = rec["kernels"][:40]
            results["runs"].append(rec)
            print_profile(rec, args.top)
    with open(os.path.join(out_dir, "profile_fp8_seam.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
