"""Where does an offloaded stack's device memory go? Compile-only.

Compiles the medium train step (see `bench_stack.py`) once per storage
schedule and prints XLA's memory analysis of each: device temp memory,
host temp memory and the async copies in the compiled program. No step
is run, so it needs little device time.

* ``sep``: boundaries on the device, apart from the gradient buffers
  (``boundaries_in_grads=False``).
* ``scan``: ``offload=True`` (the scanned schedule).
* ``unrolled``: ``offload='unrolled'``.

Every variant is a public `eae_jax.reconstruct` configuration; what the
schedules were measured to cost is in docs/benchmarks.md.

    python experiments/offload_memory_probe.py [--depth 6] [--variants unrolled,sep] [--out DIR] [--smoke]

Writes ``offload_memory_probe.json`` (and, with ``--save-hlo``, each
variant's compiled HLO, gzipped) to ``--out`` (default ``$OUT`` or
``experiments/results``). On CPU the placements compile to no-ops (no host
memory space), so only ``--smoke`` makes sense there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eae_jax  # noqa: E402
from eae_jax.blocks import BlockConfig, decoder_block, init_stack  # noqa: E402

VARIANTS: Dict[str, Dict[str, Any]] = {
    "sep": dict(offload=False, boundaries_in_grads=False),
    "scan": dict(offload=True),
    "unrolled": dict(offload="unrolled"),
}
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "host_temp_size_in_bytes")


def probe(name: str, block, params, x, save_hlo: str = "") -> Dict[str, Any]:
    """Compile one variant's train step; its memory analysis and HLO counts."""
    stack = eae_jax.reconstruct(block, **VARIANTS[name])
    state = stack.init(params, x, jax.random.key(0))

    def step(p, carry, x_):
        return jax.value_and_grad(lambda pp, cc: jnp.mean(stack(pp, x_, cc).astype(jnp.float32) ** 2),
                                  argnums=(0, 1))(p, carry)

    t = time.perf_counter()
    compiled = jax.jit(step).lower(params, state, x).compile()
    rec_ = {"variant": name, "compile_s": time.perf_counter() - t}
    ma = compiled.memory_analysis()
    for k in MEMORY_FIELDS:
        rec_[k] = int(getattr(ma, k, 0) or 0) if ma is not None else None
    hlo = compiled.as_text() or ""
    starts = re.findall(r"\s([a-z][a-z-]*-start)\(", hlo)
    rec_["host_space_S5"] = hlo.count("S(5)")
    rec_["async_starts"] = {k: starts.count(k) for k in sorted(set(starts))}
    if save_hlo:
        os.makedirs(save_hlo, exist_ok=True)
        with gzip.open(os.path.join(save_hlo, f"hlo_{name}.txt.gz"), "wt") as fh:
            fh.write(hlo)
    return rec_


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="tiny block (CPU): checks the script runs")
    ap.add_argument("--save-hlo", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        ap.error(f"--variants: unknown {unknown}; expected a comma list of {list(VARIANTS)}")
    if args.depth < 2:
        ap.error("--depth must be at least 2 (the unrolled schedule needs a boundary to prefetch)")
    out = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    if args.smoke:
        cfg, shape = BlockConfig(dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=128), (2, 16, 64)
    else:  # the medium block of bench_stack.py
        cfg = BlockConfig(dim=2048, num_heads=16, num_kv_heads=4, ffn_hidden_dim=5632, norm_eps=1e-6,
                          max_seq_len=4096)
        shape = (4, 2048, 2048)
    block = decoder_block(cfg)
    params = jax.eval_shape(lambda: jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16),
                                                           init_stack(jax.random.key(0), cfg, args.depth)))
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    boundary = x.size * 2
    results = {"backend": jax.default_backend(), "jax": jax.__version__, "depth": args.depth,
               "boundary_bytes": boundary, "runs": []}
    path = os.path.join(out, "offload_memory_probe.json")
    print(f"{'variant':<24} {'compile s':>9} {'temp MiB':>9} {'host MiB':>9} {'temp/boundary':>13}  async starts")
    for name in names:
        r = probe(name, block, params, x, out if args.save_hlo else "")
        results["runs"].append(r)
        temp = r["temp_size_in_bytes"] or 0
        print(f"{name:<24} {r['compile_s']:9.1f} {temp / 2**20:9.1f} {(r['host_temp_size_in_bytes'] or 0) / 2**20:9.1f} "
              f"{temp / boundary:13.2f}  {r['async_starts']}", flush=True)
        with open(path + ".tmp", "w") as fh:  # after every variant: a timeout keeps what ran
            json.dump(results, fh, indent=1)
        os.replace(path + ".tmp", path)
    return results


if __name__ == "__main__":
    main()
