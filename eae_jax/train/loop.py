"""The training loop: a jitted step around a reconstruct LM, checkpoints, logs.

One optimizer step takes a ``(microbatches, batch/microbatches, seq+1)``
token block, scans over the microbatches (gradients accumulated in
``grad_accum_dtype``; the adjoint carry threaded through every backward),
clips, applies AdamW, and returns metrics. With several devices the batch is
sharded over a one-axis ``data`` mesh and the params are replicated; XLA
inserts the gradient all-reduce.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eae_jax.dtypes import parse_compute_dtype
from eae_jax.models.llama import cross_entropy, init_lm, lm_stack, split_params
from eae_jax.train import checkpoint as ckpt
from eae_jax.train.config import TrainConfig, parse_passes
from eae_jax.buffers import unalias
from eae_jax.text import save_tokenizer
from eae_jax.train.data import TokenFile, make_batches
from eae_jax.train.lock import RunLock
from eae_jax.train.monitor import RunMonitor
from eae_jax.train.rundir import JsonlLog, naming_writes, prepare_out
from eae_jax.train.sources import prepare_run


class TrainState(NamedTuple):
    """Everything that changes from step to step (and is checkpointed).

    ``fp8`` holds the fp8 seams' state (scales and fallback ledgers, one per
    layer) for fp8 runs, else None.

    Example:
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import build
      >>> state = build(TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32))[-1]
      >>> int(state.step), sorted(state.params), state.fp8 is None
      (0, ['blocks', 'embed', 'final_norm', 'lm_head'], True)
    """

    step: jax.Array
    params: Any
    opt_state: Any
    carry: Any
    key: jax.Array
    fp8: Any = None


def segment_params(params: dict, fp8_state: Any, model) -> list:
    """The LM stack's segment params, with the fp8 seam state beside the blocks when there is one.

    Example:
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import build, segment_params
      >>> model, _, _, _, state = build(TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32))
      >>> segments = segment_params(state.params, None, model)     # embedding, blocks, head
      >>> len(segments), segments[1] is state.params["blocks"]
      (3, True)
    """
    embed_p, blocks, head_p = split_params(params, model)
    return [embed_p, blocks if fp8_state is None else {"params": blocks, "fp8": fp8_state}, head_p]


def bind_fp8(cfg: TrainConfig, model, params: dict, key: jax.Array, source: Optional[TokenFile] = None):
    """Calibrate and gate fp8 seams (qkv, o, ffn of every layer) on one batch.

    The calibration batch comes from the run's data stream (``key``; the
    token file ``source`` when given, else the synthetic task), embedded by
    the initial params. Raises `eae_jax.fp8.GateRefused` when a seam misses
    the parity gate.

    Example:
      >>> import jax
      >>> from eae_jax.models import init_lm
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import bind_fp8
      >>> cfg = TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32, dtype="fp8_e4m3")
      >>> bound = bind_fp8(cfg, cfg.model(), init_lm(jax.random.key(0), cfg.model()), jax.random.key(1))
      >>> sorted(bound.seams)
      ['ffn', 'o', 'qkv']
    """
    from eae_jax import fp8
    from eae_jax.models.llama import embed

    tokens = make_batches(key, source, cfg.batch // cfg.microbatches, cfg.seq_len, model.vocab_size)[:, :-1]
    x0 = embed(params["embed"], tokens, model.block.compute_dtype)
    seams = fp8.policy_seams(cfg.policy_obj, activation=cfg.fp8_scaling, weight=cfg.fp8_weight_scaling)
    return fp8.bind_block(model.block, params["blocks"], [x0], seams, fallback=cfg.fp8_fallback)


def lr_schedule(cfg: TrainConfig, steps: Optional[int] = None) -> optax.Schedule:
    """Linear warm-up to ``cfg.lr`` over ``cfg.warmup`` steps, then cosine decay
    to a tenth of it at step ``steps`` (default ``cfg.steps``).

    Example:
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import lr_schedule
      >>> schedule = lr_schedule(TrainConfig(lr=1e-3, warmup=10, steps=100))
      >>> [round(float(schedule(s)), 6) for s in (0, 5, 10, 100)]        # warm-up, peak, a tenth at the end
      [0.0, 0.0005, 0.001, 0.0001]
    """
    warmup = max(cfg.warmup, 1)
    steps = cfg.steps if steps is None else steps
    # decay_steps counts the warm-up and must exceed it (steps=1 with warmup=0 used to raise in optax)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(steps, warmup + 1), cfg.lr * 0.1)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with `lr_schedule`, global-norm clipping first.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import make_optimizer
      >>> tx = make_optimizer(TrainConfig(lr=1e-3, warmup=1, steps=10, grad_clip=1.0))
      >>> params, opt_state = {"w": jnp.ones(2)}, None
      >>> opt_state = tx.init(params)
      >>> for _ in range(2):                               # step 0 is the warm-up's lr 0
      ...     updates, opt_state = tx.update({"w": jnp.full(2, 100.0)}, opt_state, params)
      >>> [round(float(u), 6) for u in updates["w"]]      # Adam's unit step times the peak lr
      [-0.001, -0.001]
    """
    schedule = lr_schedule(cfg)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
    return optax.chain(*parts, optax.adamw(schedule, weight_decay=cfg.weight_decay))


