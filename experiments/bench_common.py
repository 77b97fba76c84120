"""Shared pieces of the stack benchmark (`bench_stack.py`): configurations,
variants, model FLOPs, the parent/child protocol, and the weight / input /
reference-gradient files that let every variant (JAX or PyTorch, each in its
own processes) run on exactly the same numbers.

This module imports only numpy, so the orchestrating parent process never
touches the accelerator.

Files (all under one work directory):

* ``data/<family>/<leaf>.npy``: one stacked param leaf, ``(max_depth, *shape)``,
  bf16 bit patterns stored as uint16. A family is one block shape
  (dim/heads/kv heads/ffn); configurations that differ only in depth share it
  and take the first ``depth`` blocks.
* ``data/<family>/inputs_b<B>_s<S>.npz``: input ``x`` and regression target
  ``y``, ``(B, S, D)`` bf16 bits.
* ``ref/<config>/<tag>/<leaf>.npy`` + ``meta.json``: the reference process's
  parameter gradients and loss: ``J-plain`` (bf16 bits) and ``f32`` (the same
  step in float32), which every variant's checking process compares with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# Dense bf16 tensor-core peak of the H100 / H200 SXM datasheets, FLOP/s (MFU's denominator).
PEAK_BF16_FLOPS = 989e12
GIB = float(1 << 30)

# Param leaves of one block, in a fixed order: (our path, torch module path).
# Our layout is torch's nn.Linear layout (out, in), so no transposes anywhere.
LEAVES: Tuple[Tuple[str, str], ...] = (
    ("attn_norm.scale", "attn_norm.weight"),
    ("attn.wq", "attn.q_proj.weight"),
    ("attn.wk", "attn.k_proj.weight"),
    ("attn.wv", "attn.v_proj.weight"),
    ("attn.wo", "attn.out_proj.weight"),
    ("ffn_norm.scale", "ffn_norm.weight"),
    ("ffn.w_gate", "ffn.gate_proj.weight"),
    ("ffn.w_up", "ffn.up_proj.weight"),
    ("ffn.w_down", "ffn.down_proj.weight"),
)


@dataclasses.dataclass(frozen=True)
class StackConfig:
    """One benchmarked stack: a LLaMA-style pre-norm block repeated ``depth`` times."""

    name: str
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    depth: int
    batch: int
    seq: int

    def __post_init__(self):
        if self.dim % self.heads or self.heads % self.kv_heads or (self.dim // self.heads) % 2:
            raise ValueError(f"bad head layout in {self}")
        if min(self.dim, self.heads, self.kv_heads, self.ffn, self.depth, self.batch, self.seq) < 1:
            raise ValueError(f"all sizes must be positive: {self}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def family(self) -> str:
        return f"d{self.dim}_h{self.heads}_kv{self.kv_heads}_f{self.ffn}"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def leaf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Per-block shape of every param leaf (torch layout: (out, in))."""
        d, h, kv, hd, f = self.dim, self.heads, self.kv_heads, self.head_dim, self.ffn
        return {
            "attn_norm.scale": (d,), "attn.wq": (h * hd, d), "attn.wk": (kv * hd, d), "attn.wv": (kv * hd, d),
            "attn.wo": (d, h * hd), "ffn_norm.scale": (d,), "ffn.w_gate": (f, d), "ffn.w_up": (f, d),
            "ffn.w_down": (d, f),
        }

    def matmul_params_per_block(self) -> int:
        d, kv, hd, f = self.dim, self.kv_heads, self.head_dim, self.ffn
        return d * d + 2 * d * kv * hd + d * d + 3 * d * f

    def params_per_block(self) -> int:
        return self.matmul_params_per_block() + 2 * self.dim

    def param_count(self) -> int:
        return self.params_per_block() * self.depth

    def boundary_bytes(self, itemsize: int = 2) -> int:
        """Bytes of one block boundary x_i, (B, S, D)."""
        return self.batch * self.seq * self.dim * itemsize

    def model_flops(self) -> float:
        """Model FLOPs of one forward + backward step (no recomputation counted).

        ``6 * N * tokens + 6 * B * S^2 * D * depth``: N counts the matmul
        weights (norm gains are negligible); the second term is causal
        attention, QK^T and PV at 2 FLOPs per multiply-add, half the S x S
        square masked, times 3 for forward + backward. Equal to
        ``3 * tokens * depth * BlockConfig.block_flops_per_token(S)``.
        """
        n = self.matmul_params_per_block() * self.depth
        attn = 6.0 * self.batch * self.seq * self.seq * self.dim * self.depth
        return 6.0 * n * self.tokens + attn


