"""Reading checkpoint files without executing anything in them.

torch pickles are read only with ``torch.load(..., weights_only=True)``:
torch's restricted unpickler, which rebuilds tensors and plain containers
and refuses every other global *before* calling it. Whole
`eae_runtime.contrib.PreNormTransformerBlock` stacks saved with
``torch.save(module_list)`` additionally need those exact module classes;
they are allowlisted by name only when the caller asks for modules
(`load_torch_file(..., allow_modules=True)`), and unpickling an allowlisted
``nn.Module`` only restores its attribute dict (no ``__init__`` runs).

safetensors files hold no code at all; they are read with numpy alone
(`interop.safetensors_numpy`), so they need neither torch nor the
safetensors package. `detect_format` sniffs magic bytes, never the
extension alone, so a renamed file is still recognised.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import struct
import tempfile
import zipfile
from typing import Any, Dict

import numpy as np

from eae_jax.fileio import new_file_mode
from interop.errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError
from interop.safetensors_numpy import read_safetensors
from interop.tensors import require_torch, torch_to_numpy

#: llama2.c's version-1/2 magic, the uint32 of ASCII "ak42".
LLAMA2C_MAGIC = 0x616B3432

FORMATS = ("torch_pickle", "safetensors", "llama2c_bin_v0", "llama2c_bin_v1", "llama2c_bin_v2", "hf_dir")


def _reference_module_classes() -> list:
    """The classes a saved PreNormTransformerBlock stack is made of (and nothing else)."""
    torch = require_torch()
    from eae_runtime.contrib import transformer_blocks as tb

    return [
        torch.nn.ModuleList, torch.nn.Sequential, torch.nn.Linear,
        tb.PreNormTransformerBlock, tb.RMSNorm, tb.CausalSelfAttention, tb.RotaryPositionalEmbedding, tb.SwiGLU,
    ]


def load_torch_file(path: str, allow_modules: bool = False) -> Any:
    """Load a torch ``.pt`` / ``.bin`` pickle with the weights-only unpickler.

    Args:
      path: the file (zip-based torch format or the legacy pickle format).
      allow_modules: also allow the eae_runtime reference-block classes (and
        ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.Linear``), so a whole
        saved block stack loads. Needs eae_runtime.

    Returns:
      Whatever the file holds (a state dict, a checkpoint dict, a ModuleList).

    Raises:
      FileNotFoundError: no such file.
      UnsafeCheckpointError: the pickle references a global outside the
        allowlist (e.g. a ``__reduce__`` that would call ``os.system``);
        nothing was executed.
      CorruptCheckpointError: the file is truncated or damaged.

    Example:
      >>> import os, pickle, tempfile, torch
      >>> from interop.safe_load import load_torch_file
      >>> folder = tempfile.mkdtemp()
      >>> torch.save({"w": torch.ones(2)}, os.path.join(folder, "weights.pt"))
      >>> load_torch_file(os.path.join(folder, "weights.pt"))["w"].tolist()
      [1.0, 1.0]
      >>> class Payload:
      ...     def __reduce__(self):
      ...         return (os.system, ("echo this never runs",))
      >>> with open(os.path.join(folder, "evil.pt"), "wb") as f:
      ...     pickle.dump(Payload(), f, protocol=2)          # a pickle as torch writes them
      >>> load_torch_file(os.path.join(folder, "evil.pt"))
      Traceback (most recent call last):
      ...
      interop.errors.UnsafeCheckpointError: ...evil.pt: refused to load: the pickle references the global
      '...system', which a weights-only load does not allow ...
    """
    torch = require_torch()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such checkpoint file: {path}")
    size = os.path.getsize(path)
    if size == 0:
        raise CorruptCheckpointError(f"{path}: the file is empty")
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"PK":
        # A zip whose central directory is cut off is the signature of a truncated torch file;
        # testzip also checks every member's CRC, so a damaged tensor is caught here.
        try:
            with zipfile.ZipFile(path) as zf:
                bad = zf.testzip()
        except zipfile.BadZipFile as err:
            raise CorruptCheckpointError(
                f"{path}: truncated or damaged torch zip archive ({size} bytes): {err}") from err
        if bad is not None:
            raise CorruptCheckpointError(f"{path}: member {bad!r} of the torch zip archive is damaged (CRC mismatch)")
    allowed = _reference_module_classes() if allow_modules else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        msg = str(err)
        detail = msg.split("WeightsUnpickler error:")[-1].strip().splitlines()[0] if msg else ""
        # torch's message goes on to suggest weights_only=False or allowlisting the global;
        # keep only the diagnosis, we do neither.
        detail = detail.split(" Please use")[0].split(" Please file")[0].strip()
        m = re.search(r"GLOBAL ([\w\.]+)", msg)
        if m or "Unsupported global" in msg or "reduce" in detail.lower() or "build" in detail.lower():
            raise UnsafeCheckpointError(path, detail, m.group(1) if m else None) from None
        # Anything else (an opcode the weights-only unpickler does not know, garbage bytes) is damage.
        raise CorruptCheckpointError(
            f"{path}: not a weights-only torch pickle ({size} bytes); the restricted unpickler stopped at: "
            f"{detail or msg}. The file is damaged or uses pickle features a checkpoint does not need; "
            "nothing from it was executed") from None
    except (EOFError, RuntimeError, struct.error, ValueError, zipfile.BadZipFile, KeyError, IndexError) as err:
        raise CorruptCheckpointError(f"{path}: truncated or damaged torch file ({size} bytes): {err}") from err


def load_safetensors_file(path: str) -> Dict[str, np.ndarray]:
    """Read a ``.safetensors`` file into ``{name: numpy array}`` (dtypes kept,
    bf16 included), with numpy alone (`interop.safetensors_numpy`).

    Raises:
      FileNotFoundError: no such file.
      CorruptCheckpointError: truncated header or data.

    Example:
      >>> import os, tempfile, torch
      >>> from safetensors.torch import save_file
      >>> from interop.safe_load import load_safetensors_file
      >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
      >>> save_file({"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}, path)
      >>> w = load_safetensors_file(path)["w"]
      >>> w.dtype.name, w.astype("float32").tolist()
      ('bfloat16', [1.0, 2.0])
    """
    return read_safetensors(path)


@contextlib.contextmanager
def atomic_target(path: str):
    """Yield a temporary path next to ``path``; when the block finishes, the
    file written there replaces ``path`` in one rename. If the block raises,
    the temporary file is removed and ``path`` (an earlier export, say) is
    left as it was: an export that fails halfway never leaves a partial file
    under the real name.

    Example:
      >>> import os, tempfile
      >>> from interop.safe_load import atomic_target
      >>> path = os.path.join(tempfile.mkdtemp(), "out.bin")
      >>> with atomic_target(path) as tmp, open(tmp, "wb") as f:
      ...     _ = f.write(b"complete")
      >>> try:
      ...     with atomic_target(path) as tmp, open(tmp, "wb") as f:
      ...         _ = f.write(b"half")
      ...         raise RuntimeError("the export failed")
      ... except RuntimeError:
      ...     pass
      >>> open(path, "rb").read(), os.listdir(os.path.dirname(path))   # the old file, no temporary
      (b'complete', ['out.bin'])
    """
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, new_file_mode(path))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def state_dict_to_numpy(sd: Any, where: str) -> Dict[str, np.ndarray]:
    """A flat ``{name: torch.Tensor}`` mapping -> ``{name: numpy array}`` (numpy / JAX
    arrays among the values are taken as they are; a mapping of arrays
    alone needs no torch).

    Raises:
      UnknownFormatError: not a mapping of tensors (the message says what it is).

    Example:
      >>> import torch
      >>> from interop.safe_load import state_dict_to_numpy
      >>> state_dict_to_numpy({"w": torch.ones(2, dtype=torch.bfloat16)}, "example")["w"].dtype.name
      'bfloat16'
      >>> state_dict_to_numpy({"w": "not a tensor"}, "example")
      Traceback (most recent call last):
      ...
      interop.errors.UnknownFormatError: example: expected a state dict of tensors, but 1 entries are not tensors: 'w'
    """
    if not isinstance(sd, dict):
        raise UnknownFormatError(f"{where}: expected a state dict (name -> tensor), got {type(sd).__name__}")

    def is_tensor(v):  # a torch tensor (torch is imported only for a value that may be one)
        return type(v).__module__.startswith("torch") and isinstance(v, require_torch().Tensor)

    def is_array(v):  # numpy / JAX arrays are taken as they are
        return not is_tensor(v) and (isinstance(v, np.ndarray) or (
            hasattr(v, "__array__") and hasattr(v, "dtype") and hasattr(v, "shape")))

    bad = [k for k, v in sd.items() if not is_array(v) and not is_tensor(v)]
    if bad:
        raise UnknownFormatError(
            f"{where}: expected a state dict of tensors, but {len(bad)} entries are not tensors: "
            f"{', '.join(repr(b) for b in bad[:8])}")
    return {str(k): torch_to_numpy(v) if is_tensor(v) else np.asarray(v) for k, v in sd.items()}


def llama2c_bin_size(dim: int, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int,
                     shared: bool, version: int) -> int:
    """Exact byte size of a float32 llama2.c ``.bin`` (version 0 or 1) with this header.

    Example:
      >>> from interop.safe_load import llama2c_bin_size
      >>> llama2c_bin_size(dim=8, hidden=16, layers=1, heads=2, kv_heads=2, vocab=32, seq=16, shared=True, version=1)
      3936
      >>> 256 + 4 * (32 * 8 + (2 * 8 + 4 * 8 * 8 + 3 * 8 * 16) + 8)   # header + float32 tensors
      3936
    """
    head_dim = dim // heads
    kv_dim = kv_heads * head_dim
    floats = vocab * dim + layers * (2 * dim + dim * dim + 2 * kv_dim * dim + dim * dim + 3 * dim * hidden) + dim
    if version == 0:
        floats += 2 * seq * (head_dim // 2)
        header = 28
    else:
        header = 256
    if not shared:
        floats += vocab * dim
    return header + 4 * floats


def _plausible_v0_header(h) -> bool:
    dim, hidden, layers, heads, kv, vocab, seq = h
    return (0 < dim < 1 << 20 and 0 < hidden < 1 << 22 and 0 < layers < 4096 and 0 < heads <= dim
            and dim % heads == 0 and 0 < kv <= heads and heads % kv == 0 and 0 < abs(vocab) < 1 << 24
            and 0 < seq < 1 << 24)


def _v0_header_and_size(head: bytes):
    """``(header fields, file size they imply)`` when ``head`` starts with a
    plausible legacy llama2.c header, else None."""
    if len(head) < 28:
        return None
    h = struct.unpack("<7i", head[:28])
    if not _plausible_v0_header(h):
        return None
    dim, hidden, layers, heads, kv, vocab, seq = h
    return h, llama2c_bin_size(dim, hidden, layers, heads, kv, abs(vocab), seq, vocab > 0, 0)


def detect_format(path: str) -> str:
    """Name the checkpoint format of ``path`` from its content.

    Returns:
      One of `FORMATS`: ``hf_dir`` (a directory with config.json),
      ``torch_pickle``, ``safetensors``, ``llama2c_bin_v0`` / ``_v1`` / ``_v2``.

    Raises:
      FileNotFoundError: no such file or directory.
      CorruptCheckpointError: a llama2.c header whose file is too short.
      UnknownFormatError: none of the above (the message shows what was seen).

    Example:
      >>> import os, tempfile, torch
      >>> from interop.safe_load import detect_format
      >>> folder = tempfile.mkdtemp()
      >>> torch.save({"w": torch.ones(1)}, os.path.join(folder, "weights.bin"))    # the name does not matter
      >>> detect_format(os.path.join(folder, "weights.bin"))
      'torch_pickle'
      >>> with open(os.path.join(folder, "config.json"), "w") as f:
      ...     _ = f.write("{}")
      >>> detect_format(folder)
      'hf_dir'
    """
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf_dir"
        raise UnknownFormatError(f"{path}: a directory without config.json is not a Hugging Face checkpoint")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such checkpoint file or directory: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(64)
    if size == 0:
        raise CorruptCheckpointError(f"{path}: the file is empty")
    v0 = _v0_header_and_size(head)
    if v0 is not None and v0[1] == size:
        # Checked before the pickle opcode: a legacy header's dim of 128 + 256k starts with byte 0x80 too
        # (and 640 + 1024k with 0x80 0x02, a protocol-2 pickle's first two bytes).
        return "llama2c_bin_v0"
    if head[:2] == b"PK" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return "torch_pickle"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 0 < n < 100_000_000 and head[8:9] == b"{":
            return "safetensors"
    if len(head) >= 8:
        magic, version = struct.unpack("<Ii", head[:8])
        if magic == LLAMA2C_MAGIC:
            if version == 1:
                if size < 256:
                    raise CorruptCheckpointError(
                        f"{path}: llama2.c version-1 file of {size} bytes: its 256-byte header is truncated")
                h = struct.unpack("<7i", head[8:36])
                if not _plausible_v0_header(h) or h[5] <= 0:
                    raise CorruptCheckpointError(
                        f"{path}: llama2.c version-1 header is invalid (dim, hidden_dim, n_layers, n_heads, "
                        f"n_kv_heads, vocab_size, seq_len = {h})")
            if version in (1, 2):  # version 2 (Q8_0) is recognised only to be refused by name
                return f"llama2c_bin_v{version}"
            raise UnknownFormatError(f"{path}: llama2.c magic 'ak42' with unknown version {version}")
    if v0 is not None:
        (dim, hidden, layers, heads, kv, vocab, seq), want = v0
        if size < want or (size - want) % 4 == 0:
            # Shorter: truncated. Longer by whole floats: a llama2.c file with data after its last
            # tensor (another byte count would be an unrelated file whose first bytes look like a header).
            raise CorruptCheckpointError(
                f"{path}: llama2.c legacy header (dim={dim}, hidden_dim={hidden}, n_layers={layers}, "
                f"n_heads={heads}, n_kv_heads={kv}, vocab_size={vocab}, seq_len={seq}) needs {want} bytes, "
                f"the file has {size}: " + ("it is truncated" if size < want else
                                            f"it has {size - want} trailing bytes after the last tensor"))
    shown = head[:16].hex(" ")
    raise UnknownFormatError(
        f"{path}: unknown checkpoint format ({size} bytes, first bytes {shown}); supported: a Hugging Face "
        "directory (config.json + model.safetensors / pytorch_model.bin), torch .pt/.bin pickles, .safetensors, "
        "llama2.c .bin (legacy v0 or v1)")


def read_json(path: str) -> dict:
    """Read a JSON object, with a clear error for anything else.

    Example:
      >>> import json, os, tempfile
      >>> from interop.safe_load import read_json
      >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
      >>> with open(path, "w") as f:
      ...     json.dump([1, 2], f)
      >>> read_json(path)
      Traceback (most recent call last):
      ...
      interop.errors.CorruptCheckpointError: ...config.json: expected a JSON object, got list
    """
    try:
        with open(path) as f:
            out = json.load(f)
    except json.JSONDecodeError as err:
        raise CorruptCheckpointError(f"{path}: invalid JSON: {err}") from err
    if not isinstance(out, dict):
        raise CorruptCheckpointError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


def file_sha256(path: str) -> str:
    """Hex sha256 of a file (for provenance in reports).

    Example:
      >>> import os, tempfile
      >>> from interop.safe_load import file_sha256
      >>> path = os.path.join(tempfile.mkdtemp(), "empty")
      >>> open(path, "wb").close()
      >>> file_sha256(path)
      'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'
    """
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