def make_train_step(cfg: TrainConfig, stack, tx, model, bound_fp8=None):
    """Build ``step(state, tokens) -> (state, metrics)`` (not yet jitted).

    ``tokens`` is int32 ``(microbatches, micro_batch, seq_len + 1)``.
    ``bound_fp8`` (from `bind_fp8`) folds the fp8 seams' ledgers and scales
    after every microbatch. With ``fallback='step'`` it folds once per step
    (`BoundBlock.fold_step`) and, when a seam call of the step failed its
    check, leaves params, optimizer state, adjoint carry and step number as
    they were and sets ``metrics['fp8_step_rejected']``: the caller reruns
    the step in high precision (a step built without ``bound_fp8``, which
    passes the fp8 state through untouched).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.train import TrainConfig, make_train_step
      >>> from eae_jax.train.loop import build
      >>> cfg = TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32, batch=2, seq_len=8)
      >>> model, stack, tx, _, state = build(cfg)
      >>> tokens = jnp.arange(18, dtype=jnp.int32).reshape(1, 2, 9) % 32      # (microbatches, batch, seq_len + 1)
      >>> state, metrics = jax.jit(make_train_step(cfg, stack, tx, model))(state, tokens)
      >>> int(state.step), bool(jnp.isfinite(metrics["loss"]))
      (1, True)
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
            carry, stats = stack.update(carry, g_carry, strict=False)
            if step_fallback:
                fp8_acc = _add_observations(fp8_acc, g_fp8)
            elif bound_fp8 is not None:
                fp8_acc = bound_fp8.fold(fp8_state, g_fp8)
            grads_acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(accum_dtype), grads_acc, grads)
            return (grads_acc, fp8_acc, carry), (loss, stats)

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, accum_dtype), state.params)
        fp8_init = jax.tree_util.tree_map(jnp.zeros_like, state.fp8) if step_fallback else state.fp8
        (grads, fp8_state, carry), (losses, stats) = jax.lax.scan(micro, (zeros, fp8_init, state.carry), tokens)
        n = tokens.shape[0]
        grads = jax.tree_util.tree_map(lambda g, p: (g.astype(jnp.float32) / n).astype(p.dtype), grads, state.params)
        def apply_update(ops):
            grads_, opt_state_, params_ = ops
            with jax.named_scope("optimizer"):
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


def _mesh(devices: Optional[int]):
    available = jax.devices()
    count = len(available) if devices is None else devices
    if count < 1 or count > len(available):
        raise ValueError(f"devices={devices} but {len(available)} are available")
    return jax.sharding.Mesh(np.array(available[:count]), ("data",))


def _keys(cfg: TrainConfig):
    """(params, carry, data) keys of a run, all from ``cfg.seed``."""
    return jax.random.split(jax.random.key(cfg.seed), 3)


def init_state(cfg: TrainConfig, model, stack, tx, bound_fp8=None, params=None) -> TrainState:
    """Fresh params (unless given), optimizer state, adjoint carry and fp8 state from ``cfg.seed``.

    Example:
      >>> from eae_jax.train import TrainConfig, init_state
      >>> from eae_jax.train.loop import build
      >>> cfg = TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32, seed=3)
      >>> model, stack, tx, bound, state = build(cfg)
      >>> again = init_state(cfg, model, stack, tx)                 # the same seed: the same params
      >>> bool((again.params["embed"] == state.params["embed"]).all())
      True
    """
    k_params, k_carry, k_data = _keys(cfg)
    params = init_lm(k_params, model) if params is None else params
    fp8_state = None if bound_fp8 is None else bound_fp8.state
    example = jnp.zeros((cfg.batch // cfg.microbatches, cfg.seq_len), jnp.int32)
    carry = stack.init(segment_params(params, fp8_state, model), example, k_carry)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), carry, k_data, fp8_state)


def build(cfg: TrainConfig, source: Optional[TokenFile] = None, params: Optional[dict] = None):
    """Model, stack, optimizer, bound fp8 seams (or None) and the initial state of a run.

    ``source``: the run's token file (None: the synthetic task), for the fp8 calibration batch.
    ``params``: the initial params (``--init``); None draws them from ``cfg.seed``.

    Example:
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import build
      >>> model, stack, tx, bound, state = build(TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32))
      >>> model.depth, model.block.dim, bound is None, int(state.step)
      (1, 16, True, 0)
    """
    model = cfg.model()
    tx = make_optimizer(cfg)
    params = init_lm(_keys(cfg)[0], model) if params is None else params
    bound = bind_fp8(cfg, model, params, jax.random.fold_in(_keys(cfg)[2], 2**31 - 1), source) if cfg.fp8 else None
    stack = make_stack(cfg, model, bound)
    return model, stack, tx, bound, init_state(cfg, model, stack, tx, bound, params)


def make_stack(cfg: TrainConfig, model, bound_fp8=None):
    """The run's reconstruct stack, with ``bound_fp8``'s block when given.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.models import split_params
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import build, make_stack
      >>> cfg = TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32)
      >>> model, params = cfg.model(), build(cfg)[-1].params
      >>> make_stack(cfg, model)(split_params(params, model), jnp.zeros((2, 8), jnp.int32)).shape
      (2, 8, 32)
    """
    return lm_stack(model, block_fn=None if bound_fp8 is None else bound_fp8.block_fn(),
                    passes=parse_passes(cfg.passes), boundary_dtype=cfg.boundary_dtype, policy=cfg.policy,
                    offload=cfg.offload)


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


def _kept(ckpt_dir: str) -> str:
    latest = ckpt.latest(ckpt_dir)
    return f"last checkpoint kept: {latest}" if latest else f"no checkpoint in {ckpt_dir} yet"


#: Config fields a resumed run may change: bookkeeping, the schedule's length
#: (extending a run), and how (not what) it computes.
RESUME_MAY_CHANGE = ("steps", "out", "checkpoint_every", "keep", "resume", "log_every", "devices", "policy",
                     "offload", "val_every", "val_batches", "quiet", "tensorboard", "plot", "peak_tflops", "profile")


def _check_resumable(cfg: TrainConfig, path: str, meta: dict) -> None:
    """Refuse to resume a checkpoint written with another config (the fields not in `RESUME_MAY_CHANGE`)
    or past ``cfg.steps``."""
    saved = meta.get("config")
    if isinstance(saved, dict):
        now = cfg.to_dict()
        diffs = []
        for name in sorted(set(saved) & set(now)):  # a field older checkpoints lack is not compared
            if name in RESUME_MAY_CHANGE or saved.get(name) == now.get(name):
                continue
            if name == "data" and saved.get(name) and now.get(name) and \
                    os.path.realpath(saved[name]) == os.path.realpath(now[name]):
                continue
            diffs.append(f"{name}: {saved.get(name)!r} in the checkpoint, {now.get(name)!r} now")
        if diffs:
            raise ckpt.CheckpointError(
                f"checkpoint {path} was written with a different config; resuming it would not continue that run:"
                "\n  " + "\n  ".join(diffs) + "\nrerun with the checkpoint's settings, or pass a fresh --out")
    step = meta.get("step", 0)
    if isinstance(step, int) and step > cfg.steps:
        raise ValueError(f"checkpoint {path} is at step {step}, past steps={cfg.steps}: pass --steps >= {step} "
                         "to continue the run, or a fresh --out")


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


def train(cfg: TrainConfig, log_fn=print, until: Optional[int] = None) -> dict:
    """Run (or resume) a training run; returns a summary dict.

    ``until`` stops this invocation after that step (a checkpoint is written
    there) without changing the run's schedule, as a pre-empted job would.

    Writes ``<out>/log.jsonl`` (one record per logged step) and checkpoints
    under ``<out>/checkpoints`` (atomic; the newest readable one is resumed
    when ``cfg.resume``); a text run's tokenizer, TensorBoard files, the loss
    plot and ``--profile``'s trace beside them (`RunMonitor`). The run holds
    ``<out>``'s lock (`RunLock`) throughout: a second run into the same
    ``out`` is refused.

    Resuming: an unreadable newest checkpoint (damaged, not an archive) is
    moved aside to ``<name>.unreadable`` (never deleted) with a warning
    naming it, and the newest readable one is resumed; when none is
    readable the run is refused, naming them.

    Raises:
      ValueError / TypeError: a bad config, data file or output directory
        (before anything is built); CheckpointError: a checkpoint that does
        not continue this run, or none readable.
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
    # Fail on a bad --out, --data or --devices before building (and compiling) anything.
    ckpt_dir = prepare_out(cfg.out)
    with RunLock(cfg.out, log_fn):
        return _train_locked(cfg, ckpt_dir, log_fn, until)


