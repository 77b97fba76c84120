"""The measured storage costs of a ``--memory-budget`` run, kept in its run directory.

Measuring the costs compiles a probe per storage option and segment (minutes
for a large model on a GPU) and does not depend on the budget. A resumed run,
or a run of the same model in the same directory under another budget, reads
them back when everything they depend on is unchanged: the model, batch and
layout settings of its `TrainConfig`, the devices and the jax and eae_jax
versions. Anything else that differs is measured again, and the file rewritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional

import jax

from eae_jax.fileio import atomic_write_bytes
from eae_jax.reconstruct.costs import Costs

FILENAME = "memory_costs.json"

#: `TrainConfig` fields that change no shape, dtype, layout or program the probes compile.
UNRELATED = frozenset({"steps", "lr", "warmup", "weight_decay", "grad_clip", "seed", "out", "checkpoint_every",
                       "keep", "resume", "log_every", "coordinator", "process_id", "val_fraction", "val_every",
                       "val_batches", "quiet", "tensorboard", "plot", "peak_tflops", "profile", "memory_budget"})


def costs_key(cfg) -> dict:
    """What the measured costs of ``cfg``'s step depend on (a JSON-able dict).

    >>> from eae_jax.train import TrainConfig
    >>> a, b = costs_key(TrainConfig(steps=5)), costs_key(TrainConfig(steps=50, memory_budget="1GiB"))
    >>> a == b, a == costs_key(TrainConfig(batch=4))
    (True, False)
    """
    from eae_jax import __version__

    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in UNRELATED}
    devices = jax.devices()
    return {"config": json.loads(json.dumps(fields, default=str)), "backend": jax.default_backend(),
            "device_kind": devices[0].device_kind, "device_count": len(devices), "jax": jax.__version__,
            "eae_jax": __version__}


def load_costs(out: str, key: dict, log_fn: Callable = print) -> Optional[Costs]:
    """The costs saved in run directory ``out`` for ``key``, or None (no file, another key,
    or a file that does not parse: then the costs are measured again, and it says why).

    >>> import tempfile
    >>> load_costs(tempfile.mkdtemp(), {"config": {}}) is None
    True
    """
    path = os.path.join(out, FILENAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("key") != key:
            log_fn(f"memory costs in {path} were measured for another model, layout or device: measuring again")
            return None
        costs = Costs.from_json(doc["costs"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        log_fn(f"memory costs in {path} could not be read ({type(err).__name__}: {err}): measuring again")
        return None
    log_fn(f"memory costs reused from {path} (same model, layout and devices)")
    return costs


def save_costs(out: str, key: dict, costs: Costs) -> Optional[str]:
    """Write ``costs`` for ``key`` into run directory ``out`` atomically (process 0 only;
    nothing when ``out`` is not a directory). Returns the path written, or None.

    >>> import tempfile
    >>> from eae_jax.reconstruct.costs import Costs
    >>> d = tempfile.mkdtemp()
    >>> c = Costs([], "device", 100, 1e-3, 40, 40, "flops", "cpu")
    >>> load_costs(d, {"k": 1}, log_fn=lambda m: None) is None, save_costs(d, {"k": 1}, c) is not None
    (True, True)
    >>> load_costs(d, {"k": 1}, log_fn=lambda m: None).base_peak
    100
    """
    if jax.process_index() != 0 or not os.path.isdir(out):
        return None
    path = os.path.join(out, FILENAME)
    atomic_write_bytes(path, json.dumps({"key": key, "costs": costs.to_json()}).encode())
    return path
