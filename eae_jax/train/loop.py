"""The training loop: a run's step (`eae_jax.train.step`) over its data, checkpoints, logs.

The run is laid out over a mesh (``--mesh``;
`eae_jax.train.sharding.RunSharding`): data parallel by default, FSDP,
tensor parallel or pipelined on request; XLA inserts the collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

import jax
import numpy as np

from eae_jax.parallel.distributed import process_local_batch
from eae_jax.parallel.mesh import format_mesh
from eae_jax.parallel.pipeline import bubble_fraction
from eae_jax.train.checkpoint import CheckpointStore
from eae_jax.offload_optim import OffloadedOptimizer
from eae_jax.train.config import TrainConfig
from eae_jax.buffers import unalias
from eae_jax.text import save_tokenizer
from eae_jax.train.data import make_batches
from eae_jax.train.lock import RunLock
from eae_jax.train.monitor import RunMonitor
from eae_jax.train.resume import kept, nonfinite_leaves, resume_point
from eae_jax.train.rundir import JsonlLog, naming_writes, prepare_out
from eae_jax.train.sharding import RunSharding, mesh_for
from eae_jax.train.sources import prepare_run
# The run's pieces live in train.step; their names stay importable from here.
from eae_jax.train.step import (TrainState, bind_fp8, build, init_state, lr_schedule,  # noqa: F401
                                make_optimizer, make_stack, make_train_step, segment_params)

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

    Example:
      >>> import tempfile
      >>> from eae_jax.train import TrainConfig, train
      >>> cfg = TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32, batch=2, seq_len=8, steps=2,
      ...                   out=tempfile.mkdtemp(), log_every=1, plot=False, quiet=True)
      >>> summary = train(cfg, log_fn=lambda message: None)
      >>> summary["steps"], summary["steps_run"], summary["resumed_from"]
      (2, 2, None)
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
        # The state's chunks stay in host memory. The step donates the state with every
        # leaf's sharding named, memory kind included: jax then hands a host output only a
        # donated host buffer, and the host state is updated in place instead of held twice.
        opt_state = tx.place(state.opt_state, sharding.replicated())
        state = unalias(jax.device_put(state._replace(opt_state=None), sharding.replicated()))
        state = state._replace(opt_state=opt_state)
        state_sh = jax.tree_util.tree_map(lambda leaf: leaf.sharding, state)

    def jit_step(run_stack, bound):
        """The jitted train step of ``run_stack`` (with fp8 seams ``bound``, or None)."""
        fn = make_train_step(cfg, run_stack, tx, model, bound, param_shardings=None if offloaded else state_sh.params)
        return sharding.jit_step(fn, state_sh)

    step_fn = jit_step(stack, bound_fp8)
    # Delayed gradient scaling needs scales observed by a step first: the
    # current-scaling step runs until every seam and layer has them (one
    # step unless it fell back), then the delayed step takes over for good
    # (a fold never unsets an observed scale).
    delayed_fn = None
    grad_scaling = "current"  # what the run's steps use now (the summary reports it)
    if bound_fp8 is not None and cfg.fp8_grad_scaling == "delayed":
        delayed = bound_fp8.with_recipe(gradient="delayed")
        delayed_fn = jit_step(make_stack(cfg, model, delayed, sharding, planned), delayed)
        if _grad_scales_observed(bound_fp8, state.fp8):
            step_fn, delayed_fn, grad_scaling = delayed_fn, None, "delayed"

    # fallback='step': a step whose fp8 checks failed changed nothing but the
    # counts; it is rerun on the same tokens without fp8 seams. Reading the
    # flag is one host sync per step (that guard's price instead of a cond
    # per block).
    rerun_fn = None
    if bound_fp8 is not None and bound_fp8.fallback == "step":
        rerun_fn = jit_step(make_stack(cfg, model, None, sharding, planned), None)

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
