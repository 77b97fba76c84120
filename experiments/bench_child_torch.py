"""One PyTorch process of the stack benchmark (see `bench_stack.py`).

The stack is ``depth`` `bench_torch.SdpaGqaBlock` modules in bf16 on CUDA
(CPU in smoke runs), loaded with the same weights as the JAX variants: the
module paths map one to one onto our leaves, both sides use torch's
(out, in) layout, interleaved RoPE and RMSNorm eps 1e-6. The step of each
variant is `bench_torch.make_step`; every attention call runs on the pinned
SDPA backend (``spec['sdpa_backend']``), which the result records.

Compiled variants compile during preparation (one untimed step), after which
the allocator's cache is emptied and its peaks reset, so the timed steps
measure the step's own peak and pool. Protocol: `bench_common.wait_for_go`.

Usage: ``python bench_child_torch.py SPEC.json`` (written by the parent).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402


def _count_host_syncs(torch, step):
    """One step with ``torch.cuda.set_sync_debug_mode('warn')``: the number of
    synchronizing CUDA calls it made, and its output."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught), out


def _flash_impl() -> str:
    """Which FlashAttention the FLASH backend runs (torch's registry, where it has one)."""
    import torch.nn.attention as attention

    current = getattr(attention, "current_flash_attention_impl", None)
    if current is None:
        return "built-in (this torch has no flash implementation registry)"
    return current() or "built-in (FlashAttention-2)"


def _memory(torch) -> dict:
    stats = torch.cuda.memory_stats()
    return {
        "peak_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        "bytes_in_use_after": int(torch.cuda.memory_allocated()),
        "reserved_after": int(torch.cuda.memory_reserved()),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "pool_name": "torch.cuda.max_memory_reserved (caching allocator)",
    }


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t_start = time.perf_counter()
    cfg = bc.StackConfig(**spec["config"])
    variant = bc.variant(spec["variant"])
    workdir = spec["workdir"]
    try:
        import torch

        import bench_torch as bt
    except ImportError as err:
        bc.emit("SKIP", {"status": "skipped", "error": f"torch / eae_runtime not importable: {err}"})
        return
    if spec.get("inject") == "raise":
        raise RuntimeError("injected failure (testing the parent's error path)")
    if spec.get("inject") == "oom":
        raise RuntimeError("RESOURCE_EXHAUSTED: injected out of memory (testing the parent's retry)")

    cuda = torch.cuda.is_available()
    if spec.get("require_gpu") and not cuda:
        raise RuntimeError("full-size run needs CUDA; torch.cuda.is_available() is False")
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = torch.bfloat16
    backend = spec.get("sdpa_backend")
    bits = bc.load_weight_bits(workdir, cfg)

    def from_bits(b):
        return torch.from_numpy(np.ascontiguousarray(b).view(np.int16)).view(bf16).to(device)

    shape = {"dim": cfg.dim, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "depth": cfg.depth}
    blocks = bt.build_blocks(shape, lambda name, i: from_bits(bits[name][i]), bc.LEAVES, cfg.seq, device, bf16,
                             expand_kv=variant["mode"] == "compile-budget")
    n_params = sum(p.numel() for p in blocks.parameters())
    if n_params != cfg.param_count():
        raise ValueError(f"torch stack has {n_params} params, the config {cfg.param_count()}")
    xb, yb = bc.load_input_bits(workdir, cfg)
    x, y = from_bits(xb), from_bits(yb)
    mode = variant["mode"]
    step = bt.make_step(blocks, mode, x, y, backend=backend, budget=variant.get("budget"))
    params = list(blocks.parameters())

    def sync():
        if cuda:
            torch.cuda.synchronize()

    result = {"status": "ok", "sdpa_backend": backend, "torch_mode": mode, "flash_attention_impl": _flash_impl(),
              # cuBLAS may reduce bf16 GEMM partial sums in bf16 when this is on (torch's default)
              "bf16_reduced_precision_reduction": bool(
                  torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)}
    if mode.startswith("compile"):
        from torch._dynamo.utils import counters

        t0 = time.perf_counter()
        out = step()  # torch.compile compiles on the first forward and the first backward
        sync()
        result["compile_s"] = time.perf_counter() - t0
        result["dynamo_stats"] = {k: int(v) for k, v in counters["stats"].items()}
        result["graph_breaks"] = int(sum(counters["graph_break"].values()))
        if mode == "compile-budget":
            import torch._functorch.config as functorch_config

            result["activation_memory_budget"] = float(functorch_config.activation_memory_budget)
        del out
        for p in params:
            p.grad = None
    sync()
    if cuda:
        torch.cuda.empty_cache()  # the pool from here on is the timed steps' own
        torch.cuda.reset_peak_memory_stats()
        result["bytes_in_use_before_steps"] = int(torch.cuda.memory_allocated())
    result["prep_s"] = time.perf_counter() - t_start
    result["go_at"] = bc.wait_for_go(spec)

    times, warm = [], []
    out = None
    for i in range(spec["warmup"] + spec["steps"]):
        out = None
        if i == spec["warmup"]:
            timed_from = time.time()
        t0 = time.perf_counter()
        out = step()
        sync()
        (warm if i < spec["warmup"] else times).append(time.perf_counter() - t0)
    result.update(bc.summarize_times(times))
    result.update(times_ms=[t * 1e3 for t in times], warmup_ms=[t * 1e3 for t in warm],
                  timed_window=[timed_from, time.time()])
    if cuda:
        result.update(_memory(torch))
    result["loss"] = float(out[0])
    if cuda:  # after the peaks were read; the step's gradients serve the check below
        out = None
        result["host_syncs_per_step"], out = _count_host_syncs(torch, step)
    grad_dict = out[1]
    if spec.get("check"):
        result.update(_check(torch, bt, blocks, grad_dict, x, workdir, cfg, from_bits, backend, device))
    bc.emit("RESULT", result)


