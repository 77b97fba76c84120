"""Per-channel vs per-tensor fp8 weight scales on real trained weights: gate cosines.

    python experiments/fp8_weight_scaling.py [--model PATH] [--tokens 256] [--out PATH]

Loads the stories260K llama2.c checkpoint (``../shared/models/stories260K.bin``
or ``--model``; exits 2 with a message when it is absent), generates a
greedy continuation from BOS (real text-like tokens), embeds it, and binds
the qkv, o and FFN fp8 seams of every layer (`eae_jax.fp8.bind_block`, the
gate off so both records are complete) once with per-channel weight scales
(``weight='channel'``) and once with per-tensor ones (``'tensor'`` in the
JSON: ``weight='delayed'``, whose scales start from each weight's own amax,
``amax / 448``). Each layer is calibrated on what the
high-precision stack feeds it. Prints, per seam, the worst cosine against
the high-precision seam at the block boundary (residual included: what the
parity gate checks) and on the bare seam output, and the spread of the
weights' row magnitudes (max / median row amax, in binades), which is what
per-channel scales resolve and per-tensor ones do not. Writes
``experiments/results/fp8_weight_scaling.json``. Runs on CPU in about a
minute (XLA emulates fp8 exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
DEFAULT_MODEL = os.path.join(HERE, "..", "..", "shared", "models", "stories260K.bin")
SEAM_WEIGHTS = {"qkv": ("wq", "wk", "wv"), "o": ("wo",), "ffn": ("w_gate", "w_up", "w_down")}


def _row_spread_binades(w: np.ndarray) -> float:
    """log2(max row amax / median row amax) of one ``(N, K)`` weight."""
    rows = np.abs(w).max(axis=1)
    return float(np.log2(rows.max() / np.median(rows)))


def _weights(blocks: dict, names) -> dict:
    """The ``(depth, N, K)`` arrays of a seam's weights wherever the block keeps them."""
    found = {}
    for sub in blocks.values():
        if isinstance(sub, dict):
            found.update({n: np.asarray(sub[n], np.float32) for n in names if n in sub})
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("STORIES260K", DEFAULT_MODEL))
    ap.add_argument("--tokens", type=int, default=256, help="calibration sequence length (greedy continuation)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fp8_weight_scaling.json"))
    args = ap.parse_args(argv)
    if not os.path.isfile(args.model):
        print(f"stories260K checkpoint not found at {args.model} (set --model or STORIES260K)", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp

    from eae_jax import fp8
    from eae_jax.models.llama import embed
    from interop.generate import greedy_generate_jax
    from interop.llama2c import load_llama2c_bin

    imported = load_llama2c_bin(args.model)
    cfg, params = imported.config, imported.params
    steps = min(args.tokens, cfg.block.max_seq_len) - 1
    tokens = np.asarray(greedy_generate_jax(params, cfg, [1], steps).tokens)
    tokens = np.concatenate([[1], tokens])[None, : steps + 1]
    x0 = embed(params["embed"], jnp.asarray(tokens, jnp.int32), jnp.float32)
    print(f"stories260K: {cfg.depth} layers, dim {cfg.dim}, ffn {cfg.block.ffn_hidden_dim}; "
          f"calibration: {tokens.shape[1]} greedy tokens from BOS")

    results = {"model": os.path.basename(args.model), "tokens": int(tokens.shape[1]), "seams": {}}
    for scaling, weight in (("channel", "channel"), ("tensor", "delayed")):
        seams = fp8.block_seams(weight=weight)
        bound = fp8.bind_block(cfg.block, params["blocks"], [x0], seams, gate_cos=0.0)
        for name, cert in bound.certification.items():
            results["seams"].setdefault(name, {})[scaling] = {
                "worst_boundary_cos": float(cert["worst_cos"]),
                "worst_bare_cos": float(min(cert["bare_cos_per_layer"])),
            }
    for name, names in SEAM_WEIGHTS.items():
        ws = _weights(params["blocks"], names)
        results["seams"][name]["row_spread_binades_max"] = max(
            _row_spread_binades(w[i]) for w in ws.values() for i in range(w.shape[0]))

    print(f"\n{'seam':>5} {'weights':>18} {'row spread':>11} {'boundary cos':>26} {'bare cos':>26}")
    print(f"{'':>5} {'':>18} {'(binades)':>11} {'channel':>12} {'tensor':>13} {'channel':>12} {'tensor':>13}")
    for name, r in results["seams"].items():
        ch, te = r["channel"], r["tensor"]
        print(f"{name:>5} {','.join(SEAM_WEIGHTS[name]):>18} {r['row_spread_binades_max']:>11.2f} "
              f"{ch['worst_boundary_cos']:>12.6f} {te['worst_boundary_cos']:>13.6f} "
              f"{ch['worst_bare_cos']:>12.6f} {te['worst_bare_cos']:>13.6f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
