"""Multi-host start-up and per-process batches.

Every process of a multi-host run calls `initialize` first (before any JAX
computation), with the coordinator's address, the process count and its own
index, from flags or the environment variables launchers set
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
``coordinator='auto'`` lets JAX detect a Slurm, Open MPI or TPU cluster).
After that `jax.devices` lists every process's devices and a mesh spans them
all. On CPU the processes talk through the ``gloo`` collectives.

Each process then builds only its own rows of a batch
(`process_local_batch`); logs and checkpoint bookkeeping are written by the
first process (`is_primary`), while every process writes its own shards of
a checkpoint.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, Sequence

import jax
import numpy as np

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def settings(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
             process_id: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The `jax.distributed.initialize` arguments from flags, else the environment; None: one process.

    >>> settings("10.0.0.1:1234", 2, 1)
    {'coordinator_address': '10.0.0.1:1234', 'num_processes': 2, 'process_id': 1}
    >>> settings(environ={}) is None
    True
    >>> settings(environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    Traceback (most recent call last):
    ...
    ValueError: multi-host start-up needs the coordinator address, ...; missing: process id (--process-id or ...)

    Raises:
      ValueError: some but not all of them given, or a value that is not a number.
    """
    env = os.environ if environ is None else environ

    def number(value, name):
        if value is None or isinstance(value, int):
            return value
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name} must be an int, got {value!r}") from None

    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = number(num_processes if num_processes is not None else env.get("JAX_NUM_PROCESSES"),
                           "JAX_NUM_PROCESSES")
    process_id = number(process_id if process_id is not None else env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID")
    if coordinator == "auto":  # a cluster JAX detects by itself
        return {"num_processes": num_processes, "process_id": process_id}
    given = {"coordinator address (--coordinator or JAX_COORDINATOR_ADDRESS)": coordinator,
             "process count (--num-processes or JAX_NUM_PROCESSES)": num_processes,
             "process id (--process-id or JAX_PROCESS_ID)": process_id}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == len(given):
        return None
    if missing:
        raise ValueError("multi-host start-up needs the coordinator address, the process count and this "
                         f"process's id; missing: {', '.join(missing)}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in [0, {num_processes})")
    return {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id}


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> bool:
    """Join the multi-host run the flags or environment describe; returns whether one was joined.

    A no-op (False) for a single process, and (True) when already joined.

    >>> initialize()              # no flags, no JAX_* variables: one process
    False

    Raises:
      ValueError: incomplete settings (see `settings`).
      RuntimeError: JAX already computed something in this process (it
        must join before its first computation).
    """
    if jax.distributed.is_initialized():
        return True
    args = settings(coordinator, num_processes, process_id)
    if args is None:
        return False
    # Collectives between CPU processes (the default has none); GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**args)
    except RuntimeError as err:
        if "before any JAX calls" in str(err):
            raise RuntimeError("multi-host start-up must come before any JAX computation in the process "
                               f"(call eae_jax.parallel.initialize first): {err}") from None
        raise
    return True


def is_primary() -> bool:
    """Whether this is the process that writes logs and checkpoint bookkeeping (process 0).

    >>> is_primary()
    True
    """
    return jax.process_index() == 0


def process_local_batch(shape: Sequence[int], sharding, rows_at: np.ndarray,
                        load_rows: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
    """A global token array of ``shape`` whose leading axes index rows of a dataset,
    each process loading only the rows its devices hold.

    Args:
      shape: the global shape, e.g. ``(microbatches, micro_batch, seq + 1)``.
      sharding: where it goes (a `NamedSharding` over every process's devices).
      rows_at: int array of ``shape[:rows_at.ndim]``: the dataset row at each position.
      load_rows: ``load_rows(rows) -> array (len(rows),) + shape[rows_at.ndim:]``,
        called once per step with the distinct rows this process needs.

    >>> from jax.sharding import NamedSharding, PartitionSpec
    >>> from eae_jax.parallel import make_mesh
    >>> mesh = make_mesh("data=1")
    >>> rows_at = np.array([[0, 2], [1, 3]])
    >>> batch = process_local_batch((2, 2, 3), NamedSharding(mesh, PartitionSpec()), rows_at,
    ...                             lambda rows: np.repeat(rows[:, None], 3, axis=1))
    >>> batch[:, :, 0].tolist()
    [[0, 2], [1, 3]]
    """
    shape = tuple(shape)
    lead = rows_at.ndim
    indices = sharding.addressable_devices_indices_map(shape).values()
    needed = np.unique(np.concatenate([rows_at[tuple(idx[:lead])].ravel() for idx in indices]))
    local = np.asarray(load_rows(needed))
    where = {int(r): i for i, r in enumerate(needed)}

    def shard(idx):
        picked = rows_at[tuple(idx[:lead])]
        out = local[[where[int(r)] for r in picked.ravel()]]
        return out.reshape(picked.shape + out.shape[1:])[(slice(None),) * picked.ndim + tuple(idx[lead:])]

    return jax.make_array_from_callback(shape, sharding, shard)
