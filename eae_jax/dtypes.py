"""One dtype policy for the whole stack.

`parse_compute_dtype` turns the user-facing names (``fp32 | fp16 | bf16 |
fp8_e4m3 | fp8_e5m2``) into JAX dtypes, and `DTypePolicy` says which tensors
run in which precision. Blocks, `reconstruct` and training read the same
policy object so a model never mixes conventions by accident.

Statistics that need range (RMSNorm's mean square, softmax, the loss) always
run in float32 whatever the policy says; that is a property of the blocks,
not a policy knob.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

_NAMED_DTYPES = {
    "fp32": jnp.float32,
    "float32": jnp.float32,
    "fp16": jnp.float16,
    "float16": jnp.float16,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "float8_e5m2": jnp.float8_e5m2,
}

#: The canonical names accepted on command lines.
COMPUTE_DTYPE_NAMES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def parse_compute_dtype(name: Any) -> jnp.dtype:
    """Return the JAX dtype for a dtype name or dtype-like.

    Args:
      name: one of ``fp32 | fp16 | bf16 | fp8_e4m3 | fp8_e5m2`` (also the
        numpy spellings ``float32``, ``bfloat16``, ``float8_e4m3fn`` ...), or
        anything `jnp.dtype` accepts that is a floating dtype.

    Returns:
      A `jnp.dtype`.

    Raises:
      ValueError: the name is not a known floating dtype; the message lists
        the valid names.
    """
    if isinstance(name, str):
        key = name.strip().lower()
        if key in _NAMED_DTYPES:
            return jnp.dtype(_NAMED_DTYPES[key])
        raise ValueError(
            f"unknown dtype {name!r}; valid names are {', '.join(COMPUTE_DTYPE_NAMES)}"
        )
    if name is None:
        # jnp.dtype(None) is float64: never what a caller leaving it unset means.
        raise ValueError(f"dtype must be given; valid names are {', '.join(COMPUTE_DTYPE_NAMES)}")
    try:
        dtype = jnp.dtype(name)
    except TypeError as err:
        raise ValueError(
            f"unknown dtype {name!r}; valid names are {', '.join(COMPUTE_DTYPE_NAMES)}"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"dtype {dtype} is not a floating dtype; valid names are {', '.join(COMPUTE_DTYPE_NAMES)}"
        )
    return dtype


def _as_dtype(dtype: Any) -> jnp.dtype:
    # Names go through the parser so 'bf16' means what it does on command lines.
    return parse_compute_dtype(dtype) if isinstance(dtype, str) else jnp.dtype(dtype)


def dtype_name(dtype: Any) -> str:
    """Short canonical name of a floating dtype (``bf16``, ``fp8_e4m3`` ...)."""
    dtype = _as_dtype(dtype)
    for short in COMPUTE_DTYPE_NAMES:
        if jnp.dtype(_NAMED_DTYPES[short]) == dtype:
            return short
    return str(dtype)


def is_fp8(dtype: Any) -> bool:
    """True for the two float8 formats this library computes in (dtype or name)."""
    return _as_dtype(dtype) in FP8_DTYPES


@dataclasses.dataclass(frozen=True)
class DTypePolicy:
    """Which tensors run in which precision.

    Attributes:
      param_dtype: storage dtype of the parameters (and of their gradients).
      compute_dtype: dtype the block math runs in (params are cast to it at
        use). For fp8 policies the block runs in ``bf16`` and only the fp8
        seams (`eae_jax.fp8`) use fp8 operands: matmul inputs are quantized,
        everything else stays in ``bf16``.
      boundary_dtype: dtype the forward pass stores the block boundaries
        x0..xL in (`None`: the activation's own dtype).
      adjoint_dtype: dtype the adjoint between blocks is carried in (`None`:
        the boundary's dtype).
      fp8_format: for fp8 policies, the forward format of the seams.

    Norm statistics, softmax and the loss are always float32.
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    boundary_dtype: Optional[Any] = None
    adjoint_dtype: Optional[Any] = None
    fp8_format: Optional[Any] = None

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "boundary_dtype", "adjoint_dtype", "fp8_format"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, parse_compute_dtype(value))
        if is_fp8(self.param_dtype):
            raise ValueError("param_dtype cannot be an fp8 format; keep parameters in fp32/bf16")
        if is_fp8(self.compute_dtype):
            raise ValueError(
                "compute_dtype cannot be fp8 directly; use DTypePolicy.from_name('fp8_e4m3'), "
                "which computes in bf16 with fp8 seams"
            )

    @classmethod
    def from_name(cls, name: str, param_dtype: Any = jnp.float32) -> "DTypePolicy":
        """The policy for a ``--dtype`` value.

        ``fp32``: everything fp32. ``bf16``/``fp16``: compute and boundaries
        in that dtype, params fp32. ``fp8_e4m3``/``fp8_e5m2``: compute in
        bf16 with fp8 seams in that format.

        Raises:
          ValueError: unknown name (listing the valid ones).
        """
        dtype = parse_compute_dtype(name)
        if is_fp8(dtype):
            return cls(param_dtype=param_dtype, compute_dtype=jnp.bfloat16,
                       boundary_dtype=jnp.bfloat16, fp8_format=dtype)
        if dtype == jnp.dtype(jnp.float32):
            return cls(param_dtype=param_dtype, compute_dtype=jnp.float32)
        return cls(param_dtype=param_dtype, compute_dtype=dtype, boundary_dtype=dtype)

    def cast_params(self, params):
        """Cast every floating leaf of `params` to `compute_dtype`."""
        import jax

        def cast(leaf):
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
                return leaf.astype(self.compute_dtype)
            return leaf

        return jax.tree_util.tree_map(cast, params)


def finfo_max(dtype: Any) -> float:
    """Largest finite value of a floating dtype (or dtype name), as a Python float."""
    dtype = _as_dtype(dtype)
    return float(np.finfo(dtype).max) if not is_fp8(dtype) else float(jnp.finfo(dtype).max)
