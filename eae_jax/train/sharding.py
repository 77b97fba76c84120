"""How a training run lays its state, its batches and its stack over a mesh.

`RunSharding` is built once per run from the mesh (``--mesh``): params,
gradients and AdamW moments follow `eae_jax.parallel.lm_param_shardings`
(split over ``fsdp`` and ``model``, block ranges over ``stage``); the
adjoint carry, step and key are replicated; token batches are split over
``data`` and ``fsdp``. The stack is `lm_stack` whose scanned blocks have the
`eae_jax.parallel.Sharded` storage (each block's params gathered when it
runs, its gradient reduce-scattered there, boundaries in the batch layout,
gradient slots only on one device), or the `PipelinedLM` when ``stage > 1``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from eae_jax.models.llama import lm_stack
from eae_jax.offload_optim import OffloadedOptimizer
from eae_jax.parallel.lm import lm_logical_axes, lm_param_shardings, opt_state_shardings
from eae_jax.parallel.mesh import format_mesh, make_mesh, mesh_size
from eae_jax.parallel.pipeline import bubble_fraction
from eae_jax.parallel.pipeline_lm import PipelinedLM, interleave_microbatches
from eae_jax.parallel.rules import tree_shardings, tree_specs
from eae_jax.parallel.storage import Sharded, storage_for_mesh
from eae_jax.reconstruct import storage_from_flags


def mesh_for(cfg) -> jax.sharding.Mesh:
    """The run's mesh: ``cfg.mesh``, else ``data=<cfg.devices>`` (default: every device on ``data``).

    >>> from eae_jax.train import TrainConfig
    >>> dict(mesh_for(TrainConfig(devices=1)).shape)
    {'data': 1, 'stage': 1, 'fsdp': 1, 'model': 1}
    """
    if cfg.mesh is not None:
        return make_mesh(cfg.mesh)
    count = jax.device_count() if cfg.devices is None else cfg.devices
    if count > jax.device_count():
        raise ValueError(f"devices={cfg.devices} but {jax.device_count()} are available")
    return make_mesh({"data": count})


class RunSharding:
    """The layout of one training run over ``mesh`` (see the module doc).

    >>> from eae_jax.train import TrainConfig
    >>> cfg = TrainConfig(batch=4)
    >>> run = RunSharding(cfg, cfg.model(), mesh_for(TrainConfig(devices=1)))
    >>> run.describe()
    'mesh data=1 (1 device)'
    """

    def __init__(self, cfg, model, mesh):
        self.mesh, self.model = mesh, model
        self.sizes = {axis: mesh_size(mesh, axis) for axis in mesh.axis_names}
        self.stages = self.sizes.get("stage", 1)
        self.microbatches = cfg.microbatches
        self.batch_axes = tuple(a for a in ("data", "fsdp") if self.sizes.get(a, 1) > 1)
        lm_logical_axes(model, mesh)  # heads that do not split over `model` fail here, before a build
        shards = mesh_size(mesh, *self.batch_axes)
        micro = cfg.batch // cfg.microbatches
        if micro % shards:
            raise ValueError(f"mesh {format_mesh(self.sizes)}: the micro-batch of {micro} sequences does not split "
                             f"over the {shards} devices of {' x '.join(self.batch_axes)}")
        if self.stages > 1:
            if mesh_size(mesh, "fsdp", "model") > 1:
                raise ValueError(f"mesh {format_mesh(self.sizes)}: a pipeline (stage > 1) combines with data "
                                 "parallelism only; drop fsdp and model, or the stage axis")
            if model.depth % self.stages:
                raise ValueError(f"mesh {format_mesh(self.sizes)}: depth {model.depth} does not split into "
                                 f"{self.stages} stages of equal block ranges")

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    def describe(self) -> str:
        """One line: the mesh, and a pipeline's bubble."""
        line = f"mesh {format_mesh(self.sizes)} ({self.mesh.size} device{'s' if self.mesh.size > 1 else ''})"
        if self.pipelined:
            line += (f"; GPipe over {self.stages} stages x {self.microbatches} microbatches, bubble fraction "
                     f"{bubble_fraction(self.stages, self.microbatches):.3f}")
        return line

    # ------------------------------------------------------------------ layout
    def param_shardings(self, params: Any) -> dict:
        return lm_param_shardings(self.model, params, self.mesh)

    def block_specs(self) -> dict:
        """One block's param specs (no depth axis), for `gather_block`."""
        block_axes = lm_logical_axes(self.model, self.mesh)["blocks"]
        one = jax.tree_util.tree_map(lambda lg: lg[1:], block_axes, is_leaf=lambda x: isinstance(x, tuple))
        shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, "float32"), self.model.block.param_shapes(),
                                        is_leaf=lambda x: isinstance(x, tuple))
        return tree_specs(one, shapes, self.mesh)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def state_shardings(self, state, tx, stack) -> Any:
        """Shardings of a `TrainState` (params, moments split; the rest replicated)."""
        rep = self.replicated()
        params = self.param_shardings(state.params)
        carry = (stack.carry_shardings(state.carry) if isinstance(stack, PipelinedLM)
                 else jax.tree_util.tree_map(lambda _: rep, state.carry))
        # An optimizer whose state lives in host memory places it itself (`OffloadedOptimizer.place`).
        opt = (jax.tree_util.tree_map(lambda _: rep, state.opt_state) if isinstance(tx, OffloadedOptimizer)
               else opt_state_shardings(tx, state.opt_state, params, self.mesh))
        return type(state)(rep, params, opt, carry, rep,
                           jax.tree_util.tree_map(lambda _: rep, state.fp8))

    def jit_step(self, step_fn, state_shardings):
        """``step_fn(state, tokens) -> (state, metrics)`` jitted over this mesh: the state in
        ``state_shardings`` (donated), the token block in `tokens_sharding`, metrics replicated."""
        return jax.jit(step_fn, in_shardings=(state_shardings, self.tokens_sharding()),
                       out_shardings=(state_shardings, self.replicated()), donate_argnums=(0,))

    def tokens_sharding(self) -> NamedSharding:
        """Of a step's token block ``(microbatches, micro_batch, seq + 1)`` (see `arrange_tokens`)."""
        return NamedSharding(self.mesh, PartitionSpec(None, *self._batch_spec(), None))

    def arrange_tokens(self, tokens):
        """A step's ``(batch, seq + 1)`` tokens as the step takes them: split into
        microbatches, or (pipeline) one block of interleaved microbatches."""
        if self.pipelined:
            return interleave_microbatches(tokens, self.microbatches)[None]
        return tokens.reshape((self.microbatches, tokens.shape[0] // self.microbatches) + tokens.shape[1:])

    # ------------------------------------------------------------------ stack
    def stack(self, cfg, passes, block_fn=None, fp8: bool = False, storage=None):
        """The run's stack over this mesh (``block_fn``: the fp8 block, or None; ``storage``: a
        memory plan's storages of the embedding, the blocks and the head, or None for the flags')."""
        if self.pipelined:
            if storage is not None:
                raise ValueError("a memory plan's storages do not apply to a pipeline (stage > 1)")
            return PipelinedLM(self.model, self.mesh, self.microbatches, block_fn=block_fn, passes=passes,
                               boundary_dtype=cfg.boundary_dtype, policy=cfg.policy, offload=cfg.offload)
        flags = storage_from_flags(cfg.policy, cfg.offload, cfg.boundary_dtype)
        return lm_stack(self.model, block_fn=block_fn, passes=passes,
                        storage=self.wrap_storages([flags] * 3 if storage is None else storage, fp8))

    def wrap_storages(self, storages, fp8: bool = False) -> list:
        """The storages of the embedding, the blocks and the head as the stack
        runs them on this mesh: the blocks' in `Sharded` (their params gathered
        over ``fsdp`` when they run, boundaries in the batch layout), each one
        as `storage_for_mesh` has it."""
        embed, inner, head = storages
        specs = self.block_specs()
        blocks = Sharded(inner, self.mesh, {"params": specs, "fp8": None} if fp8 else specs, gather=("fsdp",),
                         x_spec=self._batch_spec())
        return [storage_for_mesh(embed, self.mesh), blocks, storage_for_mesh(head, self.mesh)]

    def _batch_spec(self) -> PartitionSpec:
        axes = self.batch_axes
        return PartitionSpec((axes[0] if len(axes) == 1 else axes) or None)

    def planning(self, params, fp8: bool = False):
        """How `eae_jax.train.budget.plan_run` measures this run's step
        (`MeshPlanning`): probes jitted with the run's param and batch
        layouts, the blocks' storages wrapped as the stack wraps them, and
        gradient slots left out where the mesh makes them plain device
        boundaries (`storage_for_mesh`)."""
        from eae_jax.reconstruct import default_options
        from eae_jax.train.budget import MeshPlanning

        if self.pipelined:
            raise ValueError(f"--memory-budget plans a stack of blocks, not a pipeline: mesh "
                             f"{format_mesh(self.sizes)} has stage > 1 (drop --memory-budget or the stage axis)")
        logical = lm_logical_axes(self.model, self.mesh)
        head_table = logical["embed"] if self.model.tie_embeddings else logical["lm_head"]
        seg_logical = [logical["embed"], logical["blocks"], {"final_norm": logical["final_norm"], "table": head_table}]
        rep, batch = self.replicated(), NamedSharding(self.mesh, self._batch_spec())

        def in_shardings(seg_specs, x_spec):
            embed, blocks, head = seg_specs
            shards = tree_shardings(seg_logical, [embed, blocks["params"] if fp8 else blocks, head], self.mesh)
            if fp8:
                shards[1] = {"params": shards[1], "fp8": jax.tree_util.tree_map(lambda _: rep, blocks["fp8"])}
            return shards, batch, None, (batch,)

        options = tuple(o for o in default_options() if storage_for_mesh(o.storage, self.mesh) is o.storage)
        return MeshPlanning(in_shardings, lambda storages: self.wrap_storages(storages, fp8),
                            self.param_shardings(params), options)
