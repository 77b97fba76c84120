"""File-writing helpers shared by training checkpoints and interop exports."""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Optional


def new_file_mode(replacing: Optional[str] = None) -> int:
    """Permission bits for a file written through a temporary: those of the
    file it replaces, else what ``open()`` would give under the current umask.
    (``tempfile.mkstemp`` creates 0600, which left checkpoints and exports
    unreadable to the other users and services a plain write lets in.)

    Example:
      >>> import os, tempfile
      >>> from eae_jax.fileio import new_file_mode
      >>> path = os.path.join(tempfile.mkdtemp(), "f")
      >>> open(path, "w").close(); os.chmod(path, 0o640)
      >>> oct(new_file_mode(replacing=path))
      '0o640'
    """
    if replacing is not None:
        try:
            return stat.S_IMODE(os.stat(replacing).st_mode)
        except OSError:
            pass
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and one rename.

    Example:
      >>> import os, tempfile
      >>> from eae_jax.fileio import atomic_write_bytes
      >>> path = os.path.join(tempfile.mkdtemp(), "f.bin")
      >>> atomic_write_bytes(path, b"abc")
      >>> open(path, "rb").read(), os.listdir(os.path.dirname(path))
      (b'abc', ['f.bin'])
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode(path))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


#: Magic numbers of the file kinds `sniff` names (checked in this order).
_MAGIC = (
    (b"\x93NUMPY", "npy"),
    (b"PK\x03\x04", "zip archive (.npz, torch .pt)"),
    (b"PK\x05\x06", "zip archive (.npz, torch .pt)"),
    (b"\x1f\x8b\x08", "gzip"),
    (b"ak42"[::-1], "llama2.c checkpoint"),  # the little-endian uint32 0x616B3432
)


def sniff(path: str) -> str:
    """What kind of file ``path`` holds, from its content (never its name).

    Returns ``'npy'``, ``'zip archive (.npz, torch .pt)'``, ``'gzip'``,
    ``'llama2.c checkpoint'``, ``'safetensors'``, ``'pickle'`` or
    ``'unknown'`` (no magic number: raw data such as a uint16 token shard).
    A pickle is a protocol 2-5 header with the STOP opcode as last byte.

    >>> import os, tempfile, numpy as np
    >>> d = tempfile.mkdtemp()
    >>> np.save(os.path.join(d, "t.BIN"), np.arange(3))
    >>> sniff(os.path.join(d, "t.BIN.npy"))
    'npy'
    """
    import struct

    with open(path, "rb") as f:
        head = f.read(16)
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size:
            f.seek(size - 1)
        last = f.read(1)
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if len(head) >= 10 and head[8:10] == b'{"':
        (n,) = struct.unpack("<Q", head[:8])
        if 0 < n <= size - 8:
            return "safetensors"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and last == b".":
        return "pickle"
    return "unknown"
