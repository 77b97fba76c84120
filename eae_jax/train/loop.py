"""The training loop: a jitted step around a reconstruct LM, checkpoints, logs.

One optimizer step takes a ``(microbatches, batch/microbatches, seq+1)``
token block, scans over the microbatches (gradients accumulated in
``grad_accum_dtype``; the adjoint carry threaded through every backward),
clips, applies AdamW, and returns metrics. The run is laid out over a mesh
(``--mesh``; `eae_jax.train.sharding.RunSharding`): data parallel by
default, FSDP, tensor parallel or pipelined on request; XLA inserts the
collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eae_jax.dtypes import parse_compute_dtype
from eae_jax.models.llama import cross_entropy, init_lm, lm_stack, split_params
from eae_jax.parallel.distributed import process_local_batch
from eae_jax.parallel.mesh import format_mesh
from eae_jax.parallel.pipeline import bubble_fraction
from eae_jax.train.checkpoint import CheckpointStore
from eae_jax.offload_optim import OffloadedOptimizer
from eae_jax.train.config import TrainConfig, parse_passes
from eae_jax.buffers import unalias
from eae_jax.text import save_tokenizer
from eae_jax.train.data import TokenFile, make_batches
from eae_jax.train.lock import RunLock
from eae_jax.train.monitor import RunMonitor
from eae_jax.train.resume import kept, nonfinite_leaves, resume_point
from eae_jax.train.rundir import JsonlLog, naming_writes, prepare_out
from eae_jax.train.sharding import RunSharding, mesh_for
from eae_jax.train.sources import prepare_run


class TrainState(NamedTuple):
    """Everything that changes from step to step (and is checkpointed).

    ``fp8`` holds the fp8 seams' state (scales and fallback ledgers, one per
    layer) for fp8 runs, else None.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    carry: Any
    key: jax.Array
    fp8: Any = None


def segment_params(params: dict, fp8_state: Any, model) -> list:
    """The LM stack's segment params, with the fp8 seam state beside the blocks when there is one."""
    embed_p, blocks, head_p = split_params(params, model)
    return [embed_p, blocks if fp8_state is None else {"params": blocks, "fp8": fp8_state}, head_p]


