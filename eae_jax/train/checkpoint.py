"""Sharded, asynchronous, atomic checkpoints of the training state, with Orbax.

`CheckpointStore` wraps an `orbax.checkpoint.CheckpointManager` over a run's
``checkpoints`` directory. A checkpoint is a directory ``ckpt_<step>`` (8
digits) holding two items: ``state`` (every leaf of the state, each process
writing its own shards; a typed PRNG key as its key data) and ``meta`` (a
JSON object: the run's config and the step).

* Asynchronous: `CheckpointStore.save` returns once the arrays are copied
  off the devices; the files are written in the background while training
  goes on (the next save, `wait` or `close` waits for it).
* Atomic: Orbax writes into a temporary directory and renames it into place
  when complete; a killed writer leaves a temporary that is never resumed
  (and is removed before the next run's first save), and the older
  checkpoints stay until the new one is complete.
* Keep-last-N: the ``keep`` newest checkpoints stay (0 keeps all).
* Any mesh: `CheckpointStore.restore` reads each leaf straight into the
  sharding it is given, so a checkpoint saved on one mesh resumes on another.

A run directory may also hold ``ckpt_<step>.npz`` files from before the
move to Orbax (`eae_jax.train.legacy_npz`): they are resumed like the rest.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.train import legacy_npz
from eae_jax.train.errors import CheckpointError, UnreadableCheckpointError

STEP_PREFIX = "ckpt"
STEP_DIGITS = 8
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}_(\d{{{STEP_DIGITS}}})$")


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_tree(state: Any) -> dict:
    """``state`` as nested dicts of arrays keyed by its tree path (what Orbax stores).

    >>> to_tree({"w": [jnp.ones(2)], "k": jax.random.key(0)})["k"].dtype
    dtype('uint32')
    """
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [_key_name(p) for p in path] or ["value"]
        node = out
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    return out


def _leaves_by_path(tree: dict, prefix: Tuple[str, ...] = ()) -> dict:
    """``{path tuple: leaf}`` of nested dicts."""
    out = {}
    for name, sub in tree.items():
        if isinstance(sub, dict):
            out.update(_leaves_by_path(sub, prefix + (name,)))
        else:
            out[prefix + (name,)] = sub
    return out


def _template_paths(template: Any) -> list:
    """``(path tuple, readable name, leaf)`` of every template leaf, in leaf order."""
    return [(tuple(_key_name(p) for p in path) or ("value",), jax.tree_util.keystr(path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]]


def _stored_shape(leaf) -> tuple:
    return tuple(jax.eval_shape(jax.random.key_data, leaf).shape) if _is_key(leaf) else tuple(leaf.shape)


def _check_fits(path: str, stored: dict, template: Any) -> None:
    """CheckpointError listing the template leaves missing from (or mis-shaped in)
    ``stored`` (``{path tuple: shape}``) and the stored entries it lacks."""
    problems, expected = [], set()
    for key, name, leaf in _template_paths(template):
        expected.add(key)
        if key not in stored:
            problems.append(f"missing {name}")
        elif tuple(stored[key]) != _stored_shape(leaf):
            problems.append(f"{name}: shape {tuple(stored[key])}, expected {_stored_shape(leaf)}")
    problems += [f"unexpected {'/'.join(k)}" for k in sorted(set(stored) - expected)]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit the training state:\n  " + "\n  ".join(problems))


def _key_impl(ref):
    """The PRNG implementation of a typed key (an array or a `jax.ShapeDtypeStruct`)."""
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), ref)
    return found[0]


def _rebuild(template: Any, leaves: list) -> Any:
    """``leaves`` (template order; key data for typed keys) in ``template``'s structure."""
    refs, treedef = jax.tree_util.tree_flatten(template)
    out = [jax.random.wrap_key_data(v, impl=_key_impl(r)) if _is_key(r) else v for r, v in zip(refs, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (one process: ``ok``)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class CheckpointStore:
    """A run's checkpoints (see the module doc).

    >>> import tempfile
    >>> store = CheckpointStore(tempfile.mkdtemp(), keep=2)
    >>> path = store.save(3, {"w": jnp.arange(4.0)}, {"note": "x"})
    >>> store.wait()
    >>> state, meta = store.restore(3, {"w": jnp.zeros(4)})
    >>> state["w"].tolist(), meta["step"], os.path.basename(path)
    ([0.0, 1.0, 2.0, 3.0], 3, 'ckpt_00000003')
    >>> store.close()
    """

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True, read_only: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(directory)
        # read_only: a reader (export, generate) creates, cleans and deletes nothing.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None, step_prefix=STEP_PREFIX, step_format_fixed_length=STEP_DIGITS,
            create=not read_only, cleanup_tmp_directories=not read_only, enable_async_checkpointing=async_save,
            read_only=read_only)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    # ------------------------------------------------------------------ listing
    def path(self, step: int) -> str:
        """The directory of the checkpoint of ``step``."""
        return os.path.join(self.directory, f"{STEP_PREFIX}_{int(step):0{STEP_DIGITS}d}")

    def checkpoints(self) -> List[Tuple[int, str]]:
        """``(step, path)`` of every complete checkpoint (Orbax directories and
        legacy ``.npz`` files), oldest first."""
        found = [(int(s), self.path(s)) for s in self._manager.all_steps()]
        for path in legacy_npz.list_checkpoints(self.directory):
            found.append((int(os.path.basename(path)[len(STEP_PREFIX) + 1:-len(".npz")]), path))
        return sorted(found, key=lambda sp: (sp[0], sp[1].endswith(".npz")))

    def latest(self) -> Optional[str]:
        """The path of the newest checkpoint, or None."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    # ------------------------------------------------------------------ writing
    def save(self, step: int, state: Any, metadata: Optional[dict] = None) -> str:
        """Start writing ``state`` (sharded arrays) as the checkpoint of ``step``; returns its path.

        Returns once the arrays are copied off the devices (``state`` may be
        donated right after); `wait` for the files.
        """
        ocp = self._ocp
        meta = dict(metadata or {}, step=int(step))
        self._manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(to_tree(state)),
                                                               meta=ocp.args.JsonSave(meta)), force=True)
        return self.path(step)

    def wait(self) -> None:
        """Block until the checkpoint being written is complete (raising its write error, if any)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish the pending write and release the manager."""
        self._manager.close()

    # ------------------------------------------------------------------ reading
    def read_metadata(self, path: str) -> dict:
        """The ``meta`` item of a checkpoint (a legacy ``.npz``: its metadata entry).

        Raises:
          UnreadableCheckpointError: it cannot be read.
        """
        if path.endswith(".npz"):
            return legacy_npz.load(path)[1]
        try:
            meta = self._manager.restore(self._step_of(path), args=self._ocp.args.Composite(
                meta=self._ocp.args.JsonRestore()))["meta"]
        except Exception as err:  # orbax raises whatever its reader hit (JSON, UTF-8, tensorstore, OS)
            raise UnreadableCheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: {err}") from None
        if not isinstance(meta, dict):
            raise UnreadableCheckpointError(f"cannot read checkpoint {path}: its meta item is not a JSON object")
        return meta

    def restore(self, step_or_path, template: Any, shardings: Any = None) -> tuple:
        """``(state, metadata)`` of a checkpoint, leaves in ``template``'s structure.

        ``template``: arrays or `jax.ShapeDtypeStruct`; ``shardings`` (a tree
        like it, default: each template leaf's own, else the default device)
        says where each leaf is read to: any mesh, whatever it was saved on.

        Raises:
          CheckpointError: missing, unexpected or mis-shaped entries (listed).
          UnreadableCheckpointError: damaged or not a checkpoint.
        """
        path = step_or_path if isinstance(step_or_path, str) else self.path(step_or_path)
        meta = self.read_metadata(path)
        return self.restore_state(path, template, shardings), meta

    def restore_state(self, path: str, template: Any, shardings: Any = None) -> Any:
        """The ``state`` item of the checkpoint at ``path`` (see `restore`)."""
        if shardings is None:
            shardings = jax.tree_util.tree_map(lambda x: getattr(x, "sharding", None), template)
        if path.endswith(".npz"):
            arrays, _ = legacy_npz.load(path)
            values = legacy_npz.match(path, arrays, template)
            placed = [v if s is None else jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
                      for v, s in zip(values, jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: x is None))]
            return _rebuild(template, placed)
        step = self._step_of(path)
        try:
            stored = self._manager.item_metadata(step)["state"]
            shapes = {k: tuple(v.shape) for k, v in _leaves_by_path(dict(stored.tree)).items()}
        except Exception as err:
            raise UnreadableCheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: {err}") from None
        _check_fits(path, shapes, template)
        abstract: dict = {}
        sh_leaves = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: x is None)
        for (key, _, leaf), sharding in zip(_template_paths(template), sh_leaves):
            node = abstract
            for name in key[:-1]:
                node = node.setdefault(name, {})
            dtype = jnp.uint32 if _is_key(leaf) else leaf.dtype
            node[key[-1]] = jax.ShapeDtypeStruct(_stored_shape(leaf), dtype, sharding=sharding)
        try:
            tree = self._manager.restore(step, args=self._ocp.args.Composite(
                state=self._ocp.args.StandardRestore(abstract)))["state"]
        except Exception as err:
            raise UnreadableCheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: "
                                            f"{str(err).splitlines()[0] if str(err) else ''}") from None
        restored = _leaves_by_path(tree)
        return _rebuild(template, [restored[key] for key, _, _ in _template_paths(template)])

    def _step_of(self, path: str) -> int:
        name = os.path.basename(path.rstrip("/"))
        if not name.startswith(STEP_PREFIX + "_") or not name[len(STEP_PREFIX) + 1:].isdigit():
            raise CheckpointError(f"{path} is not a checkpoint of {self.directory}")
        return int(name[len(STEP_PREFIX) + 1:])

    def newest_readable(self, template: Any, shardings: Any = None,
                        check: Optional[Callable[[str, dict], None]] = None) -> tuple:
        """``(path, state, metadata, unreadable)`` of the newest checkpoint that reads.

        Newer ones that cannot be read are listed in ``unreadable`` as
        ``(path, error)`` (every process agrees on each verdict). ``check(path,
        metadata)`` runs on each candidate's metadata before its arrays are
        read (a config mismatch raises there, naming its cause). ``path`` is
        None when none reads.
        """
        unreadable = []

        def attempt(path, read):
            """``(True, read())``, or ``(False, None)`` with the error kept when any process failed to read."""
            try:
                value, err = read(), None
            except UnreadableCheckpointError as e:
                value, err = None, e
            if _agree(err is None):
                return True, value
            unreadable.append((path, err or UnreadableCheckpointError(f"checkpoint {path} is unreadable on "
                                                                      "another process")))
            return False, None

        for _, path in reversed(self.checkpoints()):
            ok, meta = attempt(path, lambda: self.read_metadata(path))
            if not ok:
                continue
            if check is not None:
                check(path, meta)
            ok, state = attempt(path, lambda: self.restore_state(path, template, shardings))
            if ok:
                return path, state, meta, unreadable
        return None, None, None, unreadable

    def set_aside(self, path: str) -> str:
        """Rename an unreadable checkpoint to ``<path>.unreadable`` (``.unreadable.1`` ...
        when taken; the first process renames, all agree) and return the new path: kept
        for inspection, never resumed, pruned or overwritten."""
        target, n = f"{path}.unreadable", 0
        while os.path.exists(target):
            n += 1
            target = f"{path}.unreadable.{n}"
        if jax.process_index() == 0:
            os.rename(path, target)
        _barrier(f"eae_jax set aside {os.path.basename(path)}")
        self._manager.reload()
        return target


# ---------------------------------------------------------------------- reading without a store
def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of the complete checkpoints in ``directory`` (Orbax step
    directories, legacy ``.npz`` files), oldest first, read from the names alone
    (an Orbax checkpoint gets its final name only once complete).

    >>> import tempfile
    >>> list_checkpoints(tempfile.mkdtemp())
    []
    """
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(directory, name))]
    found += [(int(os.path.basename(p)[len(STEP_PREFIX) + 1:-len(".npz")]), p)
              for p in legacy_npz.list_checkpoints(directory)]
    return sorted(found, key=lambda sp: (sp[0], sp[1].endswith(".npz")))