def _check(torch, bt, blocks, grad_dict, x, workdir, cfg, from_bits, backend, device) -> dict:
    """Gradients against J-plain's and the float32 step's; block 0 against
    the seed's reference block (same weights, its repeated-K/V attention)."""
    from eae_runtime.contrib import PreNormTransformerBlock

    out = {}

    def grad_of(p):
        return grad_dict[p] if grad_dict is not None else p.grad

    for tag, key in (("J-plain", ""), ("f32", "_vs_f32")):
        ref = bc.load_reference(workdir, cfg, tag)
        if ref is None:
            out["grad_reference" + key] = f"missing ({tag} reference not written)"
            continue
        meta, arrays = ref
        per_leaf = {}
        with torch.no_grad():
            for name, tpath in bc.LEAVES:
                g = torch.stack([grad_of(bt.module_param(blk, tpath)) for blk in blocks]).float()
                r = arrays[name]
                rd = (from_bits(r) if meta["dtypes"][name] == "bf16bits"
                      else torch.from_numpy(np.ascontiguousarray(r)).to(device)).float()
                diff = g - rd
                per_leaf[name] = (float((diff * diff).sum()), float((rd * rd).sum()))
                del g, rd, diff
        cmp = bc.combine_rel_err(per_leaf)
        if tag == "J-plain":
            out.update(cmp)
            out["loss_ref"] = meta["loss"]
            out["grad_reference"] = "J-plain"
        else:
            out["grad_rel_err_vs_f32"] = cmp["grad_rel_err"]
            out["grad_worst_rel_err_vs_f32"] = [cmp["grad_worst_leaf"], cmp["grad_worst_rel_err"]]
    with torch.no_grad(), torch.device(device):
        ref_block = PreNormTransformerBlock(cfg.dim, cfg.heads, num_kv_heads=cfg.kv_heads,
                                            max_seq_len=max(4096, cfg.seq), ffn_hidden_dim=cfg.ffn,
                                            norm_eps=1e-6).to(torch.bfloat16)
        ref_block.load_state_dict(blocks[0].state_dict(), strict=True)
        with bt.pinned_attention(backend):
            ours = blocks[0](x).float()
        theirs = ref_block(x).float()
        out["block0_vs_seed_block_rel_err"] = float((ours - theirs).norm() / theirs.norm())
    return out


if __name__ == "__main__":
    bc.run_child(main, sys.argv[1])
