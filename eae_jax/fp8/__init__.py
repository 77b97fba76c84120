"""fp8 seams: static scales, a parity gate, guards with counted fallbacks.

Modules, one job each:

* `eae_jax.fp8.quant`: scales, quantization, the fp8 GEMM (`fp8_linear`:
  e4m3 forward, e5m2 backward, both real fp8 ``dot_general``\\ s).
* `eae_jax.fp8.seams`: seams (SwiGLU FFN, fused projections), `bind`
  (calibrate, build, gate), `BoundSeam`, `Certification`, the seam state
  (activation scales, ledger, observed gradient scales for current or
  delayed gradient scaling, delayed weight scales, weights cast to fp8
  once per step).
* `eae_jax.fp8.guards`: the trace-time contract and in-graph value checks.
* `eae_jax.fp8.ledger`: fallback counting through the VJP, `fold`,
  `report`, the host monitor (warn once, detach notice), strict mode.
* `eae_jax.fp8.block`: decoder blocks with fp8 seams, calibrated and gated
  per layer (`bind_block`), ready for `eae_jax.reconstruct`.
"""

from eae_jax.fp8.block import (
    BoundBlock,
    bind_block,
    block_seams,
    fp8_block,
    fp8_block_with_ledger,
    init_block_state,
    policy_seams,
)
from eae_jax.fp8.guards import Contract, GuardRefused
from eae_jax.fp8.ledger import REASONS, Fp8FallbackWarning, Ledger, LedgerMonitor, count, fold, init_ledger, report
from eae_jax.fp8.quant import (
    E4M3,
    E5M2,
    Fp8Weight,
    dequantize,
    fp8_linear,
    fp8_matmul,
    fp8_max,
    quantize,
    quantize_weight,
    scale_from_amax,
)
from eae_jax.fp8.seams import (
    BoundSeam,
    CastWeights,
    Certification,
    FrozenParams,
    GateRefused,
    Seam,
    SeamConfig,
    SeamState,
    apply,
    apply_with_ledger,
    bind,
    cast_weights,
    combine_observations,
    cosine,
    dense_seam,
    ffn_seam,
    fold_state,
    fp8_forward,
    high_precision,
    init_state,
    out_proj_seam,
    qkv_seam,
    require_grad_scales,
    state_report,
    weight_scales_of,
)

__all__ = [
    "BoundBlock", "BoundSeam", "CastWeights", "Certification", "Contract", "E4M3", "E5M2", "Fp8FallbackWarning",
    "Fp8Weight",
    "FrozenParams", "GateRefused", "GuardRefused", "Ledger", "LedgerMonitor", "REASONS", "Seam", "SeamConfig",
    "SeamState", "apply", "apply_with_ledger", "bind", "bind_block", "block_seams", "cast_weights", "combine_observations", "cosine",
    "count",
    "dense_seam", "dequantize", "ffn_seam", "fold", "fold_state", "fp8_block", "fp8_block_with_ledger",
    "fp8_forward", "fp8_linear", "fp8_matmul", "fp8_max", "high_precision", "init_block_state", "init_ledger",
    "init_state", "out_proj_seam", "policy_seams", "qkv_seam", "quantize", "quantize_weight", "report",
    "require_grad_scales", "scale_from_amax", "state_report", "weight_scales_of",
]
