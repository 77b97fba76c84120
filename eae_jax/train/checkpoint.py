"""Atomic, resumable checkpoints of arbitrary pytrees of arrays.

A checkpoint is one ``.npz`` file named ``ckpt_<step>.npz`` holding every leaf
under its tree path, plus a JSON metadata entry. It is written to a temporary
file in the same directory, flushed and fsync'ed, then renamed into place, so
a crash never leaves a half-written checkpoint under the final name, and the
previous checkpoints stay until the new one is complete.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.fileio import new_file_mode

_NAME = re.compile(r"^ckpt_(\d{8})\.npz$")
_META_KEY = "__metadata__.json"
_TMP_PREFIX = ".ckpt_tmp_"
_TMP_PID = re.compile(r"^\.ckpt_tmp_(\d+)_")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit the expected state.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> path = checkpoint.save(d, 1, {"w": np.ones(2)})
      >>> try:
      ...     checkpoint.restore(path, {"w": np.ones(3)})
      ... except checkpoint.CheckpointError as err:
      ...     print(type(err).__name__, isinstance(err, ValueError))
      CheckpointError True
    """


def _flatten(tree: Any) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        if name in out:
            raise CheckpointError(f"two leaves share the path {name}")
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[name] = np.asarray(leaf)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(directory: str, max_age_s: float = 24 * 3600.0) -> list:
    """Delete the temporary files of checkpoint writes that can no longer
    finish (a writer killed before its rename), and return their paths.

    A temporary is stale when the process that named it (its pid is in the
    name) is gone, or, without a pid in the name, when it is older than
    ``max_age_s``. A live writer's file is never touched.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> stale = os.path.join(d, ".ckpt_tmp_old.npz")                # no pid in the name: judged by age
      >>> _ = open(stale, "wb").write(b"half written")
      >>> os.utime(stale, (0, 0))
      >>> [os.path.basename(p) for p in checkpoint.remove_stale_temporaries(d)]
      ['.ckpt_tmp_old.npz']
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    now = time.time()
    for name in os.listdir(directory):
        if not name.startswith(_TMP_PREFIX):
            continue
        path = os.path.join(directory, name)
        m = _TMP_PID.match(name)
        try:
            stale = (not _pid_alive(int(m.group(1)))) if m else now - os.path.getmtime(path) > max_age_s
            if stale and os.path.isfile(path):
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:  # another writer cleaned it or renamed it
            continue
    return removed


def save(directory: str, step: int, tree: Any, metadata: Optional[dict] = None, keep: int = 3) -> str:
    """Write ``tree`` as ``directory/ckpt_<step>.npz`` atomically.

    Args:
      directory: created if missing.
      step: training step (names the file).
      tree: pytree of arrays (typed PRNG keys are stored as key data).
      metadata: JSON-serialisable dict stored alongside.
      keep: how many newest checkpoints to keep (older ones are deleted
        only after the new one is in place); 0 keeps all.

    Temporaries left by a writer that was killed mid-write are deleted first
    (`remove_stale_temporaries`).

    Returns:
      The path written.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> for step in (1, 2, 3):
      ...     path = checkpoint.save(d, step, {"w": np.full(2, step)}, {"step": step}, keep=2)
      >>> os.path.basename(path), [os.path.basename(p) for p in checkpoint.list_checkpoints(d)]
      ('ckpt_00000003.npz', ['ckpt_00000002.npz', 'ckpt_00000003.npz'])
    """
    os.makedirs(directory, exist_ok=True)
    arrays = _flatten(tree)
    meta = dict(metadata or {}, step=int(step))
    arrays[_META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    final = os.path.join(directory, f"ckpt_{int(step):08d}.npz")
    remove_stale_temporaries(directory)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}_", suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode(final))
        os.replace(tmp, final)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if keep > 0:
        for old in list_checkpoints(directory)[:-keep]:
            os.unlink(old)
    return final


def list_checkpoints(directory: str) -> list:
    """Complete checkpoints in ``directory``, oldest first (files only: a directory under a
    checkpoint's name, say another tool's partial write, is neither resumed nor pruned).

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> _ = checkpoint.save(d, 10, {"w": np.ones(2)}); _ = checkpoint.save(d, 9, {"w": np.ones(2)})
      >>> [os.path.basename(p) for p in checkpoint.list_checkpoints(d)]
      ['ckpt_00000009.npz', 'ckpt_00000010.npz']
    """
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if _NAME.match(n) and os.path.isfile(os.path.join(directory, n)))
    return [os.path.join(directory, n) for n in names]


def latest(directory: str) -> Optional[str]:
    """Path of the newest checkpoint, or None.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> checkpoint.latest(d) is None
      True
      >>> _ = checkpoint.save(d, 4, {"w": np.ones(2)})
      >>> os.path.basename(checkpoint.latest(d))
      'ckpt_00000004.npz'
    """
    found = list_checkpoints(directory)
    return found[-1] if found else None


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file cannot be read at all (not an archive, damaged, truncated).

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> path = os.path.join(d, "ckpt_00000001.npz")
      >>> _ = open(path, "wb").write(b"not a zip archive")
      >>> try:
      ...     checkpoint.load(path)
      ... except checkpoint.UnreadableCheckpointError:
      ...     print("unreadable")
      unreadable
    """


_ZIP_MAGIC = b"PK\x03\x04"