# ---------------------------------------------------------------------------- configurations
def configs(smoke: bool, sweep_depths: Optional[Sequence[int]] = None) -> Dict[str, List[StackConfig]]:
    """Named groups of stack configurations: ``medium``, ``deep``, ``sweep``."""
    if smoke:
        med = StackConfig("medium", dim=64, heads=4, kv_heads=2, ffn=128, depth=3, batch=2, seq=32)
        sweep_base = StackConfig("sweep", dim=32, heads=4, kv_heads=2, ffn=64, depth=1, batch=2, seq=16)
        depths = list(sweep_depths or (1, 2, 4))
        deep_depth = 6
    else:
        med = StackConfig("medium", dim=2048, heads=16, kv_heads=4, ffn=5632, depth=16, batch=4, seq=2048)
        # The sweep keeps tokens and head_dim 128 but halves the width, so depth 64 fits comfortably.
        sweep_base = StackConfig("sweep", dim=1024, heads=8, kv_heads=2, ffn=2816, depth=1, batch=4, seq=2048)
        depths = list(sweep_depths or (8, 16, 32, 64))
        deep_depth = 48
    return {
        "medium": [med],
        "deep": [dataclasses.replace(med, name="deep", depth=deep_depth)],
        "sweep": [dataclasses.replace(sweep_base, name=f"sweep-d{d}", depth=d) for d in depths],
    }


# ---------------------------------------------------------------------------- variants
# kind: which child runs it. JAX modes: plain / remat / eae with options;
# torch modes: `bench_torch.MODES`.
VARIANTS: Dict[str, dict] = {
    "J-plain": {"kind": "jax", "mode": "plain",
                "doc": "jax.value_and_grad over the scanned stack, every internal kept"},
    "J-remat": {"kind": "jax", "mode": "remat", "policy": "nothing_saveable", "prevent_cse": True,
                "doc": "jax.checkpoint(block, nothing_saveable) inside the scan (prevent_cse=True, the default)"},
    "J-remat-nocse": {"kind": "jax", "mode": "remat", "policy": "nothing_saveable", "prevent_cse": False,
                      "doc": "J-remat with prevent_cse=False (the scan already keeps XLA from merging the "
                             "recomputation into the forward)"},
    "J-remat-dots": {"kind": "jax", "mode": "remat", "policy": "dots_with_no_batch_dims_saveable",
                     "prevent_cse": True,
                     "doc": "jax.checkpoint(block, dots_with_no_batch_dims_saveable) inside the scan"},
    "eae": {"kind": "jax", "mode": "eae", "doc": "reconstruct, boundaries only, no passes"},
    "eae-sep": {"kind": "jax", "mode": "eae", "boundaries_in_grads": False,
                "doc": "diagnostic: eae with the boundaries stored apart from the gradient buffers "
                       "(boundaries_in_grads=False), to show what storing them in the gradient slots saves"},
    "eae-passes": {"kind": "jax", "mode": "eae", "passes": True,
                   "doc": "reconstruct + chain(int8_fake_quant(), clip_by_norm(1.0))"},
    # The mp pair keeps its boundaries apart from the gradient buffers: stored
    # in the gradient slots, boundaries of any dtype cost nothing extra, and
    # the pair is there to show what boundary_dtype saves where they do cost.
    "eae-mp-f32b": {"kind": "jax", "mode": "eae", "mp": True, "boundaries_in_grads": False,
                    "doc": "fp32 params + fp32 residual stream, bf16 matmuls/attention; fp32 boundaries "
                           "(kept apart from the gradient buffers)"},
    "eae-mp-bf16b": {"kind": "jax", "mode": "eae", "mp": True, "boundary_dtype": "bfloat16",
                     "boundaries_in_grads": False,
                     "doc": "same fp32-master model, boundaries stored in bf16 (boundary_dtype), kept apart "
                            "from the gradient buffers"},
    "eae-offload": {"kind": "jax", "mode": "eae", "offload": True,
                    "doc": "reconstruct, boundaries in pinned host memory (the scan schedule: each backward "
                           "iteration copies its own boundary back)"},
    "eae-offload-unrolled": {"kind": "jax", "mode": "eae", "offload": "unrolled",
                             "doc": "eae-offload with the scanned run unrolled block by block: each boundary "
                                    "its own host array, each copy an independent transfer"},
    "eae-dots": {"kind": "jax", "mode": "eae", "policy": "dots",
                 "doc": "reconstruct, policy='dots': also keep weight-matmul outputs"},
    "T-plain": {"kind": "torch", "mode": "plain", "doc": "PyTorch autograd over the stack (bf16, eager)"},
    "T-ckpt": {"kind": "torch", "mode": "ckpt", "doc": "torch.utils.checkpoint per block (non-reentrant), eager"},
    "T-compile": {"kind": "torch", "mode": "compile",
                  "doc": "torch.compile of each block (fullgraph, inductor, default mode), autograd over the stack"},
    "T-compile-ckpt": {"kind": "torch", "mode": "compile-ckpt",
                       "doc": "torch.compile of each block wrapped in torch.utils.checkpoint"},
    "T-compile-b0.1": {"kind": "torch", "mode": "compile-budget", "budget": 0.1,
                       "doc": "T-compile with torch._functorch.config.activation_memory_budget = 0.1"},
    "T-compile-b0.3": {"kind": "torch", "mode": "compile-budget", "budget": 0.3,
                       "doc": "T-compile with torch._functorch.config.activation_memory_budget = 0.3"},
    "T-compile-b0.5": {"kind": "torch", "mode": "compile-budget", "budget": 0.5,
                       "doc": "T-compile with torch._functorch.config.activation_memory_budget = 0.5"},
    "T-eae": {"kind": "torch", "mode": "eae", "doc": "eae_runtime.EAERuntime(...).compute_gradients (the seed)"},
    "T-eae-nosync": {"kind": "torch", "mode": "eae-nosync",
                     "doc": "the seed runtime with RuntimeConfig(scheduler=NoHostReadScheduler()): no per-block "
                            "host read"},
}

