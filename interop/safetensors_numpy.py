"""Reading ``.safetensors`` files with numpy alone (no torch, no safetensors package).

The format: an 8-byte little-endian header length N, N bytes of JSON
mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (plus an optional ``"__metadata__"`` of strings), then the data
buffer, tensors little-endian and C-ordered at their offsets. The buffer
must be covered exactly, without holes or overlaps.

bfloat16 and float8 come back as `ml_dtypes` arrays (what JAX uses):
``safetensors.numpy`` has no bfloat16, which is how Hugging Face LLaMA
weights are mostly stored. Every check the safetensors library makes on a
header is made here too, each failure a `CorruptCheckpointError` naming
the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Dict

import ml_dtypes
import numpy as np

from interop.errors import CorruptCheckpointError

#: safetensors dtype names -> numpy dtypes (little-endian).
SAFETENSORS_DTYPES: Dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"), "C64": np.dtype("<c8"),
}
#: The safetensors library refuses larger headers.
MAX_HEADER_BYTES = 100_000_000


def _entries(path: str, header: dict, data_size: int) -> Dict[str, tuple]:
    """``{name: (dtype, shape, begin, end)}``, every entry checked."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: damaged safetensors header: {what}")

    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise bad("__metadata__ must map names to strings")
    out = {}
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r} needs exactly dtype, shape and data_offsets, got {info!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {name!r} has dtype {dtype!r}; known: {', '.join(SAFETENSORS_DTYPES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has data_offsets {offsets!r}")
        want = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != want:
            raise bad(f"tensor {name!r} ({dtype}{shape}) needs {want} bytes, its offsets {offsets} span "
                      f"{offsets[1] - offsets[0]}")
        out[name] = (SAFETENSORS_DTYPES[dtype], tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, (_, _, begin, stop) in sorted(out.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin} of the data, the tensors before it end at {end} "
                      f"({'overlap' if begin < end else 'a hole'})")
        end = stop
    if end != data_size:
        what = "truncated" if end > data_size else f"{data_size - end} bytes after the last tensor"
        raise CorruptCheckpointError(f"{path}: truncated or damaged safetensors file: the tensors need {end} bytes "
                                     f"of data, the file holds {data_size} ({what})")
    return out


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """Read a ``.safetensors`` file into ``{name: numpy array}``, dtypes kept.

    The file is memory-mapped; each tensor is copied out once.

    Raises:
      FileNotFoundError: no such file.
      CorruptCheckpointError: a truncated file, a header that is not the
        format's JSON, an unknown dtype, offsets that do not tile the data.

    >>> import os, tempfile
    >>> from safetensors.numpy import save_file          # the reference writer (float32 here)
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
    >>> read_safetensors(path)["w"].tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    >>> with open(path, "r+b") as f:
    ...     _ = f.truncate(os.path.getsize(path) - 4)
    >>> read_safetensors(path)
    Traceback (most recent call last):
    ...
    interop.errors.CorruptCheckpointError: ...: truncated or damaged safetensors file: the tensors need 24 bytes
    of data, the file holds 20 (truncated)
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such checkpoint file: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: truncated or damaged safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CorruptCheckpointError(f"{path}: truncated or damaged safetensors file: a header of {n} bytes "
                                         f"in a file of {size}")
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{path}: truncated or damaged safetensors file: the header is not JSON "
                                     f"({err})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: damaged safetensors header: a JSON {type(header).__name__}, "
                                     "not an object")
    data_size = size - 8 - n
    entries = _entries(path, header, data_size)
    if not data_size:
        return {name: np.zeros(shape, dtype) for name, (dtype, shape, _, _) in entries.items()}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(data_size,))
    try:
        return {name: np.array(data[begin:end].view(dtype).reshape(shape), copy=True)
                for name, (dtype, shape, begin, end) in entries.items()}
    finally:
        del data  # the map closes with its last view (each tensor is a copy)
