"""fp8 seams: calibrated scales, a parity gate, guards with counted fallbacks.

Modules: `quant` (scales, `fp8_linear` and its weight sources), `state`
(`Recipe`, `Guard`, `Contract`, the `SeamState` and its fold), `seams` (seams
and their guarded calls), `block` (decoder blocks with seams), `bind`
(calibration and the gate). docs/fp8.md is the guide.
"""

from eae_jax.fp8.bind import BoundSeam, Certification, bind, bind_block
from eae_jax.fp8.block import (FALLBACKS, BoundBlock, block_seams, fp8_block, fp8_block_with_ledger, init_block_state,
                               policy_seams)
from eae_jax.fp8.quant import (E4M3, E5M2, CastWeight, FrozenWeight, LiveWeight, cast_weight, dequantize,
                               fp8_linear, fp8_matmul, fp8_max, linear_observer, quantize, quantize_weight,
                               scale_from_amax)
from eae_jax.fp8.seams import (FrozenParams, Seam, apply, apply_with_ledger, cast_weights, cosine, dense_seam, ffn_seam,
                               fold_state, fp8_forward, freeze, high_precision, init_state, out_proj_seam, qkv_seam,
                               weight_scales_of)
from eae_jax.fp8.state import (ACTIVATION_SCALINGS, GRAD_SCALINGS, REASONS, WEIGHT_SCALINGS, CastWeights, Contract,
                               Fp8FallbackWarning, GateRefused, Guard, GuardRefused, Ledger, LedgerMonitor, Observed,
                               Recipe, SeamState, report)

__all__ = [
    "ACTIVATION_SCALINGS", "BoundBlock", "BoundSeam", "CastWeight", "CastWeights", "Certification", "Contract", "E4M3",
    "E5M2", "FALLBACKS", "Fp8FallbackWarning", "FrozenParams", "FrozenWeight", "GRAD_SCALINGS", "GateRefused",
    "Guard", "GuardRefused", "Ledger", "LedgerMonitor", "LiveWeight", "Observed", "REASONS", "Recipe", "Seam",
    "SeamState", "WEIGHT_SCALINGS", "apply", "apply_with_ledger", "bind", "bind_block", "block_seams", "cast_weight",
    "cast_weights", "cosine", "dense_seam", "dequantize", "ffn_seam", "fold_state", "fp8_block",
    "fp8_block_with_ledger", "fp8_forward", "fp8_linear", "fp8_matmul", "fp8_max", "freeze", "high_precision",
    "init_block_state", "init_state", "linear_observer", "out_proj_seam", "policy_seams", "qkv_seam", "quantize",
    "quantize_weight", "report", "scale_from_amax", "weight_scales_of",
]