def bind_fp8(cfg: TrainConfig, model, params: dict, key: jax.Array, source: Optional[TokenFile] = None):
    """Calibrate and gate fp8 seams (qkv, o, ffn of every layer) on one batch.

    The calibration batch comes from the run's data stream (``key``; the
    token file ``source`` when given, else the synthetic task), embedded by
    the initial params. Raises `eae_jax.fp8.GateRefused` when a seam misses
    the parity gate.
    """
    from eae_jax import fp8
    from eae_jax.models.llama import embed

    tokens = make_batches(key, source, cfg.batch // cfg.microbatches, cfg.seq_len, model.vocab_size)[:, :-1]
    x0 = embed(params["embed"], tokens, model.block.compute_dtype)
    seams = fp8.policy_seams(cfg.policy_obj, activation=cfg.fp8_scaling, weight=cfg.fp8_weight_scaling)
    return fp8.bind_block(model.block, params["blocks"], [x0], seams, fallback=cfg.fp8_fallback)


def lr_schedule(cfg: TrainConfig, steps: Optional[int] = None) -> optax.Schedule:
    """Linear warm-up to ``cfg.lr`` over ``cfg.warmup`` steps, then cosine decay
    to a tenth of it at step ``steps`` (default ``cfg.steps``)."""
    warmup = max(cfg.warmup, 1)
    steps = cfg.steps if steps is None else steps
    # decay_steps counts the warm-up and must exceed it (steps=1 with warmup=0 used to raise in optax)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(steps, warmup + 1), cfg.lr * 0.1)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with `lr_schedule`, global-norm clipping first."""
    schedule = lr_schedule(cfg)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
    return optax.chain(*parts, optax.adamw(schedule, weight_decay=cfg.weight_decay))


def make_train_step(cfg: TrainConfig, stack, tx, model, bound_fp8=None, param_shardings=None):
    """Build ``step(state, tokens) -> (state, metrics)`` (not yet jitted).

    ``param_shardings`` (a tree of shardings like the params): every
    microbatch's gradients are constrained to it, so they are reduced
    straight into the params' layout (sharded for FSDP).

    ``tokens`` is int32 ``(microbatches, micro_batch, seq_len + 1)``.
    ``bound_fp8`` (from `bind_fp8`) folds the fp8 seams' ledgers and scales
    after every microbatch. With ``fallback='step'`` it folds once per step
    (`BoundBlock.fold_step`) and, when a seam call of the step failed its
    check, leaves params, optimizer state, adjoint carry and step number as
    they were and sets ``metrics['fp8_step_rejected']``: the caller reruns
    the step in high precision (a step built without ``bound_fp8``, which
    passes the fp8 state through untouched).
    """
    accum_dtype = parse_compute_dtype(cfg.grad_accum_dtype)
    step_fallback = bound_fp8 is not None and bound_fp8.fallback == "step"
    # Delayed weight scales: the weights are cast to fp8 once for a
    # microbatch's forward and recomputation (same results bit for bit as
    # quantizing them in every block call, half the weight passes).
    cast = bound_fp8 is not None and any(sm.recipe.weight == "delayed" for sm in bound_fp8.seams.values())

    def loss_fn(params, fp8_state, carry, tokens):
        logits = stack(segment_params(params, fp8_state if bound_fp8 is not None else None, model),
                       tokens[:, :-1], carry)
        with jax.named_scope("loss"):  # a stage of --profile, as the stack's forward.* / backward.* scopes
            return cross_entropy(logits, tokens[:, 1:])

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))

    def step(state: TrainState, tokens: jax.Array):
        # With the step guard every microbatch uses the step's state: cast once.
        step_fp8 = bound_fp8.cast_weights(state.fp8, state.params["blocks"]) if cast and step_fallback else state.fp8

        def micro(acc, mb_tokens):
            grads_acc, fp8_acc, carry = acc
            if step_fallback:
                fp8_state = step_fp8
            else:
                # fold moves the weight scales after each microbatch: cast at the current ones.
                fp8_state = bound_fp8.cast_weights(fp8_acc, state.params["blocks"]) if cast else fp8_acc
            loss, (grads, g_fp8, g_carry) = grad_fn(state.params, fp8_state, carry, mb_tokens)
            if param_shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, param_shardings)
            carry, stats = stack.update(carry, g_carry, strict=False)
            if step_fallback:
                fp8_acc = _add_observations(fp8_acc, g_fp8)
            elif bound_fp8 is not None:
                fp8_acc = bound_fp8.fold(fp8_state, g_fp8)
            grads_acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(accum_dtype), grads_acc, grads)
            return (grads_acc, fp8_acc, carry), (loss, stats)

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, accum_dtype), state.params)
        if param_shardings is not None:
            zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
        fp8_init = jax.tree_util.tree_map(jnp.zeros_like, state.fp8) if step_fallback else state.fp8
        (grads, fp8_state, carry), (losses, stats) = jax.lax.scan(micro, (zeros, fp8_init, state.carry), tokens)
        n = tokens.shape[0]
        grads = jax.tree_util.tree_map(lambda g, p: (g.astype(jnp.float32) / n).astype(p.dtype), grads, state.params)
        def apply_update(ops):
            grads_, opt_state_, params_ = ops
            with jax.named_scope("optimizer"):
                if isinstance(tx, OffloadedOptimizer):  # state in host memory, streamed chunk by chunk
                    return tx.apply(grads_, opt_state_, params_)
                updates, opt_state_ = tx.update(grads_, opt_state_, params_)
                return optax.apply_updates(params_, updates), opt_state_

        rejected = jnp.zeros((), jnp.bool_)
        if step_fallback:
            fp8_state, rejected = bound_fp8.fold_step(state.fp8, fp8_state)
            carry = jax.tree_util.tree_map(lambda old, new: jnp.where(rejected, old, new), state.carry, carry)
            # The update only when nothing failed (its branch computes it; the
            # other passes the old state through, a copy only on that rare path).
            params, opt_state = jax.lax.cond(rejected, lambda ops: (ops[2], ops[1]), apply_update,
                                             (grads, state.opt_state, state.params))
        else:
            params, opt_state = apply_update((grads, state.opt_state, state.params))
        metrics = {
            "loss": jnp.mean(losses),
            "grad_norm": optax.global_norm(grads),
            # per boundary x0..xL, from the last microbatch
            "adjoint_norm": stats["adjoint_norm"][-1],
            "adjoint_norm_after_passes": stats["adjoint_norm_after_passes"][-1],
            "carry_calls": jnp.min(stats["calls"]),
        }
        if bound_fp8 is not None:
            ledger = fp8_state  # per seam name: stacked over layers
            metrics["fp8_fallbacks"] = sum(jnp.sum(s.ledger.calls - s.ledger.fp8_calls) for s in ledger.values())
        if step_fallback:
            metrics["fp8_step_rejected"] = rejected
        new_state = TrainState(state.step + jnp.where(rejected, 0, 1).astype(state.step.dtype), params, opt_state,
                               carry, state.key, fp8_state)
        return new_state, metrics

    return step


