"""The training step on one device, with and without the sharded code path.

    python experiments/bench_mesh.py --out DIR [--preset medium] [--dtype bf16] [--rounds 6] [--steps 10]
                                     [--deadline-s S]

One process builds two variants of the same ``eae-jax train`` step (AdamW,
the preset's batch, boundary-only reconstruction) on the first device:

* ``plain``: the step without a mesh: `lm_stack` and
  ``jax.jit(make_train_step(...), donate_argnums=0)`` on one device;
* ``sharded``: what ``eae-jax train`` runs, on the mesh ``data=1`` (every
  axis of size 1): `eae_jax.train.sharding.RunSharding`'s stack (the
  `eae_jax.parallel.Sharded` block storage: params gathered per block,
  gradients constrained back), the state made by one jitted call into its
  shardings, the step jitted with in/out shardings.

Both compile and take 2 warm-up steps, then ``--rounds`` rounds time
``--steps`` steps of each variant in turn (the order alternates from round
to round, so a drifting clock slows both alike), on the same token block; a
step is timed to its results being ready; no round starts past
``--deadline-s`` (two always run). Statistic: the median over rounds
of each round's median step time; the ratio sharded / plain comes with a
95% interval from `bench_stats.ratio` (rounds as the resampling units, steps
within them), ``win``/``loss`` when the interval excludes 1. Prints a table
and writes ``DIR/bench_mesh.json`` (command, device, jax version, every step
time, the ratio, the losses of both variants: the same computation).

Smoke (CPU, tiny sizes): ``python experiments/bench_mesh.py --preset tiny --dtype fp32 --depth 2
--seq-len 16 --batch 4 --rounds 2 --steps 2 --out /tmp/bench_mesh``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
VARIANTS = ("plain", "sharded")


def prepare(args) -> tuple:
    """``(steps, states, tokens, compile_s)`` of both variants, compiled."""
    import jax

    from eae_jax.models.llama import lm_stack
    from eae_jax.parallel import make_mesh
    from eae_jax.train import TrainConfig, init_state, make_optimizer, make_train_step, parse_passes
    from eae_jax.train.data import synthetic_batch
    from eae_jax.train.loop import build
    from eae_jax.train.sharding import RunSharding

    cfg = TrainConfig(preset=args.preset, dtype=args.dtype, passes=args.passes, microbatches=args.microbatches,
                      depth=args.depth, seq_len=args.seq_len, batch=args.batch)
    model = cfg.model()
    tokens = synthetic_batch(jax.random.key(1), cfg.batch, cfg.seq_len, model.vocab_size)
    tokens = tokens.reshape(cfg.microbatches, cfg.batch // cfg.microbatches, -1)
    steps, states, placed, compile_s = {}, {}, {}, {}

    # plain: the one-device step, no mesh
    stack = lm_stack(model, passes=parse_passes(cfg.passes), boundary_dtype=cfg.boundary_dtype, policy=cfg.policy,
                     offload=cfg.offload)
    tx = make_optimizer(cfg)
    states["plain"] = jax.jit(jax.tree_util.Partial(init_state, cfg, model, stack, tx))()
    placed["plain"] = jax.device_put(tokens, jax.devices()[0])
    t0 = time.perf_counter()
    steps["plain"] = jax.jit(make_train_step(cfg, stack, tx, model), donate_argnums=(0,)).lower(
        states["plain"], placed["plain"]).compile()
    compile_s["plain"] = time.perf_counter() - t0

    # sharded: the mesh path of eae-jax train, every axis of size 1
    sharding = RunSharding(cfg, model, make_mesh("data=1"))
    _, stack_s, tx_s, _, states["sharded"] = build(cfg, None, sharding=sharding)
    shard_state = sharding.state_shardings(states["sharded"], tx_s, stack_s)
    placed["sharded"] = jax.device_put(tokens, sharding.tokens_sharding())
    t0 = time.perf_counter()
    steps["sharded"] = sharding.jit_step(make_train_step(cfg, stack_s, tx_s, model, param_shardings=shard_state.params),
                                         shard_state).lower(states["sharded"], placed["sharded"]).compile()
    compile_s["sharded"] = time.perf_counter() - t0
    return steps, states, placed, compile_s


def measure(args) -> dict:
    """Compile both variants, then time them in alternating rounds; every step's time."""
    import jax
    import numpy as np

    steps, states, placed, compile_s = prepare(args)
    times = {v: [] for v in VARIANTS}
    losses = {v: [] for v in VARIANTS}
    for v in VARIANTS:  # warm up
        for _ in range(2):
            states[v], metrics = steps[v](states[v], placed[v])
            losses[v].append(float(metrics["loss"]))
    for r in range(args.rounds):
        if r >= 2 and args.deadline_s is not None and time.perf_counter() - args.t_start > args.deadline_s:
            break  # past the deadline: stop with the rounds done (two at least, for an interval)
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            times[v].append([])
            for _ in range(args.steps):
                t0 = time.perf_counter()
                states[v], metrics = steps[v](states[v], placed[v])
                jax.block_until_ready((states[v], metrics))
                times[v][-1].append(time.perf_counter() - t0)
            losses[v].append(float(metrics["loss"]))
    peak = None
    stats = jax.devices()[0].memory_stats()
    if stats:
        peak = stats.get("peak_bytes_in_use")
    return {"times": times, "losses": losses, "compile_s": compile_s, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "peak_bytes_in_use": peak,
            "median_ms": {v: 1e3 * float(np.median([np.median(t) for t in times[v]])) for v in VARIANTS}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for bench_mesh.json")
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--passes", default="")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--depth", type=int, default=None, help="override the preset's (smoke runs)")
    parser.add_argument("--seq-len", type=int, default=None, help="override the preset's (smoke runs)")
    parser.add_argument("--batch", type=int, default=None, help="override the preset's (smoke runs)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no round past this many seconds from the start (two rounds always run)")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        parser.error("--rounds must be at least 2 (an interval needs two) and --steps at least 1")
    own = list(argv if argv is not None else sys.argv[1:])
    args.t_start = t_start = time.perf_counter()
    run = measure(args)
    rounds = len(run["times"]["plain"])
    from bench_stats import ratio, seed_for, summarize, verdict

    summary = {v: summarize(run["times"][v], seed_for(v)) for v in VARIANTS}
    rel = ratio(run["times"]["sharded"], run["times"]["plain"], seed_for("sharded"), seed_for("plain"))
    print(f"\n{run['device']}, jax {run['jax']}, preset {args.preset}, dtype {args.dtype}, "
          f"{rounds} rounds x {args.steps} steps")
    print(f"| variant | step ms | 95% CI | compile s | loss after warm-up |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        s = summary[v]
        print(f"| {v} | {1e3 * s['value']:.2f} | [{1e3 * s['ci'][0]:.2f}, {1e3 * s['ci'][1]:.2f}] | "
              f"{run['compile_s'][v]:.1f} | {run['losses'][v][1]:.5f} |")
    print(f"sharded / plain = {rel['value']:.4f}  95% CI [{rel['ci'][0]:.4f}, {rel['ci'][1]:.4f}]  "
          f"({verdict(rel['ci'], higher_is_win=False)}; acceptance: <= 1.01)")
    result = {"command": " ".join(["python", "experiments/bench_mesh.py", *own]), "device": run["device"],
              "jax": run["jax"], "date": time.strftime("%Y-%m-%d"),
              "args": {k: v for k, v in vars(args).items() if k != "t_start"}, "rounds_run": rounds, "summary": summary,
              "ratio_sharded_over_plain": rel, "wall_s": time.perf_counter() - t_start, **run}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_mesh.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)  # atomic: a killed run leaves no half-written result
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