def _resume_point(cfg: TrainConfig, ckpt_dir: str, log_fn):
    """``(path, arrays, metadata)`` of the checkpoint to resume (Nones for a fresh run);
    unreadable newer ones are set aside with a warning (see `train`)."""
    if not cfg.resume:
        if ckpt.latest(ckpt_dir):
            raise ValueError(f"resume is off but {ckpt_dir} already holds checkpoints (newest "
                             f"{ckpt.latest(ckpt_dir)}); a fresh run there would mix its checkpoints and log with "
                             "the old run's: pass a fresh --out, or move the old run away")
        return None, None, None
    path, arrays, meta, unreadable = ckpt.newest_readable(ckpt_dir)
    if path is None and unreadable:
        raise ckpt.CheckpointError(
            f"no readable checkpoint in {ckpt_dir}: " + "; ".join(str(err) for _, err in unreadable)
            + ". Nothing was deleted: move them away to start afresh, or pass a fresh --out")
    if path is not None:  # its config first: a mismatch names its cause rather than the shapes it changes
        _check_resumable(cfg, path, meta)
    for bad, err in unreadable:
        aside = ckpt.set_aside(bad)
        log_fn(f"warning: {err}; moved aside to {aside} (not deleted); resuming from the older {path}")
    return path, arrays, meta


