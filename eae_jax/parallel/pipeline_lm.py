"""The LM of `eae_jax.models.llama` pipelined over the ``stage`` axis.

`PipelinedLM` is a drop-in for the reconstruct stack `lm_stack` makes (the
same ``init`` / call / ``update``, the same segment params, the same
per-boundary statistics) whose decoder blocks run as a GPipe pipeline
(`eae_jax.parallel.pipeline.gpipe`): the embedding feeds stage 0, every
stage is an `eae_jax.reconstruct` stack over its own blocks, and the head
takes the last stage's output, microbatch by microbatch.

Adjoint passes run where the whole-model stack would run them, with the
whole model's boundary indices: a stage applies them at its blocks'
inputs, the head stack at its input and the logits. Two differences from
the unpipelined stack, both only for passes that keep state: every
microbatch of a step sees the state the step started with (the carry then
holds the last microbatch's), and randomness is drawn per stage.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from eae_jax.blocks.transformer import decoder_block
from eae_jax.carry import bad_calls_message
from eae_jax.models.llama import embed, head
from eae_jax.parallel.pipeline import gpipe, last_ticks, relocate_pass, ticks
from eae_jax.passes.base import identity
from eae_jax.reconstruct import Scan, reconstruct


class PipelineCarry(NamedTuple):
    """The adjoint carries of a `PipelinedLM`.

    Attributes:
      stages: one stage stack's `AdjointCarry` per stage and tick (leading
        axes ``(S, M + S - 1)``, split over ``stage``).
      head: the head stack's carry per microbatch (leading axis ``M``).

    >>> PipelineCarry._fields
    ('stages', 'head')
    """

    stages: Any
    head: Any


def interleave_microbatches(tokens: jax.Array, microbatches: int) -> jax.Array:
    """Reorder a batch so that microbatch m (rows ``m*b .. m*b + b-1``) sits at rows
    ``m, m + M, m + 2M ...``: the order `PipelinedLM` takes, in which splitting a
    batch-sharded array into microbatches moves no data.

    >>> interleave_microbatches(jnp.arange(6), 2).tolist()
    [0, 3, 1, 4, 2, 5]
    """
    b = tokens.shape[0]
    if b % microbatches:
        raise ValueError(f"batch {b} does not split into {microbatches} microbatches")
    return tokens.reshape((microbatches, b // microbatches) + tokens.shape[1:]).swapaxes(0, 1).reshape(tokens.shape)


@jax.custom_vjp
def _scale_cotangent(x, factor):
    """``x``; its cotangent multiplied by ``factor`` on the way back."""
    return x


def _scale_fwd(x, factor):
    return x, factor


def _scale_bwd(factor, g):
    return jax.tree_util.tree_map(lambda t: (t * factor).astype(t.dtype), g), None


_scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def _split(x, m):
    """Interleaved batch ``(B, ...)`` -> microbatches ``(M, B/M, ...)``."""
    return x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)


def _merge(x):
    """``(M, B/M, ...)`` -> the interleaved batch ``(B, ...)``."""
    return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


class PipelinedLM:
    """The LM stack with its blocks pipelined over the mesh's ``stage`` axis.

    Call it as ``stack(segment_params, tokens, carry)`` with ``tokens`` in
    `interleave_microbatches` order (``(B, seq)``, ``B`` a multiple of
    ``microbatches``); float32 logits come back in the same order.

    >>> import jax
    >>> from eae_jax.blocks import BlockConfig
    >>> from eae_jax.models import LMConfig, init_lm, split_params
    >>> from eae_jax.parallel import make_mesh
    >>> cfg = LMConfig(16, 2, BlockConfig(8, 2, 1, 16))
    >>> params = split_params(init_lm(jax.random.key(0), cfg), cfg)
    >>> stack = PipelinedLM(cfg, make_mesh("data=1"), microbatches=2)
    >>> tokens = jnp.zeros((4, 3), jnp.int32)
    >>> carry = stack.init(params, tokens, jax.random.key(1))
    >>> stack(params, tokens, carry).shape
    (4, 3, 16)
    """

    def __init__(self, model, mesh, microbatches: int, block_fn=None, passes=None, boundary_dtype=None,
                 policy=None, offload=False, stats: bool = True):
        self.model, self.mesh, self.microbatches = model, mesh, int(microbatches)
        self.stages = dict(mesh.shape).get("stage", 1)
        if model.depth % self.stages:
            raise ValueError(f"pipeline over stage={self.stages}: depth {model.depth} does not split into "
                             f"{self.stages} equal block ranges")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.per_stage = model.depth // self.stages
        self.num_boundaries = model.depth + 3  # tokens, L block inputs, head input, logits
        chain = identity() if passes is None else passes
        per_stage = self.per_stage

        def stage_offset():
            return 1 + jax.lax.axis_index("stage") * per_stage

        common = dict(boundary_dtype=boundary_dtype, policy=policy, offload=offload, stats=stats)
        # Boundaries in gradient slots would hold a stage's param-sized buffers per tick: stored plainly.
        self.stage_stack = reconstruct(
            Scan(block_fn or decoder_block(model.block), "decoder_block"),
            passes=relocate_pass(chain, stage_offset, self.num_boundaries, skip_top_of=per_stage),
            boundaries_in_grads=False, **common)
        eps = model.block.norm_eps

        def lm_head(p, x):
            return head(p["final_norm"], p["table"], x, eps)

        self.head_stack = reconstruct(
            [lm_head], passes=relocate_pass(chain, lambda: jnp.int32(model.depth + 1), self.num_boundaries),
            **common)

    def _embed(self, table, tokens):
        return embed(table, tokens, self.model.block.compute_dtype)

    def init(self, params, tokens, key=None) -> PipelineCarry:
        """Carries for every stage, tick and microbatch (``params``, ``tokens``: shapes only)."""
        key = jax.random.key(0) if key is None else key
        embed_p, blocks, head_p = params
        m, s = self.microbatches, self.stages
        x = jax.eval_shape(lambda t, tok: _split(self._embed(t, tok), m)[0], embed_p, tokens)
        local = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // s,) + a.shape[1:], a.dtype),
                                       blocks)
        stage = [self.stage_stack.init(local, x, jax.random.fold_in(key, i)) for i in range(s)]
        stage = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *stage)
        count = ticks(s, m)
        stage = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a[:, None], (s, count) + a.shape[1:]), stage)
        top = self.head_stack.init([head_p], x, jax.random.fold_in(key, s))
        top = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (m,) + a.shape), top)
        return PipelineCarry(stage, top)

    def carry_shardings(self, carry: PipelineCarry) -> PipelineCarry:
        """Stage carries split over ``stage``, head carries replicated."""
        split, rep = NamedSharding(self.mesh, PartitionSpec("stage")), NamedSharding(self.mesh, PartitionSpec())
        return PipelineCarry(jax.tree_util.tree_map(lambda _: split, carry.stages),
                             jax.tree_util.tree_map(lambda _: rep, carry.head))

    def __call__(self, params, tokens, carry: PipelineCarry):
        m = self.microbatches
        if tokens.shape[0] % m:
            raise ValueError(f"batch {tokens.shape[0]} does not split into {m} microbatches")
        # A mean loss over the batch hands each microbatch 1/M of its own mean's
        # adjoint: the passes see that adjoint (as the unpipelined step's
        # microbatches do) and the param gradients get the 1/M back.
        embed_p, blocks, head_p = _scale_cotangent(params, jnp.float32(1.0 / m)) if m > 1 else params
        xs = _split(self._embed(embed_p, tokens), m)
        ys = gpipe(self.stage_stack, blocks, xs, self.mesh, per_tick=carry.stages)

        def head_one(_, item):
            y, c = item
            return None, self.head_stack([head_p], y, c)

        _, logits = jax.lax.scan(head_one, None, (ys, carry.head))
        logits = _merge(logits)
        return _scale_cotangent(logits, jnp.float32(m)) if m > 1 else logits

    def update(self, carry: PipelineCarry, carry_grad: PipelineCarry, strict: bool = True):
        """Fold the carries' cotangents in; returns ``(carry, stats)`` like `Reconstructed.update`
        (statistics of the last microbatch, one entry per boundary of the whole model)."""
        s, m = self.stages, self.microbatches
        rows, cols = jnp.arange(s), last_ticks(s, m)

        def pick(tree):
            return jax.tree_util.tree_map(lambda a: a[rows, cols], tree)

        new_stage, st = jax.vmap(lambda c, g: self.stage_stack.update(c, g, strict=False))(
            pick(carry.stages), pick(carry_grad.stages))
        last = jax.tree_util.tree_map(lambda a: a[m - 1], carry.head)
        new_head, hs = self.head_stack.update(last, jax.tree_util.tree_map(lambda a: a[m - 1], carry_grad.head),
                                              strict=False)
        count = ticks(s, m)
        new_stage = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a[:, None], (s, count) + a.shape[1:]),
                                           new_stage)
        new_head = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (m,) + a.shape), new_head)
        calls = jnp.minimum(jnp.min(st["calls"]), hs["calls"])
        if strict:
            jax.debug.callback(_raise_unless_one, calls, jnp.max(jnp.append(st["calls"], hs["calls"])))
        stats = {"step": hs["step"], "calls": calls}
        for name in ("adjoint_norm", "adjoint_norm_after_passes"):
            stats[name] = jnp.concatenate([jnp.zeros((1,), jnp.float32), st[name][:, :-1].reshape(-1), hs[name]])
        return PipelineCarry(new_stage, new_head), stats


def _raise_unless_one(low, high):
    for calls in (low, high):
        if float(calls) != 1.0:
            raise RuntimeError(bad_calls_message(calls))