#: The variants every ratio of docs/benchmarks.md needs.
CAMPAIGN_VARIANTS = ["J-plain", "J-remat", "J-remat-nocse", "eae", "T-plain", "T-ckpt", "T-compile",
                     "T-compile-ckpt", "T-compile-b0.1", "T-compile-b0.3", "T-compile-b0.5", "T-eae",
                     "T-eae-nosync"]

DEFAULT_VARIANTS = {
    "medium": CAMPAIGN_VARIANTS,
    "deep": ["J-plain", "J-remat", "eae", "eae-passes", "eae-offload", "eae-offload-unrolled", "eae-dots",
             "T-ckpt", "T-eae"],
    "sweep": ["J-plain", "J-remat", "eae"],
}


# ---------------------------------------------------------------------------- bf16 bits
def variant(name: str) -> dict:
    """``VARIANTS[name]``, or for ``T-compile-b<fraction>`` (any fraction in (0, 1]) the
    torch.compile variant with that ``activation_memory_budget``.

    >>> variant("T-compile-b0.25")["budget"]
    0.25
    """
    if name in VARIANTS:
        return VARIANTS[name]
    if name.startswith("T-compile-b"):
        try:
            fraction = float(name[len("T-compile-b"):])
        except ValueError:
            fraction = None
        if fraction is not None and 0 < fraction <= 1:
            return {"kind": "torch", "mode": "compile-budget", "budget": fraction,
                    "doc": f"T-compile with torch._functorch.config.activation_memory_budget = {fraction:g}"}
    raise KeyError(f"unknown variant {name!r}: one of {sorted(VARIANTS)} or T-compile-b<fraction in (0, 1]>")


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 values to bf16 (nearest, ties to even); return the uint16 bit patterns."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of bf16 bit patterns."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---------------------------------------------------------------------------- weight / input files
def data_dir(workdir: str, cfg: StackConfig) -> str:
    return os.path.join(workdir, "data", cfg.family)


