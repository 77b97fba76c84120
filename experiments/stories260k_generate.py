"""stories260K end to end: load the llama2.c checkpoint, generate greedily with the
JAX model, and check it against the same weights in the torch reference blocks.

    python experiments/stories260k_generate.py [--model PATH] [--steps 200] [--out PATH]

1. Import ``stories260K.bin`` (llama2.c legacy format) into eae_jax LM params.
2. Build the torch reference: ``eae_runtime.contrib.PreNormTransformerBlock``
   (norm_eps 1e-5, as the checkpoint) with a torch embedding, the seed's
   RMSNorm and the tied head (`interop.reference.SeedBlockLM`).
3. Greedy decoding from BOS (id 1) for ``--steps`` tokens on both sides;
   compare the ids token for token and the logits each id was chosen from.
4. The full parity table (`interop.parity`) on random token batches.

Prints the generated ids and the parity table and writes everything to
``experiments/results/stories260k_generate.json``. Exits 1 if the tokens
differ, the logits of the whole run disagree beyond fp32 precision
(relative error > 1e-5; the worst single step is reported too),
or the parity table fails; 2 if the checkpoint is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "..", "..", "shared", "models", "stories260K.bin")
FP32_TOL = 1e-5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("STORIES260K", DEFAULT_MODEL))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "stories260k_generate.json"))
    ap.add_argument("--parity-seq", type=int, default=32)
    args = ap.parse_args(argv)
    if not os.path.isfile(args.model):
        print(f"stories260K checkpoint not found at {args.model} (set --model or STORIES260K)", file=sys.stderr)
        return 2

    import jax

    from interop.generate import greedy_generate_jax, greedy_generate_torch
    from interop.llama2c import load_llama2c_bin
    from interop.parity import compare, run_parity, seed_lm_case
    from interop.reference import seed_lm_from_params

    imported = load_llama2c_bin(args.model)
    cfg = imported.config
    torch_model = seed_lm_from_params(imported.params, cfg)
    print(f"loaded {args.model}: {cfg.depth} layers, dim {cfg.dim}, heads {cfg.block.num_heads}/"
          f"{cfg.block.num_kv_heads} kv, ffn {cfg.block.ffn_hidden_dim}, vocab {cfg.vocab_size}, "
          f"eps {cfg.block.norm_eps}, tied {cfg.tie_embeddings}, sha256 {imported.meta['sha256'][:16]}...")

    t0 = time.perf_counter()
    jax_gen = greedy_generate_jax(imported.params, cfg, [1], args.steps)
    t_jax_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax_gen = greedy_generate_jax(imported.params, cfg, [1], args.steps)
    t_jax = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch_gen = greedy_generate_torch(torch_model, [1], args.steps)
    t_torch = time.perf_counter() - t0

    same = bool(np.array_equal(jax_gen.tokens, torch_gen.tokens))
    first_diff = None if same else int(np.argmax(jax_gen.tokens != torch_gen.tokens))
    m_abs, rel, cos = compare(jax_gen.logits, torch_gen.logits)
    per_step_rel = [compare(a, b)[1] for a, b in zip(jax_gen.logits, torch_gen.logits)]
    top2 = np.sort(torch_gen.logits, axis=-1)[:, -2:]
    margin = float(np.min(top2[:, 1] - top2[:, 0]))

    print(f"\nJAX generated ids ({args.steps} tokens from BOS):")
    print(" ".join(str(int(t)) for t in jax_gen.tokens))
    print(f"\ntokens identical to the torch reference: {same}" + ("" if same else f" (first difference at {first_diff})"))
    print(f"logits of the {args.steps} steps: max abs err {m_abs:.3e}, rel err {rel:.3e}, cosine {cos:.10f}, "
          f"worst step rel err {max(per_step_rel):.3e}; smallest top-1/top-2 gap {margin:.4f}")
    print(f"time: JAX {t_jax:.3f}s (first call incl. compile {t_jax_first:.2f}s), torch {t_torch:.3f}s\n")

    report = run_parity(seed_lm_case(torch_model, imported.params, cfg, seq=args.parity_seq),
                        info={"checkpoint": args.model})
    print(report.table())

    ok = same and rel <= FP32_TOL and report.ok
    result = {
        "checkpoint": os.path.abspath(args.model), "sha256": imported.meta["sha256"],
        "config": {"vocab_size": cfg.vocab_size, "depth": cfg.depth, "dim": cfg.dim,
                   "num_heads": cfg.block.num_heads, "num_kv_heads": cfg.block.num_kv_heads,
                   "ffn_hidden_dim": cfg.block.ffn_hidden_dim, "norm_eps": cfg.block.norm_eps,
                   "rope_style": cfg.block.rope_style, "tie_embeddings": cfg.tie_embeddings},
        "steps": args.steps, "prompt": [1],
        "jax_tokens": jax_gen.tokens.tolist(), "torch_tokens": torch_gen.tokens.tolist(),
        "tokens_identical": same, "first_difference": first_diff,
        "logits": {"max_abs_err": m_abs, "rel_err": rel, "cosine": cos, "worst_step_rel_err": max(per_step_rel),
                   "min_top1_top2_gap": margin, "tolerance": FP32_TOL},
        "timing_s": {"jax": t_jax, "jax_first_call": t_jax_first, "torch": t_torch},
        "parity": report.to_dict(),
        "versions": {"jax": jax.__version__, "torch": __import__("torch").__version__},
        "ok": bool(ok),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}; overall: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
