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

#: The names an fp8 format (`DTypePolicy.fp8_format`) may be given by.
FP8_FORMAT_NAMES = ("fp8_e4m3", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2")

#: The fp8 formats by short name (``e4m3``: forward operands, ``e5m2``:
#: gradients): the one table `eae_jax.fp8` and the ``fp8_quant`` pass read.
FP8_FORMATS = {"e4m3": FP8_DTYPES[0], "e5m2": FP8_DTYPES[1]}


def fp8_dtype(fmt: Any) -> jnp.dtype:
    """The fp8 format ``fmt`` names: a key of `FP8_FORMATS`, one of
    `FP8_FORMAT_NAMES`, or one of `FP8_DTYPES`.

    >>> fp8_dtype("e5m2") == jnp.float8_e5m2
    True

    Raises:
      ValueError: anything else (the message lists the names).
    """
    if isinstance(fmt, str) and fmt.strip().lower() in FP8_FORMATS:
        return FP8_FORMATS[fmt.strip().lower()]
    try:
        dtype = parse_compute_dtype(fmt) if isinstance(fmt, str) else jnp.dtype(fmt)
    except (TypeError, ValueError):
        dtype = None
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{fmt!r} is not an fp8 format; expected one of "
                         f"{', '.join(tuple(FP8_FORMATS) + FP8_FORMAT_NAMES)}")
    return dtype


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

    Example:
      >>> from eae_jax.dtypes import parse_compute_dtype
      >>> parse_compute_dtype("bf16"), parse_compute_dtype("float32")
      (dtype(bfloat16), dtype('float32'))
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


def _as_dtype(dtype: Any, what: str = "dtype") -> jnp.dtype:
    """``dtype`` as a `jnp.dtype`; names go through `parse_compute_dtype` so
    'bf16' means what it does on command lines.

    Raises:
      ValueError: ``dtype`` is None (`jnp.dtype(None)` would silently be
        float64), an unknown name, or not a dtype-like at all.
    """
    if dtype is None:
        raise ValueError(f"{what}: a dtype must be given, got None; valid names are {', '.join(COMPUTE_DTYPE_NAMES)}")
    if isinstance(dtype, str):
        return parse_compute_dtype(dtype)
    try:
        return jnp.dtype(dtype)
    except TypeError as err:
        raise ValueError(
            f"{what}: unknown dtype {dtype!r}; valid names are {', '.join(COMPUTE_DTYPE_NAMES)}"
        ) from err


def _is_narrow_float(dtype: jnp.dtype) -> bool:
    """Every float of 8 bits or fewer: the two fp8 formats this library
    computes in, the other float8 variants (``float8_e4m3fnuz``,
    ``float8_e4m3b11fnuz``, ``float8_e5m2fnuz`` ...) and the sub-byte floats
    (``float4_e2m1fn``, ``float6_*``), which ml_dtypes stores in one byte."""
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 1


def dtype_name(dtype: Any) -> str:
    """Short canonical name of a floating dtype (``bf16``, ``fp8_e4m3`` ...).

    Dtypes without a short name give ``str(dtype)`` (``float64``,
    ``float8_e4m3fnuz`` ...).

    Raises:
      ValueError: ``dtype`` is None, an unknown name, or not a dtype-like.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from eae_jax.dtypes import dtype_name
      >>> dtype_name(jnp.bfloat16), dtype_name("float8_e4m3fn"), dtype_name(np.float64)
      ('bf16', 'fp8_e4m3', 'float64')
    """
    dtype = _as_dtype(dtype, "dtype_name")
    for short in COMPUTE_DTYPE_NAMES:
        if jnp.dtype(_NAMED_DTYPES[short]) == dtype:
            return short
    return str(dtype)


def is_fp8(dtype: Any) -> bool:
    """True for the two float8 formats this library computes in (dtype or name).

    Only ``float8_e4m3fn`` and ``float8_e5m2`` (``fp8_e4m3``/``fp8_e5m2``)
    count; the other 8-bit float variants (``float8_e4m3fnuz`` ...) give
    False (`DTypePolicy` refuses them as compute or param dtype and as
    ``fp8_format`` all the same).

    Raises:
      ValueError: ``dtype`` is None, an unknown name, or not a dtype-like.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.dtypes import is_fp8
      >>> is_fp8("fp8_e5m2"), is_fp8(jnp.float8_e4m3fnuz), is_fp8("bf16")
      (True, False, False)
    """
    return _as_dtype(dtype, "is_fp8") in FP8_DTYPES