def _add_observations(acc, g_fp8):
    """Combine microbatches' fp8 observations per seam (`eae_jax.observe.combine` of
    each handle: counts add up, every amax takes the maximum)."""
    from eae_jax.observe import combine

    return {n: a._replace(observed=type(a.observed)(*map(combine, a.observed, g_fp8[n].observed)))
            for n, a in acc.items()}


def _keys(cfg: TrainConfig):
    """(params, carry, data) keys of a run, all from ``cfg.seed``."""
    return jax.random.split(jax.random.key(cfg.seed), 3)


def init_state(cfg: TrainConfig, model, stack, tx, bound_fp8=None, params=None) -> TrainState:
    """Fresh params (unless given), optimizer state, adjoint carry and fp8 state from ``cfg.seed``."""
    k_params, k_carry, k_data = _keys(cfg)
    params = init_lm(k_params, model) if params is None else params
    fp8_state = None if bound_fp8 is None else bound_fp8.state
    example = jnp.zeros((cfg.batch // cfg.microbatches, cfg.seq_len), jnp.int32)
    carry = stack.init(segment_params(params, fp8_state, model), example, k_carry)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), carry, k_data, fp8_state)


def build(cfg: TrainConfig, source: Optional[TokenFile] = None, params: Optional[dict] = None,
          sharding: Optional[RunSharding] = None, materialize: bool = True, log_fn=print,
          plans: Optional[list] = None):
    """Model, stack, optimizer, bound fp8 seams (or None) and the initial state of a run.

    ``source``: the run's token file (None: the synthetic task), for the fp8 calibration batch.
    ``params``: the initial params (``--init``); None draws them from ``cfg.seed``.
    ``sharding``: the run's layout; the state is then made by one jitted
    call straight into its shardings (no device ever holds it whole).
    ``materialize=False`` returns ``make() -> state`` in the state's place
    (a resumed run never makes one: ``jax.eval_shape(make)`` is its template).
    With ``cfg.memory_budget`` the stack and the optimizer's placement are
    planned (`eae_jax.train.budget.plan_run`; ``log_fn`` gets the plan table,
    ``plans`` when given the `RunPlan`).
    """
    model = cfg.model()
    tx = make_optimizer(cfg)
    bound = planned = None
    if cfg.fp8 or cfg.memory_budget is not None:
        params = init_lm(_keys(cfg)[0], model) if params is None else params
    if cfg.fp8:
        bound = bind_fp8(cfg, model, params, jax.random.fold_in(_keys(cfg)[2], 2**31 - 1), source)
    if cfg.memory_budget is not None:
        run_plan = _plan_memory(cfg, model, bound, params, tx, sharding, log_fn)
        planned, tx = run_plan.stack.storage, run_plan.tx
        if plans is not None:
            plans.append(run_plan)
    stack = make_stack(cfg, model, bound, sharding, planned)

    def make(p=params):
        return init_state(cfg, model, stack, tx, bound, p)

    if sharding is not None and not isinstance(tx, OffloadedOptimizer):
        shardings = sharding.state_shardings(jax.eval_shape(make), tx, stack)
        make = functools.partial(jax.jit(make, out_shardings=shardings), params)
    return model, stack, tx, bound, make() if materialize else make