def latest(directory: str) -> Optional[str]:
    """The path of the newest checkpoint in ``directory``, or None (see `list_checkpoints`).

    >>> import tempfile
    >>> latest(tempfile.mkdtemp()) is None
    True
    """
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` names a checkpoint: an Orbax step directory or a legacy ``.npz``.

    >>> is_checkpoint("runs/x/checkpoints/ckpt_00000004"), is_checkpoint("runs/x/log.jsonl")
    (True, False)
    """
    name = os.path.basename(path.rstrip("/"))
    return bool(_STEP_DIR.match(name)) or (name.startswith(STEP_PREFIX + "_") and name.endswith(".npz"))


def read_metadata(path: str) -> dict:
    """The metadata of the checkpoint at ``path`` (its run's config and step), read-only.

    Raises:
      UnreadableCheckpointError: it cannot be read.

    >>> import tempfile
    >>> store = CheckpointStore(tempfile.mkdtemp())
    >>> path = store.save(5, {"w": jnp.ones(2)}, {"note": "x"})
    >>> store.wait()
    >>> read_metadata(path)
    {'note': 'x', 'step': 5}
    """
    if path.endswith(".npz"):
        return legacy_npz.load(path)[1]
    store = CheckpointStore(os.path.dirname(os.path.abspath(path)), read_only=True)
    try:
        return store.read_metadata(path)
    finally:
        store.close()


def restore(path: str, template: Any, shardings: Any = None) -> tuple:
    """``(state, metadata)`` of the checkpoint at ``path``, read-only (`CheckpointStore.restore`).

    >>> import tempfile
    >>> store = CheckpointStore(tempfile.mkdtemp())
    >>> path = store.save(1, {"w": jnp.arange(3.0)})
    >>> store.wait()
    >>> restore(path, {"w": jnp.zeros(3)})[0]["w"].tolist()
    [0.0, 1.0, 2.0]
    """
    if path.endswith(".npz"):
        arrays, meta = legacy_npz.load(path)
        values = legacy_npz.match(path, arrays, template)
        return _rebuild(template, [jnp.asarray(v) for v in values]), meta
    store = CheckpointStore(os.path.dirname(os.path.abspath(path)), read_only=True)
    try:
        return store.restore(path, template, shardings)
    finally:
        store.close()
