"""``eae-jax train --memory-budget``: plan the run's stack (and optimizer placement) under a budget.

The run's step is the stack's gradient step on one micro-batch (its loss,
passes and fp8 seams included) plus the optimizer state and the gradient
accumulator. `plan_run` measures the stack's storage options on that step
(`eae_jax.reconstruct.plan_memory`, per device under a data mesh), picks
the fastest plan that fits the budget less the accumulator, logs the plan
table, and returns the planned stack and the optimizer: AdamW itself, or
AdamW with its state in pinned host memory (`eae_jax.offload_optim`) when
the plan moved it there.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from eae_jax.offload_optim import OffloadedOptimizer, host_kind_refused, host_memory_kind, offload_optimizer
from eae_jax.reconstruct import Plan, parse_budget, plan_memory
from eae_jax.reconstruct.costs import Option, float_bytes, nbytes, shard_bytes
from eae_jax.reconstruct.planner import BudgetError, fmt_bytes


def parse_memory_budget(text: str) -> Union[int, float]:
    """``--memory-budget`` as bytes or a fraction: a number without a unit up
    to 1 is a fraction of plain autodiff's activations (``0.5``, ``1``),
    anything else bytes (``6GiB``, ``512MiB``, ``8e9``).

    Raises:
      ValueError: unreadable, zero or negative (named).

    >>> parse_memory_budget("6GiB"), parse_memory_budget("0.5"), parse_memory_budget("1"), parse_memory_budget("4096")
    (6442450944, 0.5, 1.0, 4096)
    """
    if not isinstance(text, str):
        raise ValueError(f"memory_budget must be a string such as '6GiB' or '0.5', got {text!r}")
    if re.fullmatch(r"\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*", text):
        value = float(text)
        if value <= 0:
            raise ValueError(f"memory budget must be > 0, got {text!r}")
        if value <= 1:
            return value
    try:
        return parse_budget(text)
    except ValueError as err:
        raise ValueError(f"memory_budget: {err}; a fraction of plain autodiff's activations is a number in "
                         "(0, 1]") from None


class RunPlan(NamedTuple):
    """What `plan_run` decided: the planned ``stack``, the optimizer ``tx``
    (an `OffloadedOptimizer` when the state lives in host memory), the
    `Plan`, and the bytes set aside for the gradient accumulator.

    >>> RunPlan(None, None, None, 0).reserved
    0
    """

    stack: Any
    tx: Any
    plan: Optional[Plan]
    reserved: int

    @property
    def offloaded(self) -> bool:
        """Whether the optimizer state lives in host memory."""
        return isinstance(self.tx, OffloadedOptimizer)

    def summary(self) -> dict:
        """The plan as plain data for the run's summary."""
        return {**self.plan.to_dict(), "reserved_for_grad_accumulator": self.reserved,
                "optimizer_in_host_memory": self.offloaded}


class MeshPlanning(NamedTuple):
    """How `plan_run` measures a run laid over a mesh (`RunSharding.planning`):
    every byte it counts is then one device's.

    Attributes:
      in_shardings: ``f(segment param specs, token spec) -> in_shardings`` of
        a probe step ``(params, tokens, side, (targets,))``.
      wrap: ``wrap(storages) -> storages``: the storages the run's stack
        gives its segments on the mesh (`eae_jax.parallel.Sharded`).
      param_shardings: the `NamedSharding` of every param (the params' tree):
        the gradient accumulator's and the optimizer state's layout.
      options: the storage options that differ on this mesh.

    >>> MeshPlanning(None, None, None, ()).options
    ()
    """

    in_shardings: Callable
    wrap: Callable
    param_shardings: Any
    options: Sequence[Option]


