"""Host memory of an offloaded optimizer step, with and without donating its state.

Builds bf16 params of about ``--param-gib`` GiB, an `offload_optimizer`
(AdamW, float32 master weights: 12 bytes of host state per param) and
compiles its update step twice: the params donated only, and the state
donated too with every sharding named (memory kinds included), as the
training command jits it. Prints XLA's memory analysis of both (host
argument, output, alias and temp bytes), then runs ``--steps`` steps of the
donated one and times them. On a GPU the undonated step needs the state's
host bytes twice; it is compiled, not run.

    python experiments/offload_optim_donation.py --param-gib 3.3 --steps 3 --out DIR
    python experiments/offload_optim_donation.py --smoke --out /tmp/od   # CPU, tiny

Writes ``offload_optim_donation.json`` to ``--out`` (default ``$OUT`` or
``experiments/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eae_jax.offload_optim import host_memory_kind, offload_optimizer  # noqa: E402

FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
          "host_temp_size_in_bytes")


def make_params(param_gib: float, width: int):
    """bf16 params: ``layers`` stacked ``(width, width)`` matrices, about ``param_gib`` GiB."""
    layers = max(1, int(param_gib * 2 ** 30 / (2 * width * width)))
    return {"w": jnp.zeros((layers, width, width), jnp.bfloat16) + 0.01, "b": jnp.zeros((width,), jnp.bfloat16)}


def where(tree):
    return jax.tree_util.tree_map(lambda a: a.sharding, tree)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--param-gib", type=float, default=3.3)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.param_gib, args.width, args.steps = 2e-4, 64, 2
    params = make_params(args.param_gib, args.width)
    opt = offload_optimizer(optax.adamw(1e-4), master_dtype=jnp.float32, grad_clip=1.0)
    t = time.perf_counter()
    state = opt.init(params)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t
    grads = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 1e-3), params)
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))

    rows = {}
    jitted = {
        "params donated": jax.jit(opt.apply, donate_argnums=(2,)),
        "state donated, shardings named": jax.jit(
            opt.apply, in_shardings=(where(grads), where(state), where(params)),
            out_shardings=(where(params), where(state)), donate_argnums=(1, 2)),
    }
    compiled = {}
    for name, fn in jitted.items():
        t = time.perf_counter()
        compiled[name] = fn.lower(grads, state, params).compile()
        stats = compiled[name].memory_analysis()
        rows[name] = {f: getattr(stats, f, None) for f in FIELDS}
        rows[name]["compile_s"] = time.perf_counter() - t

    name = "state donated, shardings named"
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        params, state = compiled[name](grads, state, params)
        jax.block_until_ready((params, state))
        times.append(time.perf_counter() - t)
    rows[name]["step_s"] = times

    gib = lambda b: "-" if b is None else f"{b / 2 ** 30:.3f}"  # noqa: E731
    print(f"backend {jax.default_backend()}, host memory kind {host_memory_kind()}, params {gib(param_bytes)} GiB, "
          f"optimizer state {gib(state_bytes)} GiB, init {init_s:.1f} s")
    print(f"{'step':34s} {'host arg':>9s} {'host out':>9s} {'host alias':>10s} {'host temp':>9s} "
          f"{'dev alias':>9s}  (GiB)")
    for name, r in rows.items():
        print(f"{name:34s} {gib(r['host_argument_size_in_bytes']):>9s} {gib(r['host_output_size_in_bytes']):>9s} "
              f"{gib(r['host_alias_size_in_bytes']):>10s} {gib(r['host_temp_size_in_bytes']):>9s} "
              f"{gib(r['alias_size_in_bytes']):>9s}")
    print("donated steps (s): " + " ".join(f"{s:.3f}" for s in times))
    os.makedirs(args.out, exist_ok=True)
    result = {"args": vars(args), "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "host_memory_kind": host_memory_kind(), "param_bytes": param_bytes,
              "state_bytes": state_bytes, "init_s": init_s, "rows": rows}
    path = os.path.join(args.out, "offload_optim_donation.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