def _plan_memory(cfg: TrainConfig, model, bound, params, tx, sharding: Optional[RunSharding], log_fn):
    """The `RunPlan` of a ``--memory-budget`` run: per device, on a one-device or data-parallel mesh."""
    from eae_jax.train.budget import host_adamw, parse_memory_budget, plan_run

    mesh = None if sharding is None else sharding.mesh
    if sharding is not None and (sharding.pipelined or any(n > 1 for a, n in sharding.sizes.items() if a != "data")):
        raise ValueError(f"--memory-budget plans the step of one device or of a data-parallel mesh; mesh "
                         f"{format_mesh(sharding.sizes)} splits the params (fsdp, model or stage): drop one of them")
    micro = cfg.batch // cfg.microbatches
    per_device = micro // (mesh.size if mesh is not None else 1)
    return plan_run(parse_memory_budget(cfg.memory_budget), make_stack(cfg, model, bound),
                    segment_params(params, None if bound is None else bound.state, model), micro, cfg.seq_len,
                    tx, params, parse_compute_dtype(cfg.grad_accum_dtype),
                    make_stack=lambda storages: make_stack(cfg, model, bound, None, storages),
                    host_tx=lambda: host_adamw(lr_schedule(cfg), cfg.weight_decay, cfg.grad_clip),
                    mesh=mesh if per_device else None, loss=cross_entropy, log_fn=log_fn)


def make_stack(cfg: TrainConfig, model, bound_fp8=None, sharding: Optional[RunSharding] = None, storage=None):
    """The run's stack, with ``bound_fp8``'s block when given, laid out by ``sharding`` when given
    (``storage``: the planned storages of a ``memory_budget`` run)."""
    block_fn = None if bound_fp8 is None else bound_fp8.block_fn()
    if sharding is not None:
        return sharding.stack(cfg, parse_passes(cfg.passes), block_fn, fp8=bound_fp8 is not None, storage=storage)
    if storage is not None:
        return lm_stack(model, block_fn=block_fn, passes=parse_passes(cfg.passes), storage=storage)
    return lm_stack(model, block_fn=block_fn, passes=parse_passes(cfg.passes), boundary_dtype=cfg.boundary_dtype,
                    policy=cfg.policy, offload=cfg.offload)


#: Steps a delayed-gradient-scaling run waits for every seam to observe its
#: gradient scales before it gives up and stays with current scaling.
DELAYED_SWITCH_STEPS = 8


def _grad_scales_observed(bound_fp8, fp8_state) -> bool:
    """Whether every seam and layer has observed gradient scales (host check)."""
    try:
        bound_fp8.require_grad_scales(jax.device_get(fp8_state))
    except ValueError:
        return False
    return True


def _say_schedule_change(cfg: TrainConfig, meta: dict, step: int, log_fn) -> None:
    """Log how a resumed run's learning rate changes when ``steps`` (the cosine
    schedule's length) differs from the checkpoint's: the schedule is rebuilt
    for the new length, so the rate at the resumed step moves."""
    saved = (meta.get("config") or {}).get("steps")
    if not isinstance(saved, int) or saved == cfg.steps:
        return
    before, after = float(lr_schedule(cfg, saved)(step)), float(lr_schedule(cfg)(step))
    log_fn(f"steps changed from {saved} to {cfg.steps}: the cosine schedule now decays over {cfg.steps} steps; "
           f"the learning rate at step {step} moves from {before:.3e} to {after:.3e}")




