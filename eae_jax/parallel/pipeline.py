"""Pipeline parallelism over the mesh's ``stage`` axis: a GPipe schedule in `shard_map`.

The seed runtime's ``DistributedScheduler`` gives each rank a contiguous
range of blocks and sends the adjoint from rank to rank. Here the stacked
block params are split over ``stage`` along their depth axis (stage s holds
blocks ``s*L/S .. (s+1)*L/S - 1``), the batch is split into ``M``
microbatches, and `gpipe` runs ``M + S - 1`` ticks: at tick t stage s runs
microbatch ``t - s`` through its blocks (an `eae_jax.reconstruct` stack,
so each stage keeps only its own boundaries) and `jax.lax.ppermute` hands
the boundary to stage s+1. JAX differentiates the tick loop: the backward
runs the ticks in reverse, each stage reconstructing its blocks, and the
transposed ppermute sends every adjoint back to the stage before. Only the
``stage`` axis is manual; ``data``, ``fsdp`` and ``model`` stay automatic
inside, so an adjoint pass's global statistics (a norm, an int8 scale) are
still computed over the whole microbatch.

Each stage idles ``S - 1`` of the ``M + S - 1`` ticks, forward and
backward: `bubble_fraction`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from eae_jax.passes.base import AdjointTransformation, PassContext


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of stage-ticks a GPipe schedule leaves idle: ``(S - 1) / (M + S - 1)``.

    >>> bubble_fraction(4, 8)
    0.2727272727272727
    >>> bubble_fraction(1, 8)
    0.0
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages} and {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def ticks(stages: int, microbatches: int) -> int:
    """Ticks of a GPipe forward (and of its backward): ``M + S - 1``.

    >>> ticks(4, 8)
    11
    """
    return microbatches + stages - 1


def last_ticks(stages: int, microbatches: int) -> jax.Array:
    """Per stage, the tick at which it runs the last microbatch: ``M - 1 + s``.

    >>> last_ticks(3, 2).tolist()
    [1, 2, 3]
    """
    return microbatches - 1 + jnp.arange(stages)


def gpipe(stage_fn: Callable, params: Any, xs: jax.Array, mesh, per_tick: Any = None, axis: str = "stage"):
    """Run ``stage_fn`` over the ``axis`` stages of ``mesh`` on ``M`` microbatches, GPipe-scheduled.

    Args:
      stage_fn: ``stage_fn(params_s, x, extra) -> y`` with ``y`` shaped like
        ``x``: one stage's blocks (``params_s`` is that stage's slice of
        ``params``) on one microbatch; ``extra`` is that stage's entry of
        ``per_tick`` for the tick (None when ``per_tick`` is None).
      params: pytree whose leaves carry a leading axis split over ``axis``
        (the stacked blocks; ``S`` must divide it).
      xs: ``(M, ...)`` the first stage's input, one row per microbatch.
      mesh: a mesh with ``axis``; its other axes stay automatic inside.
      per_tick: optional pytree with leading axes ``(S, M + S - 1)``: an
        input per stage and tick (an adjoint carry per call, so that each
        call's cotangent comes out on its own instead of summed).

    Returns:
      ``(M, ...)``: the last stage's outputs, in microbatch order.

    Idle ticks (a stage before its first or after its last microbatch)
    run the stage on zeros, cut off from everything else: their input is
    zeros, their output reaches only other idle ticks, and their param
    gradients are dropped (a pass that makes a nonzero adjoint out of a zero
    one leaks nothing). In lockstep SPMD an idle stage waits as long as it
    would compute; skipping it under a ``cond`` instead would make the
    stage's params a per-tick residual of the backward (one copy per tick).

    >>> import jax.numpy as jnp
    >>> from eae_jax.parallel import make_mesh
    >>> w = jnp.arange(1.0, 3.0)                        # two "blocks", one per stage when stage=2
    >>> run = lambda p, x, _: x * jnp.prod(p)
    >>> gpipe(run, w, jnp.ones((3, 2)), make_mesh("data=1")).tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """
    stages = dict(mesh.shape)[axis]
    m = xs.shape[0]
    count = ticks(stages, m)

    def body(p_local, xs, extra):
        s = jax.lax.axis_index(axis)
        extra = None if extra is None else jax.tree_util.tree_map(lambda a: a[0], extra)
        perm = [(i, (i + 1) % stages) for i in range(stages)]

        def tick(h, t):
            mb = t - s
            x_in = jnp.where(s == 0, xs[jnp.clip(t, 0, m - 1)], h)
            e_t = None if extra is None else jax.tree_util.tree_map(lambda a: a[t], extra)
            active = (mb >= 0) & (mb < m)
            y = stage_fn(_gate_grads(p_local, active), jnp.where(active, x_in, jnp.zeros_like(x_in)), e_t)
            return jax.lax.ppermute(y, axis, perm) if stages > 1 else y, y

        _, ys = jax.lax.scan(tick, jnp.zeros_like(xs[0]), jnp.arange(count))
        return ys[None]

    extra_spec = None if per_tick is None else jax.tree_util.tree_map(lambda _: PartitionSpec(axis), per_tick)
    # Under jit: outside one, shard_map's eager path mishandles partly manual meshes (jax 0.10).
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(axis), PartitionSpec(), extra_spec),
                                out_specs=PartitionSpec(axis), axis_names={axis}, check_vma=False))
    ys = run(params, xs, per_tick)  # (S, ticks, ...): the last stage's rows S-1 .. are the outputs
    return ys[stages - 1, stages - 1:]


@jax.custom_vjp
def _gate_grads(tree, on):
    """``tree``; its cotangent zeroed where ``on`` is false."""
    return tree


def _gate_fwd(tree, on):
    return tree, on


def _gate_bwd(on, g):
    return jax.tree_util.tree_map(lambda x: jnp.where(on, x, jnp.zeros_like(x)), g), None


_gate_grads.defvjp(_gate_fwd, _gate_bwd)


def relocate_pass(pass_: AdjointTransformation, offset: Callable[[], jax.Array], num_boundaries: int,
                  skip_top_of: int = -1) -> AdjointTransformation:
    """``pass_`` seen from a part of a stack: boundary indices moved by ``offset()``.

    A stage's stack numbers its boundaries from 0; the pass must see the
    whole model's index (``at_layers`` and friends) and count. ``offset`` is
    called where the pass runs (inside the stage, ``jax.lax.axis_index``).
    With ``skip_top_of=n`` the part's output boundary (local index ``n``) is
    left alone: the next part applies the pass to it as its own input.

    >>> from eae_jax.passes import clip_by_norm
    >>> p = relocate_pass(clip_by_norm(1.0), lambda: jnp.int32(5), num_boundaries=9, skip_top_of=2)
    >>> ctx = PassContext(jnp.int32(2), jnp.int32(2), jnp.int32(0), 3)
    >>> p.update(jnp.full(4, 3.0), p.init(jax.ShapeDtypeStruct((4,), jnp.float32), None), ctx)[0].tolist()
    [3.0, 3.0, 3.0, 3.0]
    """

    def update(adjoint, state, ctx):
        off = jnp.asarray(offset(), jnp.int32)
        moved = PassContext(ctx.boundary + off, ctx.block + off, ctx.step, num_boundaries)
        if skip_top_of < 0:
            return pass_.update(adjoint, state, moved)
        return jax.lax.cond(ctx.boundary == skip_top_of, lambda a, st: (a, st),
                            lambda a, st: pass_.update(a, st, moved), adjoint, state)

    return AdjointTransformation(pass_.init, update, pass_.name, pass_.members)
