"""Compile time of a jitted reconstruct train step against depth.

The stack scans over stacked block params, so the traced program does not
grow with depth and neither should compile time. Prints a table and writes
experiments/results/bench_compile.json (or --out).

    python experiments/bench_compile.py [--depths 2,8,32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import eae_jax
from eae_jax.blocks import BlockConfig, decoder_block, init_stack, plain_stack


def compile_seconds(step, *args) -> float:
    """Seconds to trace, lower and compile ``jax.jit(step)`` for ``args``."""
    start = time.perf_counter()
    jax.jit(step).lower(*args).compile()
    return time.perf_counter() - start


def make_step(kind: str, cfg: BlockConfig, lr: float):
    block = decoder_block(cfg)
    tx = optax.adamw(lr)
    if kind == "reconstruct":
        stack = eae_jax.reconstruct(block)

        def forward(p, c, x):
            return stack(p, x, c)
    else:
        def forward(p, c, x):
            return plain_stack(block, p, x)

    def step(params, opt_state, carry, x, y):
        def loss_fn(p, c):
            return jnp.mean((forward(p, c, x) - y) ** 2)

        loss, (grads, g_carry) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, carry)
        updates, opt_state = tx.update(grads, opt_state, params)
        if kind == "reconstruct":
            carry, _ = stack.update(carry, g_carry, strict=False)
        return optax.apply_updates(params, updates), opt_state, carry, loss

    return step, tx, (eae_jax.reconstruct(block) if kind == "reconstruct" else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="2,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_compile.json"))
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    cfg = BlockConfig(dim=args.dim, num_heads=8, num_kv_heads=2)
    x = jnp.ones((2, 64, args.dim), jnp.float32)
    rows = []
    for kind in ("reconstruct", "plain"):
        for depth in depths:
            params = init_stack(jax.random.key(0), cfg, depth)
            times = []
            for repeat in range(args.repeats):
                # A different learning-rate constant each time gives a new
                # program, so no compilation cache can answer for it.
                step, tx, stack = make_step(kind, cfg, 1e-3 * (1 + repeat + 10 * depth))
                carry = stack.init(params, x) if stack is not None else jnp.zeros(())
                times.append(compile_seconds(step, params, tx.init(params), carry, x, x))
            rows.append({"kind": kind, "depth": depth, "compile_s_median": statistics.median(times),
                         "compile_s_all": times})
    base = {r["kind"]: r["compile_s_median"] for r in rows if r["depth"] == depths[0]}
    print(f"{'kind':<12} {'depth':>5} {'compile s (median)':>19} {'x depth ' + str(depths[0]):>12}")
    for r in rows:
        r["ratio_to_smallest"] = r["compile_s_median"] / base[r["kind"]]
        print(f"{r['kind']:<12} {r['depth']:>5} {r['compile_s_median']:>19.3f} {r['ratio_to_smallest']:>12.2f}")
    result = {"command": "python experiments/bench_compile.py " + " ".join(argv or []),
              "jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
              "dim": args.dim, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