def plan_run(budget: Union[int, float], stack, seg_params, micro_batch: int, seq_len: int, tx, params,
             accum_dtype, *, make_stack: Callable, host_tx: Callable, mesh: Optional[MeshPlanning] = None,
             loss: Callable, log_fn: Callable = print, costs=None) -> RunPlan:
    """Plan ``stack``'s storages and the optimizer placement under ``budget``.

    Args:
      budget: bytes or a fraction (`parse_memory_budget`), per device.
      stack: the run's stack (its storages are not used); ``seg_params`` its params.
      micro_batch, seq_len: one micro-batch's token shape (inputs and targets).
      tx, params: the optimizer on the device and the params it updates.
      accum_dtype: the gradient accumulator's dtype (its bytes are set aside).
      make_stack: ``make_stack(storages) -> stack``, the planned stack.
      host_tx: ``host_tx() -> OffloadedOptimizer``, the optimizer with its
        state in host memory, used when the plan moves it there.
      mesh: how the run lies over its mesh (`MeshPlanning`: the budget is
        per device), None for one device.
      loss: ``loss(logits, targets)``.
      costs: measured `eae_jax.reconstruct.Costs` of this step (None: measured here).

    Raises:
      BudgetError: the budget is below the floor (the message names it).

    >>> from eae_jax.reconstruct import Scan, reconstruct
    >>> stack = reconstruct([lambda t, tok: t[tok], Scan(lambda w, h: jnp.tanh(h @ w))])
    >>> params, tx = [jnp.ones((16, 4)), jnp.ones((2, 4, 4))], optax.adam(1e-3)
    >>> run = plan_run(1 << 20, stack, params, 2, 8, tx, params, jnp.float32,
    ...                make_stack=lambda s: reconstruct([lambda t, tok: t[tok], Scan(lambda w, h: jnp.tanh(h @ w))],
    ...                                                 storage=s),
    ...                host_tx=lambda: None, loss=lambda y, t: jnp.mean(y), log_fn=lambda line: None)
    >>> run.plan.compiled_peak <= run.plan.budget, run.offloaded
    (True, False)
    """
    accumulator = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, accum_dtype), params)
    opt_state = jax.eval_shape(tx.init, jax.eval_shape(lambda p: p, params))
    tokens = jax.ShapeDtypeStruct((micro_batch, seq_len), jnp.int32)
    if mesh is None:
        reserved, opt_bytes = nbytes(accumulator), nbytes(opt_state)
        seg_held = nbytes(seg_params) + float_bytes(seg_params)
    else:
        from eae_jax.parallel.lm import opt_state_shardings

        any_mesh = jax.tree_util.tree_leaves(mesh.param_shardings)[0].mesh
        reserved = shard_bytes(accumulator, mesh.param_shardings)
        opt_bytes = shard_bytes(opt_state, opt_state_shardings(tx, opt_state, mesh.param_shardings, any_mesh))
        seg_shardings = mesh.in_shardings(seg_params, tokens)[0]
        seg_held = shard_bytes(seg_params, seg_shardings) + shard_bytes(seg_params, seg_shardings, floats_only=True)
    if isinstance(budget, int):
        # Before any probe compiles: what every plan holds whatever it keeps.
        held = seg_held + reserved
        if budget < held:
            raise BudgetError(f"memory budget {fmt_bytes(budget)} is below the floor, which is at least "
                              f"{fmt_bytes(held)} ({budget} < {held} bytes): parameters, their gradients and the "
                              f"gradient accumulator, before any activation (optimizer state "
                              f"{fmt_bytes(opt_bytes)} more unless it moves to host memory)")
        budget -= reserved
    sharded = {} if mesh is None else dict(in_shardings=mesh.in_shardings, wrap=mesh.wrap, options=mesh.options)
    cpu_mesh = mesh is not None and host_kind_refused(any_mesh.size)
    plan = plan_memory(stack, seg_params, tokens, budget, loss=loss, loss_args=(tokens,), optimizer_bytes=opt_bytes,
                       costs=costs, offload_optimizer=False if cpu_mesh else "auto", **sharded)
    lines = [f"memory plan (per device; {fmt_bytes(reserved)} of the budget set aside for the gradient "
             "accumulator):", *plan.table().splitlines()]
    if cpu_mesh:
        lines.append("the optimizer state stays in device memory: on a CPU mesh of several devices it is not "
                     "moved to host memory (the same memory there)")
    run_tx = tx
    if plan.optimizer_offloaded:
        if host_memory_kind() is None:
            lines.append(f"the plan keeps the optimizer state ({fmt_bytes(opt_bytes)}) in host memory, but the "
                         f"{jax.default_backend()} backend has no pinned_host memory kind: it stays in device "
                         f"memory, and the step may need up to {fmt_bytes(opt_bytes)} beyond the budget")
        else:
            run_tx = host_tx()
            lines.append(f"optimizer state ({fmt_bytes(opt_bytes)}) in pinned host memory, streamed through the "
                         "device in chunks each step")
    for line in lines:
        log_fn(line)
    return RunPlan(make_stack(plan.storages), run_tx, plan, reserved)


def host_adamw(schedule: optax.Schedule, weight_decay: float, grad_clip: Optional[float]) -> OffloadedOptimizer:
    """The run's AdamW (global-norm clipping first) with its state in pinned host memory.

    >>> host_adamw(1e-3, 0.0, 1.0).grad_clip
    1.0
    """
    return offload_optimizer(optax.adamw(schedule, weight_decay=weight_decay), grad_clip=grad_clip or None)


__all__ = ["MeshPlanning", "RunPlan", "host_adamw", "parse_memory_budget", "plan_run"]
