"""KV-cached decoding against the recomputing greedy loop, on CPU.

    python experiments/generate_speed.py [--model stories260K.bin tiny] [--steps 256] [--repeats 7] [--out PATH]

Both generate ``--steps`` greedy tokens from BOS with the same weights:

* ``recompute``: `interop.generate.greedy_generate_jax`, one jitted
  ``fori_loop`` that reruns the whole fixed-length sequence through the model
  for every token;
* ``kv-cache``: `eae_jax.models.generate`, a prefill then one jitted decode
  step per token over a preallocated KV cache, each id read on the host as
  it is decoded (what ``eae-jax generate`` streams).

The models (``--model``): llama2.c ``.bin`` files and ``tiny``, the training
``tiny`` preset's shape with random weights (RoPE table long enough for the
run); by default ``../shared/models/stories260K.bin`` beside the checkout
when present, then ``tiny``. Each path runs once to compile, then ``--repeats`` timed runs,
the two paths alternating so that a busy machine slows both alike; the
speedup is the ratio of the fastest runs (the median ratio is shown too: on a
shared CPU the many small ops of a decode step suffer more from preemption
than the recomputing loop's few large ones). The tokens of both paths must
agree, else exit 1. Writes ``experiments/results/generate_speed.json`` with
the command line and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "..", "..", "shared", "models", "stories260K.bin")


def load(model: str, steps: int):
    """``(params, LMConfig, name)`` of the benchmarked model."""
    import jax

    if model != "tiny":
        from interop.llama2c import load_llama2c_bin

        imported = load_llama2c_bin(model)
        return imported.params, imported.config, os.path.basename(model)
    from eae_jax.blocks import BlockConfig
    from eae_jax.models import LMConfig, init_lm
    from eae_jax.train import PRESETS

    p = PRESETS["tiny"]
    block = BlockConfig(dim=p["dim"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                        ffn_hidden_dim=p["ffn_hidden_dim"], max_seq_len=max(steps + 1, 16))
    cfg = LMConfig(vocab_size=p["vocab_size"], depth=p["depth"], block=block)
    return init_lm(jax.random.key(0), cfg), cfg, "tiny preset (random weights)"


def timed(fns: dict, repeats: int):
    """``{name: (first call s, [timed calls s], result)}``; first calls compile, then the calls alternate."""
    out = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        result = fn()
        out[name] = (time.perf_counter() - t0, [], result)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[name][1].append(time.perf_counter() - t0)
    return out


def measure(model: str, steps: int, repeats: int) -> dict:
    """Time both paths on one model; print its table; return its record."""
    import jax
    import numpy as np

    from eae_jax.models import generate
    from interop.generate import greedy_generate_jax

    params, cfg, name = load(model, steps)
    prompt = [1]
    runs = timed({"recompute": lambda: greedy_generate_jax(params, cfg, prompt, steps),
                  "kv-cache": lambda: generate(params, cfg, prompt, steps)}, repeats)
    same = bool(np.array_equal(runs["recompute"][2].tokens, runs["kv-cache"][2].tokens))
    rows = {}
    for label, (first, times, _) in runs.items():
        best, med = min(times), statistics.median(times)
        rows[label] = {"first_call_s": first, "times_s": times, "min_s": best, "median_s": med,
                       "tokens_per_s": steps / best}
    speedup = rows["recompute"]["min_s"] / rows["kv-cache"]["min_s"]
    speedup_median = rows["recompute"]["median_s"] / rows["kv-cache"]["median_s"]
    load_average = os.getloadavg()[0]
    print(f"\n{name}: depth {cfg.depth}, dim {cfg.dim}, heads {cfg.block.num_heads}/{cfg.block.num_kv_heads}, "
          f"vocab {cfg.vocab_size}; {steps} greedy tokens from BOS, CPU ({jax.devices()[0].device_kind}), "
          f"{repeats} alternating runs each, load average {load_average:.1f} on {os.cpu_count()} cores\n")
    print("| path | first call (compile incl.) s | fastest s | median s | tokens/s (fastest) |")
    print("| --- | --- | --- | --- | --- |")
    for label, row in rows.items():
        print(f"| {label} | {row['first_call_s']:.2f} | {row['min_s']:.3f} | {row['median_s']:.3f} | "
              f"{row['tokens_per_s']:.0f} |")
    print(f"\nspeedup: {speedup:.1f}x (fastest runs), {speedup_median:.1f}x (medians); tokens identical: {same}")
    return {"model": name, "model_path": None if model == "tiny" else os.path.abspath(model),
            "config": {"vocab_size": cfg.vocab_size, "depth": cfg.depth, "dim": cfg.dim,
                       "num_heads": cfg.block.num_heads, "num_kv_heads": cfg.block.num_kv_heads,
                       "ffn_hidden_dim": cfg.block.ffn_hidden_dim},
            "prompt": prompt, "results": rows, "speedup": speedup, "speedup_median": speedup_median,
            "tokens_identical": same, "load_average_1min": load_average}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=None,
                    help="llama2.c .bin files and/or 'tiny' (default: stories260K when present, and tiny)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "generate_speed.json"))
    args = ap.parse_args(argv)
    models = args.model or ([DEFAULT_MODEL] if os.path.isfile(DEFAULT_MODEL) else []) + ["tiny"]
    missing = [m for m in models if m != "tiny" and not os.path.isfile(m)]
    if missing:
        print(f"model(s) {missing} not found (pass llama2.c .bin files or 'tiny')", file=sys.stderr)
        return 2

    import jax

    records = [measure(model, args.steps, args.repeats) for model in models]
    result = {
        "command": " ".join(["python", "experiments/generate_speed.py"] + list(sys.argv[1:] if argv is None else argv)),
        "steps": args.steps, "repeats": args.repeats, "models": records,
        "machine": {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                    "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0 if all(r["tokens_identical"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
