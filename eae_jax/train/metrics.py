"""Throughput, model FLOPs, MFU and device memory of a training run.

Model FLOPs per trained token (forward + backward, recomputation not
counted, so MFU compares runs that recompute differently on equal terms)::

    6 * N  +  6 * L * T * D

``N`` counts the matmul weights a token meets: per block the attention
projections ``2 D^2 + 2 D (kv_heads * head_dim)`` and the SwiGLU ``3 D F``,
times the depth ``L``, plus the head ``V D`` (the embedding lookup is no
matmul). ``6 L T D`` is causal attention at sequence length ``T``: QK^T and
PV, two FLOPs per multiply-add, half the ``T x T`` square masked, times 3 for
forward and backward. It is ``3 * (L * BlockConfig.block_flops_per_token(T) +
2 V D)``, the count `experiments/bench_common.py` uses.

MFU divides the model FLOP/s by the device's dense peak for the run's
compute dtype (`PEAK_TFLOPS`, matched by device kind; ``--peak-tflops``
overrides it). Without a known peak (CPUs) MFU is None: reported as n/a.
"""

from __future__ import annotations

from typing import Optional, Sequence

#: Dense peak TFLOP/s per chip by device kind (lower-case substring, first match
#: wins) and compute dtype class: datasheet numbers, without sparsity. fp32 on
#: NVIDIA GPUs is TF32 tensor-core math, XLA's default for float32 matmuls there.
PEAK_TFLOPS = (
    ("h100 pcie", {"bf16": 756.0, "fp8": 1513.0, "fp32": 378.0}),
    ("h100", {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    ("h200", {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    ("gh200", {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    ("a100", {"bf16": 312.0, "fp32": 156.0}),
    ("l4", {"bf16": 121.0, "fp8": 242.0, "fp32": 60.0}),
    ("tpu v4", {"bf16": 275.0}),
    ("tpu v5 lite", {"bf16": 197.0}),
    ("tpu v5", {"bf16": 459.0}),
    ("tpu v6", {"bf16": 918.0}),
)


def flops_per_token(lm, seq_len: int) -> float:
    """Model training FLOPs per token of ``lm`` (an `LMConfig`) at ``seq_len`` (see the module doc).

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig
      >>> from eae_jax.train.metrics import flops_per_token
      >>> lm = LMConfig(vocab_size=100, depth=2, block=BlockConfig(dim=16, num_heads=2, ffn_hidden_dim=32))
      >>> n = 2 * (4 * 16 * 16 + 3 * 16 * 32) + 100 * 16        # matmul weights: blocks and head
      >>> flops_per_token(lm, seq_len=8) == 6 * n + 6 * 2 * 8 * 16
      True
    """
    blocks = lm.depth * lm.block.block_flops_per_token(seq_len)
    return 3.0 * (blocks + 2.0 * lm.vocab_size * lm.dim)


def dtype_class(dtype_name: str) -> str:
    """``'bf16'``, ``'fp8'`` or ``'fp32'``: the peak column of a run's ``--dtype``.

    Example:
      >>> from eae_jax.train.metrics import dtype_class
      >>> dtype_class("fp16"), dtype_class("fp8_e4m3"), dtype_class("fp32")
      ('bf16', 'fp8', 'fp32')
    """
    if dtype_name.startswith("fp8"):
        return "fp8"
    return "fp32" if dtype_name in ("fp32", "float32") else "bf16"


def peak_tflops(device_kind: str, dtype_name: str, override: Optional[float] = None) -> Optional[float]:
    """Peak TFLOP/s of one device of ``device_kind`` for ``dtype_name`` (``override`` when given);
    None when the kind is not in `PEAK_TFLOPS` (a CPU, say).

    Example:
      >>> from eae_jax.train.metrics import peak_tflops
      >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), peak_tflops("cpu", "fp32"), peak_tflops("cpu", "fp32", 0.5)
      (989.4, None, 0.5)
    """
    if override is not None:
        return float(override)
    kind = device_kind.lower()
    for name, peaks in PEAK_TFLOPS:
        if name in kind:
            return peaks.get(dtype_class(dtype_name))
    return None


def peak_memory_bytes(devices: Sequence) -> Optional[int]:
    """The largest ``peak_bytes_in_use`` of ``devices`` (`jax.Device.memory_stats`), or None
    when no device reports it (CPUs).

    Example:
      >>> import jax
      >>> from eae_jax.train.metrics import peak_memory_bytes
      >>> peak = peak_memory_bytes(jax.devices())
      >>> peak is None or peak > 0
      True
    """
    peaks = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # backends without the query raise rather than return None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def throughput(tokens: int, seconds: float, flops_token: float, peak: Optional[float], devices: int = 1) -> dict:
    """``tokens_per_s``, ``tflops`` (model TFLOP/s of all devices) and ``mfu`` (fraction of
    ``devices * peak``; None without a peak) of ``tokens`` trained in ``seconds``.

    Example:
      >>> from eae_jax.train.metrics import throughput
      >>> throughput(tokens=1000, seconds=2.0, flops_token=6e9, peak=10.0)
      {'tokens_per_s': 500.0, 'tflops': 3.0, 'mfu': 0.3}
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    per_s = tokens / seconds
    tflops = per_s * flops_token / 1e12
    return {"tokens_per_s": per_s, "tflops": tflops, "mfu": None if peak is None else tflops / (peak * devices)}


def format_bytes(n: Optional[int]) -> str:
    """``'1.5 GiB'``-style text; ``'n/a'`` for None.

    Example:
      >>> from eae_jax.train.metrics import format_bytes
      >>> format_bytes(3 * 2**29), format_bytes(None)
      ('1.5 GiB', 'n/a')
    """
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
