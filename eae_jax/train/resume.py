"""Where a run resumes, what it refuses to resume, and the state it never saves."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.train.checkpoint import CheckpointStore
from eae_jax.train.errors import CheckpointError

#: Config fields a resumed run may change: bookkeeping, the schedule's length
#: (extending a run), and how (not what) it computes: where it runs included
#: (a checkpoint restores onto any mesh).
RESUME_MAY_CHANGE = ("steps", "out", "checkpoint_every", "keep", "resume", "log_every", "devices", "mesh",
                     "coordinator", "num_processes", "process_id", "policy", "offload", "val_every", "val_batches",
                     "quiet", "tensorboard", "plot", "peak_tflops", "profile")


def check_resumable(cfg, path: str, meta: dict) -> None:
    """Refuse to resume a checkpoint written with another config (the fields not in
    `RESUME_MAY_CHANGE`) or past ``cfg.steps``.

    >>> from eae_jax.train import TrainConfig
    >>> check_resumable(TrainConfig(steps=5), "ckpt_00000009", {"step": 9})
    Traceback (most recent call last):
    ...
    ValueError: checkpoint ckpt_00000009 is at step 9, past steps=5: pass --steps >= 9 to continue the run, ...
    """
    saved = meta.get("config")
    if isinstance(saved, dict):
        now = cfg.to_dict()
        diffs = []
        for name in sorted(set(saved) & set(now)):  # a field older checkpoints lack is not compared
            if name in RESUME_MAY_CHANGE or saved.get(name) == now.get(name):
                continue
            if name == "data" and saved.get(name) and now.get(name) and \
                    os.path.realpath(saved[name]) == os.path.realpath(now[name]):
                continue
            diffs.append(f"{name}: {saved.get(name)!r} in the checkpoint, {now.get(name)!r} now")
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was written with a different config; resuming it would not continue that run:"
                "\n  " + "\n  ".join(diffs) + "\nrerun with the checkpoint's settings, or pass a fresh --out")
    step = meta.get("step", 0)
    if isinstance(step, int) and step > cfg.steps:
        raise ValueError(f"checkpoint {path} is at step {step}, past steps={cfg.steps}: pass --steps >= {step} "
                         "to continue the run, or a fresh --out")


def kept(store: CheckpointStore) -> str:
    """What a failing run leaves behind: its newest checkpoint.

    >>> import tempfile
    >>> kept(CheckpointStore(tempfile.mkdtemp()))
    'no checkpoint in ... yet'
    """
    latest = store.latest()
    return f"last checkpoint kept: {latest}" if latest else f"no checkpoint in {store.directory} yet"


def resume_point(cfg, store: CheckpointStore, template: Any, shardings: Any, log_fn) -> tuple:
    """``(path, state, metadata)`` of the checkpoint to resume (Nones for a fresh run).

    The newest readable checkpoint whose config continues this run is read
    straight into ``shardings``; newer unreadable ones are moved aside to
    ``<name>.unreadable`` (never deleted) with a warning naming them.

    >>> import tempfile
    >>> from eae_jax.train import TrainConfig
    >>> resume_point(TrainConfig(), CheckpointStore(tempfile.mkdtemp()), None, None, print)  # nothing there yet
    (None, None, None)

    Raises:
      ValueError: resume is off but the directory holds checkpoints.
      CheckpointError: a config that does not continue the run, or none readable.
    """
    if not cfg.resume:
        if store.latest():
            raise ValueError(f"resume is off but {store.directory} already holds checkpoints (newest "
                             f"{store.latest()}); a fresh run there would mix its checkpoints and log with the old "
                             "run's: pass a fresh --out, or move the old run away")
        return None, None, None
    path, state, meta, unreadable = store.newest_readable(
        template, shardings, check=lambda p, m: check_resumable(cfg, p, m))
    if path is None and unreadable:
        raise CheckpointError(
            f"no readable checkpoint in {store.directory}: " + "; ".join(str(err) for _, err in unreadable)
            + ". Nothing was deleted: move them away to start afresh, or pass a fresh --out")
    for bad, err in unreadable:
        aside = store.set_aside(bad)
        log_fn(f"warning: {err}; moved aside to {aside} (not deleted); resuming from the older {path}")
    return path, state, meta


def nonfinite_leaves(tree: Any) -> list:
    """Tree paths of the floating leaves of ``tree`` holding a NaN or an infinity
    (one small device-to-host transfer for the whole tree, however it is sharded).

    >>> nonfinite_leaves({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.nan]), "n": jnp.int32(3)})
    ["['b']"]
    """
    named = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
             if jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, jnp.inexact)]
    if not named:
        return []
    finite = np.asarray(_all_finite([x for _, x in named]))
    return [name for (name, _), ok in zip(named, finite) if not ok]


@jax.jit
def _all_finite(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])
