"""`reconstruct`: boundary-only forward, block-by-block reconstruction backward.

Forward keeps only the block boundaries x0..x(L-1) (optionally in a lower
dtype, in the gradient buffers, or in pinned host memory). Backward walks
the blocks in reverse: it re-runs block i from its stored input x_i, takes
the block's local VJP with the adjoint at boundary i+1, hands the input
adjoint to the pass chain (`eae_jax.passes`), and continues. Homogeneous
blocks are scanned over a stacked params pytree, so compile time does not
grow with depth.

The mechanism is a `jax.custom_vjp` around the whole stack, so the result is
an ordinary differentiable function: use it inside your own loss, under
``jit``, ``grad``, ``value_and_grad(has_aux=True)``. Pass state and
per-boundary statistics come out of the backward pass as the cotangent of
an extra `AdjointCarry` argument (see `eae_jax.carry`)::

    stack = reconstruct(block_fn, passes=chain(int8_fake_quant(), clip_by_norm(1.0)))
    carry = stack.init(params, x, jax.random.key(0))

    def loss_fn(params, carry, x, y):
        return jnp.mean((stack(params, x, carry) - y) ** 2)

    @jax.jit
    def step(params, carry, x, y):
        loss, (g_params, g_carry) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, carry, x, y)
        carry, stats = stack.update(carry, g_carry)
        return loss, g_params, carry, stats

Storage
-------
What a segment's forward keeps for its backward is its `Storage`, one per
segment (``reconstruct(..., storage=[...])``; the keywords
``boundary_dtype``, ``offload``, ``policy`` and ``boundaries_in_grads``
pick one for all segments):

* `OnDevice` (``dtype``): the boundaries, in device memory.
* `GradSlots` (``dtype``, the default): a scanned run's boundaries inside
  the buffers that later receive its gradients (`eae_jax.grad_slots`).
* `Policy` (``policy``): also the block internals a `jax.checkpoint`
  policy names, kept as the residuals of each block's VJP.
* `Host` / `HostUnrolled` (``dtype``): the boundaries in pinned host
  memory, scanned runs kept as a scan or unrolled block by block.
* `Runs` (``((blocks, storage), ...)``): a scanned segment split into
  consecutive runs, each with its own storage (what a memory budget plans,
  `eae_jax.reconstruct.budget`).

The protocol, per segment and per call of the stack:

1. ``storage.bind(layout) -> Storage``, once, before the custom VJP
   exists. ``layout`` is the segment's `SegmentLayout` (its block
   function, depth, one block's param shapes, its input boundary's shape,
   the side input's shapes, its first boundary's index). The result serves
   the segment in both passes: ``self``, a copy holding what the shapes
   decide (`GradSlots` its slot plan, `Policy` its traced VJP), or another
   storage where this one does not apply. It is the one place a storage
   learns its segment's shapes, and so where shardings would reach it to
   place residuals under a mesh (a choice per mesh included).
2. Forward, one block: ``save(layout, params, x, side) -> (y, residual)``;
   ``y`` is the block's output as `SegmentLayout.call` returns it, which
   for a stack built with ``block_state=True`` is ``(y, new_state)``
   (`SegmentLayout.split` takes it apart; a scanned forward returns the
   states stacked, `SegmentLayout.join`).
3. Backward, one block: ``restore(layout, params, residual, g, side) ->
   (param grads, input adjoint)``.
4. A scanned segment runs ``forward(layout, params, x, side)`` and
   ``backward(layout, params, residuals, g, states, at, side)``; the base
   class scans over `save` and `restore` (``at`` applies the pass chain at
   each boundary, see `AtBoundary`). A storage that carries buffers across
   blocks or unrolls the run overrides these two.

A new storage is a small class. `BoundaryStorage` keeps each block's
input on the device (in its ``dtype``) and recomputes the block from it; a
subclass that keeps the boundary elsewhere overrides its `put` and `get`
(`Host`: two one-line methods around the device ones).
"""

from eae_jax.reconstruct.adjoint import AtBoundary
from eae_jax.reconstruct.budget import MemoryBudget, plan_memory, runtime_reserve
from eae_jax.reconstruct.costs import Costs, Option, default_options, measure_costs
from eae_jax.reconstruct.host import Host, HostUnrolled
from eae_jax.reconstruct.planner import BudgetError, Plan, make_plan, parse_budget
from eae_jax.reconstruct.policy import Policy, resolve_policy
from eae_jax.reconstruct.runs import Runs
from eae_jax.reconstruct.slots import GradSlots
from eae_jax.reconstruct.stack import OFFLOAD_SCHEDULES, Reconstructed, Scan, reconstruct, storage_from_flags
from eae_jax.reconstruct.storage import (BoundaryStorage, OnDevice, Segment, SegmentLayout, Storage, cast_boundary,
                                         first_order_only)

__all__ = [
    "AtBoundary", "BoundaryStorage", "BudgetError", "Costs", "GradSlots", "Host", "HostUnrolled", "MemoryBudget",
    "OFFLOAD_SCHEDULES", "OnDevice", "Option", "Plan", "Policy", "Reconstructed", "Runs", "Scan", "Segment",
    "SegmentLayout", "Storage", "cast_boundary", "default_options", "first_order_only", "make_plan", "measure_costs",
    "parse_budget", "plan_memory", "reconstruct", "resolve_policy", "runtime_reserve", "storage_from_flags",
]