def _parse_fp8_format(value: Any) -> jnp.dtype:
    """`DTypePolicy.fp8_format` as one of `FP8_DTYPES`; ValueError listing
    `FP8_FORMAT_NAMES` for anything else (``'bf16'``, ``float8_e4m3fnuz`` ...)."""
    try:
        dtype = parse_compute_dtype(value)
    except ValueError:
        dtype = None
    if dtype is None or dtype not in FP8_DTYPES:
        got = repr(value) if dtype is None else f"{value!r} ({dtype})" if isinstance(value, str) else str(dtype)
        raise ValueError(f"DTypePolicy fp8_format must be one of {', '.join(FP8_FORMAT_NAMES)} "
                         f"(the dtypes float8_e4m3fn / float8_e5m2), got {got}")
    return dtype


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
      fp8_format: for fp8 policies, the forward format of the seams:
        ``fp8_e4m3`` or ``fp8_e5m2`` (also spelled ``float8_e4m3fn`` /
        ``float8_e5m2``, or those dtypes).

    Norm statistics, softmax and the loss are always float32.

    Raises:
      ValueError: a dtype field is an unknown name or not a floating dtype;
        ``param_dtype`` or ``compute_dtype`` is None or a float of 8 bits or
        fewer (any float8 variant, ``float4_e2m1fn`` ...: an fp8 policy
        computes in bf16, see `from_name`); ``fp8_format`` is not one of
        the two fp8 formats (the message lists them).

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.dtypes import DTypePolicy
      >>> policy = DTypePolicy(compute_dtype=jnp.bfloat16, boundary_dtype=jnp.bfloat16)
      >>> policy.param_dtype, policy.compute_dtype, policy.boundary_dtype
      (dtype('float32'), dtype(bfloat16), dtype(bfloat16))
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    boundary_dtype: Optional[Any] = None
    adjoint_dtype: Optional[Any] = None
    fp8_format: Optional[Any] = None

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype"):
            if getattr(self, field) is None:
                raise ValueError(f"DTypePolicy {field} must be given (None would mean float64); "
                                 f"valid names are {', '.join(COMPUTE_DTYPE_NAMES)}")
        for field in ("param_dtype", "compute_dtype", "boundary_dtype", "adjoint_dtype"):
            value = getattr(self, field)
            if value is not None:
                try:
                    dtype = parse_compute_dtype(value)
                except ValueError as err:
                    raise ValueError(f"DTypePolicy {field}: {err}") from err
                object.__setattr__(self, field, dtype)
        if self.fp8_format is not None:
            object.__setattr__(self, "fp8_format", _parse_fp8_format(self.fp8_format))
        if _is_narrow_float(self.param_dtype):
            raise ValueError(f"param_dtype cannot be an fp8 format (got {self.param_dtype}, a float of 8 bits "
                             "or fewer); keep parameters in fp32/bf16")
        if _is_narrow_float(self.compute_dtype):
            raise ValueError(
                f"compute_dtype cannot be fp8 directly (got {self.compute_dtype}, a float of 8 bits or fewer); "
                "use DTypePolicy.from_name('fp8_e4m3'), which computes in bf16 with fp8 seams"
            )

    @classmethod
    def from_name(cls, name: str, param_dtype: Any = jnp.float32) -> "DTypePolicy":
        """The policy for a ``--dtype`` value.

        ``fp32``: everything fp32. ``bf16``/``fp16``: compute and boundaries
        in that dtype, params fp32. ``fp8_e4m3``/``fp8_e5m2``: compute in
        bf16 with fp8 seams in that format. Other floats of 8 bits or fewer
        (a ``float8_e4m3fnuz`` dtype ...) are refused.

        Raises:
          ValueError: unknown name (listing the valid ones); a float8 variant
            other than the two fp8 formats, or a sub-byte float (listing the
            valid fp8 formats).
        """
        dtype = parse_compute_dtype(name)
        if _is_narrow_float(dtype):  # fp8_format refuses the variants it cannot compute in
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
    """Largest finite value of a floating dtype (or dtype name), as a Python float.

    Raises:
      ValueError: ``dtype`` is None, an unknown name, not a dtype-like, or
        not a floating dtype (``int32`` ...).

    Example:
      >>> from eae_jax.dtypes import finfo_max
      >>> finfo_max("fp8_e4m3"), finfo_max("fp8_e5m2"), finfo_max("fp16")
      (448.0, 57344.0, 65504.0)
    """
    dtype = _as_dtype(dtype, "finfo_max")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"finfo_max: {dtype} is not a floating dtype")
    # jnp.finfo knows the ml_dtypes floats (bfloat16, the float8s) and numpy's.
    return float(jnp.finfo(dtype).max)
