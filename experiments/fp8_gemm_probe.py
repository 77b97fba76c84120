"""Which GEMM kernels does XLA pick for fp8 operands, and how fast are they?

Compiles (1) a bare bf16 GEMM, (2) a bare ``dot_general`` on float8_e4m3fn
operands (weight (N, K), contracting the last axis of both), with bf16 and
f32 outputs, (3) the eae_jax FFN seam forward; prints the custom-call
targets found in each compiled HLO and the median time. Writes
``fp8_gemm_probe.json`` (and the seam's HLO) into ``--out``.

    python experiments/fp8_gemm_probe.py --out experiments/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp

from eae_jax import fp8
from eae_jax.blocks import init_swiglu


def median_ms(fn, *args, iters=20):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def custom_calls(hlo: str) -> dict:
    found = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', hlo):
        found[target] = found.get(target, 0) + 1
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")))
    args = ap.parse_args(argv)
    m, k, n = args.tokens, args.dim, args.ffn
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
    dims = (((1,), (1,)), ((), ()))
    rows = []

    def record(name, fn, *a):
        compiled = jax.jit(fn).lower(*a).compile()
        hlo = compiled.as_text()
        ms = median_ms(compiled, *a)
        flops = 2.0 * m * k * n
        row = {"name": name, "ms": ms, "tflops": flops / ms / 1e9, "custom_calls": custom_calls(hlo)}
        rows.append(row)
        print(f"{name:<34} {ms:8.3f} ms {row['tflops']:8.1f} TF/s  {row['custom_calls']}", flush=True)
        return hlo

    record("bf16 x bf16 -> bf16", lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16), x, w)
    xq, wq = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
    for out in (jnp.bfloat16, jnp.float32):
        record(f"e4m3 x e4m3 -> {jnp.dtype(out).name}",
               lambda a, b, out=out: jax.lax.dot_general(a, b, dims, preferred_element_type=out), xq, wq)
    record("e4m3 x e4m3 -> bf16, scaled", lambda a, b, s: (jax.lax.dot_general(
        a, b, dims, preferred_element_type=jnp.bfloat16) * s).astype(jnp.bfloat16), xq, wq, jnp.float32(0.5))
    record("quantize x in jit, e4m3 GEMM", lambda a, b: jax.lax.dot_general(
        (a * 0.5).astype(jnp.float8_e4m3fn), b, dims, preferred_element_type=jnp.bfloat16), x, wq)

    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(1), k, n))
    seam = fp8.ffn_seam()
    state = fp8.init_state(seam, [0.01, 0.01])
    seam_hlo = record("eae fp8 FFN seam forward (3 GEMMs)", lambda p, a: fp8.apply(seam, state, p, a), params, x)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_seam_forward_hlo.txt"), "w") as f:
        f.write(seam_hlo)
    with open(os.path.join(args.out, "fp8_gemm_probe.json"), "w") as f:
        json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "shape": [m, k, n], "rows": rows}, f,
                  indent=2)


if __name__ == "__main__":
    main()
