"""One PyTorch variant of the stack benchmark, in its own process (see `bench_stack.py`).

The stack is ``depth`` `eae_runtime.contrib.PreNormTransformerBlock` modules in
bf16 on CUDA (CPU in smoke runs), loaded with the same weights as the JAX
variants: the module paths map one to one onto our leaves and both sides use
torch's (out, in) layout, interleaved RoPE and RMSNorm eps 1e-6.

* T-plain: autograd over the whole stack.
* T-ckpt: ``torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)`` per block.
* T-eae: ``eae_runtime.EAERuntime(blocks, None, RuntimeConfig()).compute_gradients``.

Same READY / GO / RESULT protocol as `bench_child_jax.py`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
from bench_child_jax import _emit, _wait_for_go  # noqa: E402


def _module_param(block, torch_path: str):
    obj = block
    for part in torch_path.split("."):
        obj = getattr(obj, part)
    return obj


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t_start = time.perf_counter()
    cfg = bc.StackConfig(**spec["config"])
    variant = bc.VARIANTS[spec["variant"]]
    workdir = spec["workdir"]
    try:
        import torch
        import torch.utils.checkpoint as tckpt
        from eae_runtime import EAERuntime, RuntimeConfig
        from eae_runtime.contrib import PreNormTransformerBlock
    except ImportError as err:
        _emit("SKIP", {"status": "skipped", "error": f"torch / eae_runtime not importable: {err}"})
        return
    if spec.get("inject") == "raise":
        raise RuntimeError("injected failure (testing the parent's error path)")

    cuda = torch.cuda.is_available()
    if spec.get("require_gpu") and not cuda:
        raise RuntimeError("full-size run needs CUDA; torch.cuda.is_available() is False")
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = torch.bfloat16
    bits = bc.load_weight_bits(workdir, cfg)

    def from_bits(b):
        t = torch.from_numpy(np.ascontiguousarray(b).view(np.int16)).view(bf16)
        return t.to(device)

    blocks = torch.nn.ModuleList()
    with torch.no_grad():
        for i in range(cfg.depth):
            with torch.device(device):  # build on the device: no multi-GB CPU init for deep stacks
                blk = PreNormTransformerBlock(dim=cfg.dim, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads,
                                              max_seq_len=max(4096, cfg.seq), ffn_hidden_dim=cfg.ffn, norm_eps=1e-6)
            blk = blk.to(bf16)
            for name, tpath in bc.LEAVES:
                p = _module_param(blk, tpath)
                src = from_bits(bits[name][i])
                if tuple(p.shape) != tuple(src.shape):
                    raise ValueError(f"{tpath}: module shape {tuple(p.shape)} != weight {tuple(src.shape)}")
                p.copy_(src)
            blocks.append(blk)
    n_params = sum(p.numel() for p in blocks.parameters())
    if n_params != cfg.param_count():
        raise ValueError(f"torch stack has {n_params} params, the config {cfg.param_count()}")
    xb, yb = bc.load_input_bits(workdir, cfg)
    x, y = from_bits(xb), from_bits(yb)
    yf = y.float()

    def loss_fn(out):
        d = out.float() - yf
        return 0.5 * (d * d).mean()

    mode = variant["mode"]
    params = list(blocks.parameters())
    runtime = EAERuntime(blocks, None, RuntimeConfig()) if mode == "eae" else None

    def step():
        if mode == "eae":
            loss, grads = runtime.compute_gradients(x, loss_fn)
            return loss, grads
        for p in params:
            p.grad = None
        h = x
        for blk in blocks:
            h = tckpt.checkpoint(blk, h, use_reentrant=False) if mode == "ckpt" else blk(h)
        loss = loss_fn(h)
        loss.backward()
        return loss.detach(), None

    def sync():
        if cuda:
            torch.cuda.synchronize()

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # peak from here on: params + inputs + the steps
    prep_s = time.perf_counter() - t_start
    _wait_for_go(spec)

    times = []
    out = None
    for i in range(spec["warmup"] + spec["steps"]):
        out = None
        t0 = time.perf_counter()
        out = step()
        sync()
        dt = time.perf_counter() - t0
        if i >= spec["warmup"]:
            times.append(dt)
    result = {"status": "ok", "prep_s": prep_s, **bc.summarize_times(times)}
    if cuda:
        result["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        result["bytes_in_use_after"] = int(torch.cuda.memory_allocated())
        result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    loss, grad_dict = out
    result["loss"] = float(loss)

    def grad_of(p):
        return grad_dict[p] if grad_dict is not None else p.grad

    ref = bc.load_reference(workdir, cfg)
    if ref is None:
        result["grad_reference"] = "missing (J-plain did not run or failed)"
    else:
        meta, arrays = ref
        per_leaf = {}
        with torch.no_grad():
            for name, tpath in bc.LEAVES:
                g = torch.stack([grad_of(_module_param(blk, tpath)) for blk in blocks]).float()
                r = arrays[name]
                if meta["dtypes"][name] == "bf16bits":
                    rd = from_bits(r).float()
                else:
                    rd = torch.from_numpy(np.ascontiguousarray(r)).to(device).float()
                diff = g - rd
                per_leaf[name] = (float((diff * diff).sum()), float((rd * rd).sum()))
                del g, rd, diff
        result.update(bc.combine_rel_err(per_leaf))
        result["loss_ref"] = meta["loss"]
        result["grad_reference"] = "J-plain"
    _emit("RESULT", result)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except SystemExit:
        raise
    except BaseException as err:
        traceback.print_exc()
        _emit("ERROR", {"status": "error", "error": f"{type(err).__name__}: {str(err)[:2000]}"})
        sys.exit(1)