def _train_locked(cfg: TrainConfig, ckpt_dir: str, log_fn, until: Optional[int]) -> dict:
    run = prepare_run(cfg, log_fn)  # text, token file or synthetic; --init: they fix the vocabulary and shape
    cfg, source = run.config, run.train
    resumed_from, arrays, meta = _resume_point(cfg, ckpt_dir, log_fn)
    mesh = _mesh(cfg.devices)
    micro_batch = cfg.batch // cfg.microbatches
    if micro_batch % mesh.size:
        raise ValueError(f"micro-batch {micro_batch} does not split over {mesh.size} devices")
    model, stack, tx, bound_fp8, state = build(cfg, source, run.init_params)
    if resumed_from:
        state = ckpt.fit(resumed_from, arrays, state)
        log_fn(f"resumed from {resumed_from} at step {int(state.step)}")
        _say_schedule_change(cfg, meta, int(state.step), log_fn)

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    data_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data", None))
    # The step donates its state: no two leaves may share a buffer (outputs of jit never do).
    state = unalias(jax.device_put(state, replicated))
    step_fn = jax.jit(make_train_step(cfg, stack, tx, model, bound_fp8), donate_argnums=(0,))
    # Delayed gradient scaling needs scales observed by a step first: the
    # current-scaling step runs until every seam and layer has them (one
    # step unless it fell back), then the delayed step takes over for good
    # (a fold never unsets an observed scale).
    delayed_fn = None
    grad_scaling = "current"  # what the run's steps use now (the summary reports it)
    if bound_fp8 is not None and cfg.fp8_grad_scaling == "delayed":
        delayed = bound_fp8.with_recipe(gradient="delayed")
        delayed_fn = jax.jit(make_train_step(cfg, make_stack(cfg, model, delayed), tx, model, delayed),
                             donate_argnums=(0,))
        if _grad_scales_observed(bound_fp8, state.fp8):
            step_fn, delayed_fn, grad_scaling = delayed_fn, None, "delayed"

    # fallback='step': a step whose fp8 checks failed changed nothing but the
    # counts; it is rerun on the same tokens without fp8 seams. Reading the
    # flag is one host sync per step (that guard's price instead of a cond
    # per block).
    rerun_fn = None
    if bound_fp8 is not None and bound_fp8.fallback == "step":
        rerun_fn = jax.jit(make_train_step(cfg, make_stack(cfg, model, None), tx, model, None), donate_argnums=(0,))

    log = JsonlLog(os.path.join(cfg.out, "log.jsonl"))
    first_loss = last_loss = None
    start_step = int(state.step)
    # Records of steps past the checkpoint (a run killed between checkpoints)
    # are redone by this run: drop them so every step is logged once.
    with naming_writes(start_step, log.path):
        log.truncate_after(start_step)
    if run.tokenizer is not None:  # beside the checkpoints, where eae-jax generate looks
        with naming_writes(start_step, cfg.out):
            save_tokenizer(run.tokenizer, cfg.out)
    last_step = cfg.steps if until is None else min(until, cfg.steps)
    monitor = RunMonitor(cfg, model, run.val, log, start_step, last_step, log_fn, devices=mesh.size)
    log_fn = monitor.write  # above the progress bar
    log_fn(f"training on {run.source}")
    step = start_step
    try:
        monitor.start(state)
        for step in range(start_step, last_step):
            monitor.begin_step(step + 1)
            with monitor.host("batch"):
                data_key = jax.random.fold_in(state.key, step)
                tokens = make_batches(data_key, source, cfg.batch, cfg.seq_len, model.vocab_size)
                tokens = jax.device_put(tokens.reshape(cfg.microbatches, micro_batch, -1), data_sharding)
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
                    raise FloatingPointError(f"loss became {metrics['loss']} at step {done}; {_kept(ckpt_dir)}")
                metrics.update(step=done, **monitor.measure(done, state))
                first_loss = metrics["loss"] if first_loss is None else first_loss
                last_loss = metrics["loss"]
                with naming_writes(done, log.path):
                    log.write(metrics)
                monitor.report(metrics)
            if done % cfg.checkpoint_every == 0 or done == last_step:
                host_state = jax.device_get(state)
                # Never let a checkpoint of diverged params replace (keep=) the good ones.
                loss = float(np.asarray(metrics["loss"]))
                bad = [jax.tree_util.keystr(p) for p, x in
                       jax.tree_util.tree_leaves_with_path((host_state.params, host_state.opt_state))
                       if np.issubdtype(np.asarray(x).dtype, np.inexact) and not np.all(np.isfinite(x))]
                if bad or not np.isfinite(loss):
                    what = [f"loss {loss}"] if not np.isfinite(loss) else []
                    if bad:
                        what.append(f"{len(bad)} state arrays ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
                    raise FloatingPointError(f"non-finite {' and '.join(what)} at step {done}; not checkpointed; "
                                             f"{_kept(ckpt_dir)}")
                with naming_writes(done, os.path.join(ckpt_dir, f"ckpt_{done:08d}.npz")), monitor.host("checkpoint"):
                    path = ckpt.save(ckpt_dir, done, host_state, metadata={"config": cfg.to_dict()}, keep=cfg.keep)
                log_fn(f"checkpoint {path}")
            monitor.end_step(done, state)
    except jax.errors.JaxRuntimeError as err:
        # nonfinite_guard('raise') raises on the host from inside the step: a diverged run, not a crash.
        lines = [line for line in str(err).splitlines() if "nonfinite_guard:" in line]
        if not lines:
            raise
        raise FloatingPointError(f"step {step + 1}: {lines[0].split('nonfinite_guard:', 1)[1].strip()} "
                                 f"(nonfinite_guard); {_kept(ckpt_dir)}") from None
    finally:
        monitor.close()
    if last_loss is None:
        # Nothing ran (resuming a finished run): report the run's logged losses.
        logged = [r for r in log.records() if isinstance(r.get("step"), int) and isinstance(r.get("loss"), float)
                  and r["step"] <= start_step]
        if logged:
            first_loss, last_loss = logged[0]["loss"], logged[-1]["loss"]
    summary = {"first_loss": first_loss, "final_loss": last_loss, "steps": last_step, "resumed_from": resumed_from,
               "steps_run": max(last_step - start_step, 0), "out": cfg.out, "trained_on": run.source}
    summary.update(monitor.finish(summary["steps_run"]))
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
