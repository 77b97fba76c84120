"""Reading the ``.npz`` checkpoints runs wrote before checkpoints moved to Orbax.

Such a checkpoint is one file ``ckpt_<step>.npz`` holding every leaf of the
training state under its tree path (`jax.tree_util.keystr`), plus a JSON
metadata entry ``__metadata__.json``. A run directory holding them resumes
from the newest one (`eae_jax.train.checkpoint.CheckpointStore`) and writes
Orbax checkpoints from there on.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.train.errors import CheckpointError, UnreadableCheckpointError

_NAME = re.compile(r"^ckpt_(\d{8})\.npz$")
_META_KEY = "__metadata__.json"


def list_checkpoints(directory: str) -> list:
    """The ``.npz`` checkpoints in ``directory``, oldest first (files only).

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> np.savez(os.path.join(folder, "ckpt_00000002.npz"), x=np.zeros(1))
    >>> [os.path.basename(p) for p in list_checkpoints(folder)]
    ['ckpt_00000002.npz']
    """
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if _NAME.match(n) and os.path.isfile(os.path.join(directory, n)))
    return [os.path.join(directory, n) for n in names]


_ZIP_MAGIC = b"PK\x03\x04"


def load(path: str) -> tuple:
    """Every array of a checkpoint and its metadata: ``(arrays, metadata)``.

    The file is identified by content (a zip archive, as ``np.savez``
    writes), and every entry is read, so a damaged one is found here.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt_00000001.npz")
    >>> np.savez(path, **{"['w']": np.ones(2), _META_KEY: np.frombuffer(b'{"step": 1}', np.uint8)})
    >>> load(path)
    ({"['w']": array([1., 1.])}, {'step': 1})

    Raises:
      UnreadableCheckpointError: not an archive, damaged or truncated (the
        message says which; never numpy's pickle advice: checkpoints hold
        no pickles and are never loaded with ``allow_pickle``).
      CheckpointError: a bad metadata entry.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise UnreadableCheckpointError(f"cannot read checkpoint {path}: {err.strerror or err}") from err
    if head != _ZIP_MAGIC:
        what = "is empty" if not head else f"starts with bytes {head.hex(' ')}"
        raise UnreadableCheckpointError(f"checkpoint {path} is not a checkpoint archive (it {what}; "
                                        "a checkpoint is a zip archive written by np.savez)")
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = {k: data[k] for k in data.files}
    except Exception as err:  # zipfile.BadZipFile, EOFError, a CRC mismatch, object arrays ...
        detail = str(err)
        if "allow_pickle" in detail or "pickle" in detail.lower():
            detail = "an entry is a pickled object array, which no checkpoint holds"
        raise UnreadableCheckpointError(f"cannot read checkpoint {path}: it is damaged ({type(err).__name__}: "
                                        f"{detail})") from None
    meta = _decode_metadata(path, stored.pop(_META_KEY, np.zeros(0, np.uint8)))
    return stored, meta


def _decode_metadata(path: str, raw: np.ndarray) -> dict:
    try:
        meta = json.loads(bytes(raw).decode() or "{}")
        if not isinstance(meta, dict):
            raise ValueError(f"a {type(meta).__name__}, not a JSON object")
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"cannot read checkpoint {path}: bad metadata entry {_META_KEY}: {err}") from err
    return meta


def match(path: str, stored: dict, template: Any) -> list:
    """The arrays of a loaded checkpoint (`load`) for the leaves of ``template``, in
    its leaf order, as numpy (a typed key leaf gets its key data, uint32).

    Every leaf of ``template`` (arrays or `jax.ShapeDtypeStruct`) must be
    present with the same shape; values are converted to its dtype.

    >>> match("ckpt.npz", {"['w']": np.ones(2)}, {"w": jnp.zeros(2, jnp.int32)})
    [array([1, 1], dtype=int32)]
    >>> match("ckpt.npz", {"['w']": np.ones(2)}, {"v": jnp.zeros(2)})
    Traceback (most recent call last):
    ...
    eae_jax.train.errors.CheckpointError: checkpoint ckpt.npz does not fit the training state:
      missing ['v']
      unexpected ['w']

    Raises:
      CheckpointError: missing, unexpected or mis-shaped entries (all
        listed in one message naming ``path``).
    """
    problems, leaves, expected_names = [], [], set()
    for key_path, ref in jax.tree_util.tree_flatten_with_path(template)[0]:  # not `path`: that is the file
        name = jax.tree_util.keystr(key_path)
        expected_names.add(name)
        is_key = jnp.issubdtype(ref.dtype, jax.dtypes.prng_key)
        shape = tuple(jax.eval_shape(jax.random.key_data, ref).shape) if is_key else tuple(ref.shape)
        if name not in stored:
            problems.append(f"missing {name}")
        elif tuple(stored[name].shape) != shape:
            problems.append(f"{name}: shape {tuple(stored[name].shape)}, expected {shape}")
        else:
            leaves.append(np.asarray(stored[name], dtype=np.uint32 if is_key else ref.dtype))
    problems += [f"unexpected {n}" for n in sorted(set(stored) - expected_names)]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit the training state:\n  " + "\n  ".join(problems))
    return leaves
