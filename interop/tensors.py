"""Bit-exact tensor conversion between torch, numpy and JAX.

numpy has no bfloat16 / float8 of its own; JAX uses the `ml_dtypes` ones.
torch refuses ``.numpy()`` on those dtypes, so they cross as raw bits
(``view`` as an integer of the same width) and are reinterpreted on the other
side. No value ever goes through float32 on the way, so a round trip
reproduces every bit, NaN payloads included.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


def require_torch():
    """Import and return torch, or raise ImportError naming the extra to install.

    Example:
      >>> from interop.tensors import require_torch
      >>> require_torch().__name__
      'torch'
    """
    try:
        import torch
    except ImportError as err:  # pragma: no cover - torch is installed in the test env
        raise ImportError(
            "interop needs PyTorch: install the torch extra, e.g. pip install 'eae-jax[torch]'"
        ) from err
    return torch


def _bit_views():
    """torch dtype -> (same-width integer torch dtype, numpy dtype) for dtypes numpy lacks."""
    import ml_dtypes

    torch = require_torch()
    table = {
        torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
        torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
        torch.float8_e5m2: (torch.uint8, np.dtype(ml_dtypes.float8_e5m2)),
    }
    return table


def torch_to_numpy(t: Any) -> np.ndarray:
    """Copy a torch tensor into a numpy array with the same dtype and bits.

    Args:
      t: a CPU or GPU torch tensor (parameters are detached first).

    Returns:
      A C-contiguous numpy array that owns its memory; bfloat16 / float8
      tensors come back as `ml_dtypes` arrays (what JAX uses).

    Raises:
      TypeError: ``t`` is not a torch tensor, or has a dtype with no numpy
        counterpart (complex32, quantized ...).

    Example:
      >>> import torch
      >>> from interop.tensors import torch_to_numpy
      >>> a = torch_to_numpy(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
      >>> a.dtype.name, a.astype("float32").tolist()
      ('bfloat16', [1.5, -2.0])
    """
    torch = require_torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach().cpu().contiguous()
    views = _bit_views()
    if t.dtype in views:
        int_dtype, np_dtype = views[t.dtype]
        return t.view(int_dtype).numpy().copy().view(np_dtype)
    try:
        return t.numpy().copy()
    except TypeError as err:
        raise TypeError(f"torch dtype {t.dtype} has no numpy/JAX counterpart") from err


def numpy_to_torch(a: Any) -> Any:
    """Copy a numpy / JAX array into a torch tensor with the same dtype and bits.

    Raises:
      TypeError: a dtype torch does not have.

    Example:
      >>> import jax.numpy as jnp
      >>> from interop.tensors import numpy_to_torch
      >>> t = numpy_to_torch(jnp.array([0.5, 448.0], jnp.float8_e4m3fn))
      >>> t.dtype, t.float().tolist()
      (torch.float8_e4m3fn, [0.5, 448.0])
    """
    torch = require_torch()
    a = np.asarray(a)
    for torch_dtype, (int_dtype, np_dtype) in _bit_views().items():
        if a.dtype == np_dtype:
            bits = np.ascontiguousarray(a).view(np.int16 if int_dtype == torch.int16 else np.uint8).copy()
            return torch.from_numpy(bits).view(torch_dtype)
    try:
        return torch.from_numpy(np.array(a, copy=True, order="C"))
    except TypeError as err:
        raise TypeError(f"numpy dtype {a.dtype} has no torch counterpart") from err


def torch_dtype_of(np_dtype: Any) -> Any:
    """The torch dtype matching a numpy / JAX dtype (bit views included).

    Example:
      >>> import jax.numpy as jnp
      >>> from interop.tensors import torch_dtype_of
      >>> torch_dtype_of(jnp.bfloat16), torch_dtype_of("float32")
      (torch.bfloat16, torch.float32)
    """
    torch = require_torch()
    np_dtype = np.dtype(np_dtype)
    for torch_dtype, (_, nd) in _bit_views().items():
        if nd == np_dtype:
            return torch_dtype
    return torch.from_numpy(np.zeros((), np_dtype)).dtype


def numpy_dtype_of(torch_dtype: Any) -> np.dtype:
    """The numpy (ml_dtypes) dtype matching a torch dtype.

    Example:
      >>> import torch
      >>> from interop.tensors import numpy_dtype_of
      >>> numpy_dtype_of(torch.bfloat16).name, numpy_dtype_of(torch.int64).name
      ('bfloat16', 'int64')
    """
    torch = require_torch()
    views = _bit_views()
    if torch_dtype in views:
        return views[torch_dtype][1]
    return torch.zeros((), dtype=torch_dtype).numpy().dtype


def resolve_dtype(dtype: Any) -> Optional[np.dtype]:
    """Turn a user dtype request into a numpy dtype (None keeps the stored dtype).

    Accepts None, the names of `eae_jax.dtypes.parse_compute_dtype`
    (``fp32``, ``bf16``, ``float16`` ...), numpy / JAX dtypes, or a torch dtype.

    Raises:
      ValueError: not a floating dtype.

    Example:
      >>> import torch
      >>> from interop.tensors import resolve_dtype
      >>> resolve_dtype(None) is None, resolve_dtype("bf16").name, resolve_dtype(torch.float16).name
      (True, 'bfloat16', 'float16')
    """
    if dtype is None:
        return None
    try:
        torch = require_torch()
        if isinstance(dtype, torch.dtype):
            return numpy_dtype_of(dtype)
    except ImportError:  # pragma: no cover
        pass
    from eae_jax.dtypes import parse_compute_dtype

    return np.dtype(parse_compute_dtype(dtype))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same dtype, shape and bytes (NaN payloads
    and -0.0 included; any memory order, Fortran-ordered copies too).

    Example:
      >>> import numpy as np
      >>> from interop.tensors import same_bits
      >>> same_bits(np.array([0.0]), np.array([-0.0]))           # equal values, different bits
      False
      >>> same_bits(np.array([np.nan]), np.array([np.nan]))      # unequal values, same bits
      True
    """
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


def cast(a: np.ndarray, dtype: Optional[np.dtype]) -> np.ndarray:
    """``a`` unchanged when ``dtype`` is None or already a's dtype, else converted
    (round to nearest even, as `astype` does everywhere in numpy/JAX/torch).

    Example:
      >>> import numpy as np
      >>> from interop.tensors import cast
      >>> a = np.array([1.0, 2.0], np.float32)
      >>> cast(a, None) is a, cast(a, np.dtype("float16")).dtype.name
      (True, 'float16')
    """
    if dtype is None or a.dtype == dtype:
        return a
    return a.astype(dtype)