def load(path: str) -> tuple:
    """Every array of a checkpoint and its metadata: ``(arrays, metadata)``.

    The file is identified by content (a zip archive, as ``np.savez``
    writes), and every entry is read, so a damaged one is found here.

    Raises:
      UnreadableCheckpointError: not an archive, damaged or truncated (the
        message says which; never numpy's pickle advice: checkpoints hold
        no pickles and are never loaded with ``allow_pickle``).
      CheckpointError: a bad metadata entry.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> path = checkpoint.save(d, 5, {"w": np.arange(3.0)}, {"step": 5})
      >>> arrays, meta = checkpoint.load(path)
      >>> meta["step"], [a.tolist() for a in arrays.values()]
      (5, [[0.0, 1.0, 2.0]])
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


def read_metadata(path: str) -> dict:
    """The metadata dict of a checkpoint (the whole file is read: see `load`).

    Raises:
      CheckpointError: unreadable file or metadata entry.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> checkpoint.read_metadata(checkpoint.save(d, 2, {"w": np.ones(1)}, {"run": "a"}))["run"]
      'a'
    """
    return load(path)[1]


def set_aside(path: str) -> str:
    """Rename an unreadable checkpoint to ``<path>.unreadable`` (``.unreadable.1`` ... when
    taken) and return the new path: kept for inspection, never resumed, pruned or overwritten.

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> path = checkpoint.save(d, 1, {"w": np.ones(1)})
      >>> os.path.basename(checkpoint.set_aside(path)), checkpoint.list_checkpoints(d)
      ('ckpt_00000001.npz.unreadable', [])
    """
    target, n = f"{path}.unreadable", 0
    while os.path.exists(target):
        n += 1
        target = f"{path}.unreadable.{n}"
    os.rename(path, target)
    return target


def newest_readable(directory: str) -> tuple:
    """``(path, arrays, metadata, unreadable)`` of the newest checkpoint of ``directory``
    that `load` reads; ``unreadable`` lists ``(path, error)`` of the newer ones it skipped.
    ``path`` is None when there is none (``unreadable`` then lists every checkpoint).

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> good = checkpoint.save(d, 1, {"w": np.ones(1)})
      >>> _ = open(os.path.join(d, "ckpt_00000002.npz"), "wb").write(b"torn")
      >>> path, arrays, meta, unreadable = checkpoint.newest_readable(d)
      >>> path == good, [os.path.basename(p) for p, _ in unreadable]
      (True, ['ckpt_00000002.npz'])
    """
    unreadable = []
    for path in reversed(list_checkpoints(directory)):
        try:
            arrays, meta = load(path)
        except UnreadableCheckpointError as err:
            unreadable.append((path, err))
            continue
        return path, arrays, meta, unreadable
    return None, None, None, unreadable


def _decode_metadata(path: str, raw: np.ndarray) -> dict:
    try:
        meta = json.loads(bytes(raw).decode() or "{}")
        if not isinstance(meta, dict):
            raise ValueError(f"a {type(meta).__name__}, not a JSON object")
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"cannot read checkpoint {path}: bad metadata entry {_META_KEY}: {err}") from err
    return meta


def restore(path: str, template: Any) -> tuple:
    """Read a checkpoint into the structure of ``template`` (`load`, then `fit`).

    Returns:
      ``(tree, metadata)``.

    Raises:
      CheckpointError: unreadable/truncated file, or missing, unexpected or
        mis-shaped entries (all listed in one message).

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> path = checkpoint.save(d, 1, {"w": np.arange(2.0), "b": np.zeros(1)})
      >>> tree, meta = checkpoint.restore(path, {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)})
      >>> tree["w"].tolist(), tree["w"].dtype
      ([0.0, 1.0], dtype('float32'))
    """
    arrays, meta = load(path)
    return fit(path, arrays, template), meta


def fit(path: str, stored: dict, template: Any) -> Any:
    """Arrays of a loaded checkpoint (`load`) in the structure of ``template``.

    Every leaf of ``template`` must be present with the same shape; dtypes
    are converted to the template's (typed keys rebuilt with its impl).

    Raises:
      CheckpointError: missing, unexpected or mis-shaped entries (all
        listed in one message naming ``path``).

    Example:
      >>> import os, tempfile, numpy as np
      >>> from eae_jax.train import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> path = checkpoint.save(d, 1, {"w": np.arange(2.0)})
      >>> arrays, _ = checkpoint.load(path)
      >>> checkpoint.fit(path, arrays, {"w": np.zeros(2, np.float16)})["w"].dtype
      dtype('float16')
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    problems, leaves = [], []
    expected_names = set()
    for key_path, ref in paths_leaves:  # not `path`: the error below names the file
        name = jax.tree_util.keystr(key_path)
        expected_names.add(name)
        is_key = hasattr(ref, "dtype") and jnp.issubdtype(ref.dtype, jax.dtypes.prng_key)
        ref_data = jax.random.key_data(ref) if is_key else ref
        if name not in stored:
            problems.append(f"missing {name}")
            leaves.append(ref)
            continue
        value = stored[name]
        if tuple(value.shape) != tuple(np.shape(ref_data)):
            problems.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(np.shape(ref_data))}")
            leaves.append(ref)
            continue
        if is_key:
            leaves.append(jax.random.wrap_key_data(jnp.asarray(value, jnp.uint32), impl=jax.random.key_impl(ref)))
        else:
            leaves.append(jnp.asarray(value, dtype=ref.dtype))
    problems += [f"unexpected {n}" for n in sorted(set(stored) - expected_names)]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit the training state:\n  " + "\n  ".join(problems))
    return jax.tree_util.tree_unflatten(treedef, leaves)