def inputs_path(workdir: str, cfg: StackConfig) -> str:
    return os.path.join(data_dir(workdir, cfg), f"inputs_b{cfg.batch}_s{cfg.seq}.npz")


def _leaf_seed(seed: int, leaf_index: int, layer: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, leaf_index, layer])


def _fill_layer(out: np.ndarray, leaf_index: int, layer: int, shape, seed: int, name: str) -> None:
    rng = np.random.Generator(np.random.PCG64(_leaf_seed(seed, leaf_index, layer)))
    u = rng.random(shape, dtype=np.float32) * np.float32(2.0) - np.float32(1.0)  # U(-1, 1)
    if name.endswith("scale"):
        vals = np.float32(1.0) + np.float32(0.1) * u  # gains near 1, not all equal (catches mapping errors)
    else:
        vals = u * np.float32(1.0 / math.sqrt(shape[-1]))  # torch nn.Linear default: U(+-1/sqrt(fan_in))
    out[layer] = f32_to_bf16_bits(vals)


def ensure_weights(workdir: str, cfg: StackConfig, depth: int, seed: int = 0, threads: int = 8) -> None:
    """Write (or keep) the family's stacked bf16 weights for at least ``depth`` blocks.

    Every layer's values depend only on (seed, leaf, layer), so files made
    for different depths agree on their common prefix.
    """
    d = data_dir(workdir, cfg)
    os.makedirs(d, exist_ok=True)
    meta_path = os.path.join(d, "weights.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("depth", 0) >= depth and meta.get("seed") == seed:
            return
    shapes = cfg.leaf_shapes()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for li, (name, _) in enumerate(LEAVES):
            arr = np.lib.format.open_memmap(os.path.join(d, name + ".npy"), mode="w+", dtype=np.uint16,
                                            shape=(depth,) + shapes[name])
            list(pool.map(lambda layer: _fill_layer(arr, li, layer, shapes[name], seed, name), range(depth)))
            arr.flush()
            del arr
    with open(meta_path, "w") as f:
        json.dump({"depth": depth, "seed": seed, "leaves": [n for n, _ in LEAVES], "format": "bf16 bits (uint16)"}, f)


def ensure_inputs(workdir: str, cfg: StackConfig, seed: int = 1) -> str:
    """Write (or keep) input ``x`` ~ N(0, 1) and target ``y`` ~ N(0, 1), (B, S, D) bf16 bits."""
    path = inputs_path(workdir, cfg)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, cfg.batch, cfg.seq, cfg.dim])))
        shape = (cfg.batch, cfg.seq, cfg.dim)
        x = f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))
        y = f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))
        tmp = path + ".tmp.npz"
        np.savez(tmp, x=x, y=y)
        os.replace(tmp, path)
    return path


def load_weight_bits(workdir: str, cfg: StackConfig) -> Dict[str, np.ndarray]:
    """Memory-mapped uint16 bf16 bits of each leaf, first ``cfg.depth`` blocks."""
    d = data_dir(workdir, cfg)
    out = {}
    for name, _ in LEAVES:
        arr = np.load(os.path.join(d, name + ".npy"), mmap_mode="r")
        if arr.shape[0] < cfg.depth or arr.shape[1:] != cfg.leaf_shapes()[name]:
            raise ValueError(f"weight file for {name} has shape {arr.shape}, need ({cfg.depth}, "
                             f"{cfg.leaf_shapes()[name]}) or deeper")
        out[name] = arr[: cfg.depth]
    return out


def load_input_bits(workdir: str, cfg: StackConfig) -> Tuple[np.ndarray, np.ndarray]:
    with np.load(inputs_path(workdir, cfg)) as z:
        return z["x"], z["y"]


# ---------------------------------------------------------------------------- reference gradients
def ref_dir(workdir: str, cfg: StackConfig, tag: str = "J-plain") -> str:
    return os.path.join(workdir, "ref", cfg.name, tag)


