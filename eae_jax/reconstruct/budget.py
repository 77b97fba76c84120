"""Memory-budget reconstruction: the fastest step of a stack that fits a given memory.

`plan_memory` measures what each storage option costs every segment of a
stack (`eae_jax.reconstruct.costs`), chooses the fastest plan under the
budget (`eae_jax.reconstruct.planner`), compiles the planned step once to
check it (tightening the plan by what the compiled step needs beyond the
prediction) and returns the `Plan`::

    plan = plan_memory(stack, params, x, "6GiB", optimizer=tx)
    print(plan)                                     # per run: kept where, bytes, time
    stack = reconstruct(blocks, storage=plan.storages)

``reconstruct(blocks, memory_budget=...)`` does the same on its first call
for each input shape (a `MemoryBudget` carries the planning options).
The budget is per device: under a mesh the probes compile sharded, and
their ``memory_analysis()`` is one device's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from eae_jax.reconstruct.costs import (Costs, Option, compiled_peak, default_loss, measure_costs, nbytes,
                                       stack_output)
from eae_jax.reconstruct.planner import BudgetError, Plan, fmt_bytes, make_plan, parse_budget


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """A memory budget and how to plan for it (see `plan_memory` for each field).

    >>> MemoryBudget("6GiB").bytes_or_fraction
    6442450944
    """

    budget: Any
    optimizer_bytes: int = 0
    offload_optimizer: Any = "auto"
    loss: Optional[Callable] = None
    loss_args: Sequence = ()
    timing: str = "flops"
    options: Optional[Sequence[Option]] = None
    costs: Optional[Costs] = None
    mesh: Any = None
    verify: bool = True
    reserve: Any = "auto"

    @property
    def bytes_or_fraction(self):
        """The budget parsed (`parse_budget`)."""
        return parse_budget(self.budget)

    def __post_init__(self):
        parse_budget(self.budget)  # a bad budget fails when given, not at the first call


def plan_memory(stack, params, x, budget, side=None, *, loss: Optional[Callable] = None, loss_args: Sequence = (),
                optimizer: Any = None, optimizer_bytes: Optional[int] = None, offload_optimizer: Any = "auto",
                options: Optional[Sequence[Option]] = None, timing: str = "flops", costs: Optional[Costs] = None,
                mesh: Any = None, in_shardings: Optional[Callable] = None, wrap: Optional[Callable] = None,
                verify: bool = True, reserve: Any = "auto") -> Plan:
    """The fastest storage plan of ``stack`` whose step fits ``budget`` (per device).

    Args:
      stack: a `Reconstructed` (its own storages are not used).
      params, x, side: the step's inputs, or their shapes.
      budget: bytes (``6 << 30``, ``'6GiB'``) or a fraction in (0, 1] of the
        activations plain autodiff keeps, on top of params, gradients and
        optimizer state (torch's ``activation_memory_budget`` convention).
      loss, loss_args: the step's loss, ``loss(output, *loss_args)``
        (default: the output's sum); its working memory counts.
      optimizer: an optax transformation whose state the step keeps (its
        bytes from ``init`` on the params' shapes), or ``optimizer_bytes``.
      offload_optimizer: ``'auto'``: the state goes to pinned host memory
        (`eae_jax.offload_optim`) when it does not fit or when that is
        faster; True / False force it.
      options, timing: see `measure_costs`; ``costs`` skips measuring.
      mesh: None, or a `jax.sharding.Mesh` whose first axis splits the batch
        (axis 0 of ``x``), params replicated: probes compile for it.
      in_shardings: instead of ``mesh``, any layout: ``f(param_specs,
        x_spec) -> in_shardings`` of the step ``(params, x, side,
        loss_args)`` (params split over FSDP or tensor-parallel axes:
        every byte counted is then one device's).
      wrap: ``wrap(storages) -> storages`` the stack runs with (e.g. each
        wrapped in `eae_jax.parallel.Sharded`); probes and the verifying
        compile run those, the plan keeps the unwrapped ones.
      verify: compile the planned step once; when it needs more than the
        budget, plan again leaving that much unused and compile that plan
        (up to `REPLANS` times).
      reserve: bytes of the budget left free for what the runtime allocates
        beside the compiled step (GEMM library workspaces, the allocator's
        rounding); ``'auto'``: `runtime_reserve`.

    Returns:
      A `Plan`: ``print(plan)``; ``reconstruct(blocks, storage=plan.storages)``.

    Raises:
      BudgetError: the budget is below the floor (the message names it),
        or with ``verify`` the last plan's compiled step still needs more.

    >>> import jax.numpy as jnp
    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w))
    >>> plan = plan_memory(stack, jnp.ones((4, 8, 8)), jnp.ones((2, 8)), "1MiB")
    >>> [s.runs for s in plan.segments], plan.compiled_peak <= plan.budget
    ([((4, 'everything'),)], True)
    """
    if optimizer is not None and optimizer_bytes is not None:
        raise ValueError("give optimizer or optimizer_bytes, not both")
    if optimizer is not None:
        optimizer_bytes = nbytes(jax.eval_shape(optimizer.init, jax.eval_shape(lambda p: p, params)))
    if mesh is not None and in_shardings is not None:
        raise ValueError("give mesh (data parallel) or in_shardings, not both")
    shardings = in_shardings if mesh is None else _data_parallel(mesh)
    if costs is None:
        costs = measure_costs(stack, params, x, side, loss=loss, loss_args=loss_args, options=options, timing=timing,
                              in_shardings=shardings, wrap=wrap)
    kw = dict(options=options, optimizer_bytes=optimizer_bytes or 0, offload_optimizer=offload_optimizer)
    reserve = runtime_reserve() if reserve == "auto" else int(reserve)
    if reserve < 0:
        raise ValueError(f"reserve must be 'auto' or a byte count >= 0, got {reserve}")
    def planned(margin):
        return dataclasses.replace(make_plan(costs, budget, margin=margin, **kw), reserve=reserve)

    margin = reserve
    plan = planned(margin)
    if not verify:
        return plan
    for replans in range(REPLANS + 1):
        peak = step_peak(stack, plan, params, x, side, loss=loss, loss_args=loss_args, in_shardings=shardings,
                         wrap=wrap)
        peak += plan.optimizer
        if peak + reserve <= plan.budget:
            return dataclasses.replace(plan, compiled_peak=int(peak))
        if replans < REPLANS:
            margin += peak + reserve - plan.budget
            plan = planned(margin)
    # the last plan was compiled too: its step, not an earlier one's, is what does not fit
    raise BudgetError(f"memory budget {fmt_bytes(plan.budget)}: the compiled step still needs {fmt_bytes(peak)} + "
                      f"{fmt_bytes(reserve)} kept free after {REPLANS} plans, each leaving what the last one needed "
                      f"beyond its prediction unused (predicted {fmt_bytes(plan.peak)})")


#: Times `plan_memory` plans again after a verifying compile needed more than the budget.
REPLANS = 3


#: Bytes an accelerator's runtime allocates beside a compiled step (cuBLAS and
#: cuDNN workspaces, allocator rounding); docs/reconstruct.md has the measurement.
ACCELERATOR_RESERVE = 64 << 20


def runtime_reserve(device=None) -> int:
    """Bytes `plan_memory` keeps free by default: `ACCELERATOR_RESERVE` on a
    GPU or TPU, 0 on the CPU (whose compiled peak is what it allocates).

    >>> runtime_reserve(jax.devices("cpu")[0])
    0
    """
    device = device or jax.devices()[0]
    return 0 if device.platform == "cpu" else ACCELERATOR_RESERVE


def planned_for(stack, plans: dict, params, x, side=None) -> Plan:
    """The plan of ``stack`` (built with a `MemoryBudget`) for inputs of these
    shapes, made by `plan_memory` once per shapes and kept in ``plans``.

    >>> import jax.numpy as jnp
    >>> from eae_jax.reconstruct import reconstruct
    >>> stack, plans = reconstruct(lambda w, x: jnp.tanh(x @ w), memory_budget="1MiB"), {}
    >>> planned_for(stack, plans, jnp.ones((4, 8, 8)), jnp.ones((2, 8))) is planned_for(
    ...     stack, plans, jnp.ones((4, 8, 8)), jnp.zeros((2, 8)))
    True
    """
    def spec(a):
        a = jnp.asarray(a) if not hasattr(a, "shape") else a
        return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)

    p, xs, s = (jax.tree_util.tree_map(spec, t) for t in (params, x, side))
    key = (jax.tree_util.tree_structure(p), tuple(jax.tree_util.tree_leaves(p)), xs,
           jax.tree_util.tree_structure(s), tuple(jax.tree_util.tree_leaves(s)))
    if key not in plans:
        b = stack.budget
        plans[key] = plan_memory(stack, p, xs, b.budget, s, loss=b.loss, loss_args=b.loss_args,
                                 optimizer_bytes=b.optimizer_bytes, offload_optimizer=b.offload_optimizer,
                                 options=b.options, timing=b.timing, costs=b.costs, mesh=b.mesh, verify=b.verify,
                                 reserve=b.reserve)
    return plans[key]


def step_peak(stack, plan: Plan, params, x, side=None, *, loss: Optional[Callable] = None, loss_args: Sequence = (),
              in_shardings: Optional[Callable] = None, wrap: Optional[Callable] = None) -> int:
    """The compiled peak (`compiled_peak`) of ``stack``'s gradient step under
    ``plan``'s storages (through ``wrap`` when given, as in `plan_memory`), at
    full depth, with ``loss`` (default the output's sum).

    >>> import jax.numpy as jnp
    >>> from eae_jax.reconstruct import reconstruct
    >>> stack = reconstruct(lambda w, x: jnp.tanh(x @ w))
    >>> plan = plan_memory(stack, jnp.ones((4, 8, 8)), jnp.ones((2, 8)), "1MiB", verify=False)
    >>> step_peak(stack, plan, jnp.ones((4, 8, 8)), jnp.ones((2, 8))) > 0
    True
    """
    from eae_jax.reconstruct.stack import Reconstructed

    storages = plan.storages if wrap is None else list(wrap(list(plan.storages)))
    planned = Reconstructed(stack.segments, stack.passes, storages, stack.collect_stats, stack._single,
                            stack.block_state)
    loss = loss or default_loss

    def step(p, xx, s, args):
        return jax.value_and_grad(lambda pp: loss(stack_output(planned, pp, xx, s), *args))(p)

    specs = jax.eval_shape(lambda *a: a, params, x, side, tuple(loss_args))
    jitted = jax.jit(step) if in_shardings is None else jax.jit(step, in_shardings=in_shardings(specs[0], specs[1]))
    return compiled_peak(jitted.lower(*specs).compile())


def _data_parallel(mesh):
    """Probe shardings for a data-parallel mesh: params replicated, the batch split over the first axis."""
    from jax.sharding import NamedSharding, PartitionSpec

    def shardings(p_spec, x_spec):
        rep = NamedSharding(mesh, PartitionSpec())
        batch = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
        return (jax.tree_util.tree_map(lambda _: rep, p_spec), batch, None, None)

    return shardings


__all__ = ["BudgetError", "MemoryBudget", "Plan", "plan_memory", "planned_for", "step_peak"]