class _ReadOnlyLog(JsonlLog):
    """The run's log as a process other than the first sees it: read, never written."""

    def write(self, record: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass


def _silent(*args, **kwargs):
    """The log function of every process but the first (logs are written once)."""


def train(cfg: TrainConfig, log_fn=print, until: Optional[int] = None) -> dict:
    """Run (or resume) a training run; returns a summary dict.

    ``until`` stops this invocation after that step (a checkpoint is written
    there) without changing the run's schedule, as a pre-empted job would.

    The run is laid out over ``cfg.mesh`` (`eae_jax.train.sharding`). With
    ``coordinator`` / ``num_processes`` / ``process_id`` (or the
    ``JAX_COORDINATOR_ADDRESS`` ... variables) every process of a multi-host
    run calls this; each loads only its rows of every batch, the first one
    writes the log, the tokenizer, TensorBoard files and the plot and holds
    the lock, all of them write their shards of every checkpoint.

    Writes ``<out>/log.jsonl`` (one record per logged step) and checkpoints
    under ``<out>/checkpoints`` (Orbax, `eae_jax.train.checkpoint`: sharded,
    written in the background, atomic; the newest readable one is resumed
    when ``cfg.resume``, onto whatever mesh this run has). The run holds
    ``<out>``'s lock (`RunLock`) throughout: a second run into the same
    ``out`` is refused.

    Resuming: an unreadable newest checkpoint (damaged, not a checkpoint)
    is moved aside to ``<name>.unreadable`` (never deleted) with a warning
    naming it, and the newest readable one is resumed; when none is
    readable the run is refused, naming them. ``.npz`` checkpoints of older
    runs resume too.

    Raises:
      ValueError / TypeError: a bad config, mesh, data file or output
        directory (before anything is built); CheckpointError: a checkpoint
        that does not continue this run, or none readable.
      RunLockedError: another live run holds ``out``.
      PermissionError / RunWriteError: ``out`` cannot be written (up front),
        or a write failed mid-run (the message names the step and file).
      FloatingPointError: the run diverged (the last good checkpoint is kept).
    """
    from eae_jax.parallel.distributed import initialize, is_primary

    initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    primary = is_primary()
    say = log_fn if primary else _silent
    # Fail on a bad --out, --data or --mesh before building (and compiling) anything.
    ckpt_dir = prepare_out(cfg.out)
    with RunLock(cfg.out, say) if primary else contextlib.nullcontext():
        store = CheckpointStore(ckpt_dir, keep=cfg.keep)
        try:
            summary = _train_locked(cfg, store, say, until, primary)
        except BaseException:
            try:
                store.close()  # the checkpoint being written completes; the error that stopped the run wins
            except Exception:
                pass
            raise
        store.close()
        return summary


def _train_locked(cfg: TrainConfig, store: CheckpointStore, log_fn, until: Optional[int], primary: bool) -> dict:
    run = prepare_run(cfg, log_fn)  # text, token file or synthetic; --init: they fix the vocabulary and shape
    cfg, source = run.config, run.train
    sharding = RunSharding(cfg, cfg.model(), mesh_for(cfg))
    log_fn(sharding.describe())
    plans = []
    model, stack, tx, bound_fp8, make_state = build(cfg, source, run.init_params, sharding, materialize=False,
                                                    log_fn=log_fn, plans=plans)
    run_plan = plans[0] if plans else None
    planned = None if run_plan is None else run_plan.stack.storage  # the fp8 variants' stacks keep the plan
    offloaded = isinstance(tx, OffloadedOptimizer)
    template = jax.eval_shape(make_state)
    state_sh = sharding.state_shardings(template, tx, stack)
    resumed_from, state, meta = resume_point(cfg, store, template, state_sh, log_fn)
    if resumed_from:
        # The step donates its state: no two leaves may share a buffer (outputs of jit never do).
        state = unalias(state)
        log_fn(f"resumed from {resumed_from} at step {int(state.step)}")
        _say_schedule_change(cfg, meta, int(state.step), log_fn)
    else:
        state = make_state()
    data_sharding = sharding.tokens_sharding()

    if offloaded:
        # The state's chunks stay in host memory. Nothing is donated: an output
        # kept in host memory may be handed a donated device buffer otherwise.
        opt_state = tx.place(state.opt_state, sharding.replicated())
        state = unalias(jax.device_put(state._replace(opt_state=None), sharding.replicated()))
        state = state._replace(opt_state=opt_state)

    def jit_step(fn):
        if offloaded:
            return jax.jit(fn)
        return jax.jit(fn, in_shardings=(state_sh, data_sharding), out_shardings=(state_sh, sharding.replicated()),
                       donate_argnums=(0,))

    step_fn = jit_step(make_train_step(cfg, stack, tx, model, bound_fp8,
                                       param_shardings=None if offloaded else state_sh.params))
    # Delayed gradient scaling needs scales observed by a step first: the
    # current-scaling step runs until every seam and layer has them (one
    # step unless it fell back), then the delayed step takes over for good
    # (a fold never unsets an observed scale).
    delayed_fn = None
    grad_scaling = "current"  # what the run's steps use now (the summary reports it)
    if bound_fp8 is not None and cfg.fp8_grad_scaling == "delayed":
        delayed = bound_fp8.with_recipe(gradient="delayed")
        delayed_fn = jit_step(make_train_step(cfg, make_stack(cfg, model, delayed, sharding, planned), tx, model,
                                              delayed, param_shardings=None if offloaded else state_sh.params))
        if _grad_scales_observed(bound_fp8, state.fp8):
            step_fn, delayed_fn, grad_scaling = delayed_fn, None, "delayed"

    # fallback='step': a step whose fp8 checks failed changed nothing but the
    # counts; it is rerun on the same tokens without fp8 seams. Reading the
    # flag is one host sync per step (that guard's price instead of a cond
    # per block).
    rerun_fn = None
    if bound_fp8 is not None and bound_fp8.fallback == "step":
        rerun_fn = jit_step(make_train_step(cfg, make_stack(cfg, model, None, sharding, planned), tx, model, None,
                                            param_shardings=None if offloaded else state_sh.params))

    log = JsonlLog(os.path.join(cfg.out, "log.jsonl")) if primary else _ReadOnlyLog(os.path.join(cfg.out, "log.jsonl"))
    first_loss = last_loss = None
    start_step = int(state.step)
    # Records of steps past the checkpoint (a run killed between checkpoints)
    # are redone by this run: drop them so every step is logged once.
    with naming_writes(start_step, log.path):
        log.truncate_after(start_step)
    if run.tokenizer is not None and primary:  # beside the checkpoints, where eae-jax generate looks
        with naming_writes(start_step, cfg.out):
            save_tokenizer(run.tokenizer, cfg.out)
    last_step = cfg.steps if until is None else min(until, cfg.steps)
    # Which row of the step's batch sits where in the token block the step takes.
    rows_at = np.asarray(sharding.arrange_tokens(np.arange(cfg.batch)[:, None]))[..., 0]
    block_shape = rows_at.shape + (cfg.seq_len + 1,)
    data_root = jax.random.wrap_key_data(np.asarray(jax.device_get(jax.random.key_data(state.key))),
                                         impl=jax.random.key_impl(state.key))
    pending = None  # (step, path) of the checkpoint being written in the background
    # Other processes write no TensorBoard files, plot or trace: the first one does.
    monitor_cfg = cfg if primary else dataclasses.replace(cfg, tensorboard=False, plot=False, profile=None,
                                                                 quiet=True)
    monitor = RunMonitor(monitor_cfg, model, run.val, log, start_step, last_step, log_fn,
                         devices=sharding.mesh.size)
    log_fn = monitor.write  # above the progress bar
    log_fn(f"training on {run.source}")
    step = start_step
    try:
        monitor.start(state)
        for step in range(start_step, last_step):
            monitor.begin_step(step + 1)
            with monitor.host("batch"):
                data_key = jax.random.fold_in(data_root, step)
                tokens = process_local_batch(block_shape, data_sharding, rows_at, lambda rows: np.asarray(
                    make_batches(data_key, source, cfg.batch, cfg.seq_len, model.vocab_size, rows=rows)))
            state, metrics = monitor.run_step(step_fn, state, tokens)
            done = step + 1
            if rerun_fn is not None and bool(metrics["fp8_step_rejected"]):
                state, metrics = rerun_fn(state, tokens)
                log_fn(f"fp8: a seam check failed in step {done}; the step was rerun in high precision")
            if delayed_fn is not None:
                # A host check (one sync) per step, for a few steps only: a seam
                # that keeps falling back never observes its gradients.
                if _grad_scales_observed(bound_fp8, state.fp8):
                    step_fn, delayed_fn, grad_scaling = delayed_fn, None, "delayed"
                    log_fn(f"fp8: gradient scales observed; delayed gradient scaling from step {done + 1}")
                elif done - start_step >= DELAYED_SWITCH_STEPS:
                    delayed_fn = None
                    log_fn(f"fp8: gradient scales still unobserved after {DELAYED_SWITCH_STEPS} steps (seams falling "
                           "back); staying with current gradient scaling")
            if done % cfg.log_every == 0 or done == last_step or done == start_step + 1 or monitor.wants_log(done):
                metrics = {k: (float(v) if np.ndim(v) == 0 else np.asarray(v).tolist())
                           for k, v in jax.device_get(metrics).items()}
                if not np.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"loss became {metrics['loss']} at step {done}; {kept(store)}")
                metrics.update(step=done, **monitor.measure(done, state))
                first_loss = metrics["loss"] if first_loss is None else first_loss
                last_loss = metrics["loss"]
                with naming_writes(done, log.path):
                    log.write(metrics)
                monitor.report(metrics)
            if done % cfg.checkpoint_every == 0 or done == last_step:
                # Never let a checkpoint of diverged params replace (keep=) the good ones.
                loss = float(np.asarray(metrics["loss"]))
                bad = nonfinite_leaves((state.params, state.opt_state))
                if bad or not np.isfinite(loss):
                    what = [f"loss {loss}"] if not np.isfinite(loss) else []
                    if bad:
                        what.append(f"{len(bad)} state arrays ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
                    raise FloatingPointError(f"non-finite {' and '.join(what)} at step {done}; not checkpointed; "
                                             f"{kept(store)}")
                if pending is not None:  # the previous one has had checkpoint_every steps to finish
                    with naming_writes(*pending), monitor.host("checkpoint"):
                        store.wait()
                pending = (done, store.path(done))
                with naming_writes(*pending), monitor.host("checkpoint"):
                    store.save(done, state, metadata={"config": cfg.to_dict()})
                log_fn(f"checkpoint {pending[1]}")
            monitor.end_step(done, state)
        if pending is not None:
            with naming_writes(*pending):
                store.wait()
    except jax.errors.JaxRuntimeError as err:
        # nonfinite_guard('raise') raises on the host from inside the step: a diverged run, not a crash.
        lines = [line for line in str(err).splitlines() if "nonfinite_guard:" in line]
        if not lines:
            raise
        raise FloatingPointError(f"step {step + 1}: {lines[0].split('nonfinite_guard:', 1)[1].strip()} "
                                 f"(nonfinite_guard); {kept(store)}") from None
    finally:
        monitor.close()
    if last_loss is None:
        # Nothing ran (resuming a finished run): report the run's logged losses.
        logged = [r for r in log.records() if isinstance(r.get("step"), int) and isinstance(r.get("loss"), float)
                  and r["step"] <= start_step]
        if logged:
            first_loss, last_loss = logged[0]["loss"], logged[-1]["loss"]
    summary = {"first_loss": first_loss, "final_loss": last_loss, "steps": last_step, "resumed_from": resumed_from,
               "steps_run": max(last_step - start_step, 0), "out": cfg.out, "trained_on": run.source,
               "mesh": format_mesh(sharding.sizes)}
    if sharding.pipelined:
        summary["pipeline"] = {"stages": sharding.stages, "microbatches": sharding.microbatches,
                               "bubble_fraction": bubble_fraction(sharding.stages, sharding.microbatches)}
    summary.update(monitor.finish(summary["steps_run"]))
    if run_plan is not None:
        summary["memory_plan"] = run_plan.summary()
    if bound_fp8 is not None:
        report = bound_fp8.report(jax.device_get(state.fp8))
        summary["fp8"] = {"calls": sum(r["calls"] for r in report), "fp8_calls": sum(r["fp8_calls"] for r in report),
                          "fallbacks": sum(r["fallbacks"] for r in report),
                          "grad_clipped": sum(sum(r.get("grad_clipped", [])) for r in report),
                          "weight_clipped": sum(sum(r.get("weight_clipped", [])) for r in report),
                          "grad_scaling": grad_scaling,
                          "weight_scaling": sorted({sm.recipe.weight for sm in bound_fp8.seams.values()}),
                          "detached": [r["seam"] for r in report if r["detached"]],
                          "gate_worst_cos": min(c["worst_cos"] for c in bound_fp8.certification.values())}
    return summary
