"""The training step on one device, with and without the sharded code path.

    python experiments/bench_mesh.py [--preset medium] [--dtype bf16] [--processes 3] [--rounds 8]
                                     [--steps 10] [--out experiments/results/bench_mesh.json]

Two variants of the same ``eae-jax train`` step (AdamW, the preset's batch,
boundary-only reconstruction), on the first device:

* ``plain``: the step as it was before meshes: `lm_stack` and
  ``jax.jit(make_train_step(...), donate_argnums=0)`` on one device;
* ``sharded``: what ``eae-jax train`` runs now, on the mesh ``data=1`` (every
  axis of size 1): `eae_jax.train.sharding.RunSharding`'s stack (the
  `eae_jax.parallel.Sharded` block storage: params gathered per block,
  gradients constrained back), the state made by one jitted call into its
  shardings, the step jitted with in/out shardings.

Each of ``--processes`` fresh processes compiles both, then times
``--rounds`` alternating windows of ``--steps`` steps each (the two variants
take turns, so a drifting clock slows both alike) on the same token block;
a step is timed to its results being ready. The ratio sharded / plain of the
medians over processes of each process's median step time comes with a 95%
interval (`bench_stats.ratio`); its verdict is ``win``/``loss`` when the
interval excludes 1. Prints a table and writes the JSON (command, device,
jax version, per-process step times, the ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("plain", "sharded")


def child(args) -> dict:
    """One process: compile both variants, time alternating windows; per-step times."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    import jax
    import numpy as np

    from eae_jax.models.llama import lm_stack
    from eae_jax.parallel import make_mesh
    from eae_jax.train import TrainConfig, init_state, make_optimizer, make_train_step, parse_passes
    from eae_jax.train.data import synthetic_batch
    from eae_jax.train.loop import build
    from eae_jax.train.sharding import RunSharding

    cfg = TrainConfig(preset=args.preset, dtype=args.dtype, passes=args.passes, microbatches=args.microbatches)
    model = cfg.model()
    tokens = synthetic_batch(jax.random.key(1), cfg.batch, cfg.seq_len, model.vocab_size)
    tokens = tokens.reshape(cfg.microbatches, cfg.batch // cfg.microbatches, -1)
    steps, states, placed = {}, {}, {}

    # plain: the one-device step of before
    stack = lm_stack(model, passes=parse_passes(cfg.passes), boundary_dtype=cfg.boundary_dtype, policy=cfg.policy,
                     offload=cfg.offload)
    tx = make_optimizer(cfg)
    states["plain"] = jax.jit(jax.tree_util.Partial(init_state, cfg, model, stack, tx))()
    steps["plain"] = jax.jit(make_train_step(cfg, stack, tx, model), donate_argnums=(0,))
    placed["plain"] = jax.device_put(tokens, jax.devices()[0])

    # sharded: the mesh path of eae-jax train, every axis of size 1
    sharding = RunSharding(cfg, model, make_mesh("data=1"))
    _, stack_s, tx_s, _, states["sharded"] = build(cfg, None, sharding)
    shard_state = sharding.state_shardings(states["sharded"], tx_s, stack_s)
    steps["sharded"] = jax.jit(make_train_step(cfg, stack_s, tx_s, model, param_shardings=shard_state.params),
                               in_shardings=(shard_state, sharding.tokens_sharding()),
                               out_shardings=(shard_state, sharding.replicated()), donate_argnums=(0,))
    placed["sharded"] = jax.device_put(tokens, sharding.tokens_sharding())

    times = {v: [] for v in VARIANTS}
    losses = {}
    for v in VARIANTS:  # compile and warm up
        for _ in range(2):
            states[v], metrics = steps[v](states[v], placed[v])
        losses[v] = float(metrics["loss"])
    for _ in range(args.rounds):
        for v in VARIANTS:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                states[v], metrics = steps[v](states[v], placed[v])
                jax.block_until_ready((states[v], metrics))
                times[v].append(time.perf_counter() - t0)
    return {"times": times, "losses": losses, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "median_ms": {v: 1e3 * float(np.median(times[v])) for v in VARIANTS}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--passes", default="")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_mesh.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    own = list(argv if argv is not None else sys.argv[1:])
    runs = []
    for i in range(args.processes):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *own], capture_output=True,
                              text=True)
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"process {i}: " + ", ".join(f"{v} {runs[-1]['median_ms'][v]:.2f} ms" for v in VARIANTS), flush=True)
    sys.path.insert(0, HERE)
    from bench_stats import ratio, seed_for, summarize, verdict

    per = {v: [r["times"][v] for r in runs] for v in VARIANTS}
    summary = {v: summarize(per[v], seed_for(v)) for v in VARIANTS}
    rel = ratio(per["sharded"], per["plain"], seed_for("sharded"), seed_for("plain"))
    print(f"\n{runs[0]['device']}, jax {runs[0]['jax']}, preset {args.preset}, dtype {args.dtype}")
    print(f"{'variant':<10}{'step ms':>10}{'95% CI':>22}")
    for v in VARIANTS:
        s = summary[v]
        print(f"{v:<10}{1e3 * s['value']:>10.2f}{'[%.2f, %.2f]' % tuple(1e3 * c for c in s['ci']):>22}")
    print(f"sharded / plain = {rel['value']:.4f}  95% CI [{rel['ci'][0]:.4f}, {rel['ci'][1]:.4f}]  "
          f"({verdict(rel['ci'], higher_is_win=False)}; acceptance: <= 1.01)")
    print("losses after warm-up: " + ", ".join(f"{v} {runs[0]['losses'][v]:.5f}" for v in VARIANTS))
    result = {"command": " ".join(["python", "experiments/bench_mesh.py", *own]), "device": runs[0]["device"],
              "jax": runs[0]["jax"], "date": time.strftime("%Y-%m-%d"), "args": vars(args), "summary": summary,
              "ratio_sharded_over_plain": rel, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