def save_reference(workdir: str, cfg: StackConfig, grads: Dict[str, np.ndarray], loss: float,
                   tag: str = "J-plain") -> None:
    """Store a variant's grads: numpy arrays per leaf (bf16 given as uint16 bits, or float32)."""
    d = ref_dir(workdir, cfg, tag)
    os.makedirs(d, exist_ok=True)
    dtypes = {}
    for name, arr in grads.items():
        np.save(os.path.join(d, name + ".npy"), arr)
        dtypes[name] = "bf16bits" if arr.dtype == np.uint16 else str(arr.dtype)
    with open(os.path.join(d, "meta.json.tmp"), "w") as f:
        json.dump({"loss": loss, "dtypes": dtypes}, f)
    os.replace(os.path.join(d, "meta.json.tmp"), os.path.join(d, "meta.json"))


def load_reference(workdir: str, cfg: StackConfig, tag: str = "J-plain"):
    """``(meta, {leaf: memmapped array})`` or None when that variant wrote no reference."""
    d = ref_dir(workdir, cfg, tag)
    meta_path = os.path.join(d, "meta.json")
    if not os.path.exists(meta_path):
        return None
    with open(meta_path) as f:
        meta = json.load(f)
    arrays = {name: np.load(os.path.join(d, name + ".npy"), mmap_mode="r") for name in meta["dtypes"]}
    return meta, arrays


def combine_rel_err(per_leaf: Dict[str, Tuple[float, float]]) -> Dict[str, object]:
    """From per-leaf (sum sq diff, sum sq ref) to the global and worst-leaf relative errors."""
    num = sum(v[0] for v in per_leaf.values())
    den = sum(v[1] for v in per_leaf.values())
    rel = {k: math.sqrt(a / b) if b > 0 else (0.0 if a == 0 else float("inf")) for k, (a, b) in per_leaf.items()}
    worst = max(rel, key=rel.get) if rel else None
    return {
        "grad_rel_err": math.sqrt(num / den) if den > 0 else None,
        "grad_worst_leaf": worst,
        "grad_worst_rel_err": rel[worst] if worst else None,
        "grad_rel_err_per_leaf": rel,
    }


def summarize_times(times_s: Sequence[float]) -> Dict[str, float]:
    """Median, min, p90 and mean (ms) of one process's timed steps (seconds)."""
    t = np.sort(np.asarray(times_s, dtype=np.float64)) * 1e3
    return {
        "step_ms_median": float(np.median(t)),
        "step_ms_min": float(t[0]),
        "step_ms_p90": float(np.percentile(t, 90)),
        "step_ms_mean": float(t.mean()),
        "steps_timed": int(t.size),
    }


# ---------------------------------------------------------------------------- parent <-> child protocol
# A child compiles and loads, prints READY and waits; the parent answers GO
# when nothing else compiles or runs, or QUIT. The child prints one
# "RESULT <json>" (or ERROR / SKIP) and exits. A reference job (role "ref")
# prints its RESULT without READY: it runs while others compile.
def emit(tag: str, payload=None) -> None:
    """Print one protocol line on stdout (the parent reads stdout only)."""
    import sys

    line = tag if payload is None else f"{tag} {json.dumps(payload)}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_for_go(spec: dict) -> float:
    """Say READY, block until the parent says GO; return the time (time.time()) GO came.

    Exits the process (code 3) when the parent says anything else.
    """
    import sys
    import time

    emit("READY")
    line = sys.stdin.readline().strip()
    if line != "GO":
        sys.stderr.write(f"parent said {line!r}; exiting without measuring\n")
        sys.exit(3)
    go = time.time()
    if spec.get("inject") == "hang":
        sys.stderr.write("injected hang (testing the parent's timeout)\n")
        sys.stderr.flush()
        time.sleep(3600)
    return go


def run_child(main, spec_path: str) -> None:
    """Run a child's ``main(spec_path)``; an error goes to the parent as one ERROR line (exit 1).

    Once everything is written the process leaves without the interpreter's
    teardown, so the next process is timed sooner (the driver frees the device).
    """
    import sys
    import traceback

    try:
        main(spec_path)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except SystemExit:
        raise
    except BaseException as err:  # report, so the parent can record it in the table
        traceback.print_exc()
        emit("ERROR", {"status": "error", "error": f"{type(err).__name__}: {str(err)[:2000]}"})
        sys.exit(1)
