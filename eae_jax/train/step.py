"""A run's pieces: its state, optimizer, reconstruct stack and jitted step.

`build` makes them from a `TrainConfig` (and a mesh layout, a memory plan,
bound fp8 seams where the config asks); `eae_jax.train.loop` runs them.
One optimizer step takes a ``(microbatches, batch/microbatches, seq+1)``
token block, scans over the microbatches (gradients accumulated in
``grad_accum_dtype``; the adjoint carry threaded through every backward),
clips, applies AdamW, and returns metrics.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from eae_jax.dtypes import parse_compute_dtype
from eae_jax.models.llama import cross_entropy, init_lm, lm_stack, split_params
from eae_jax.offload_optim import OffloadedOptimizer
from eae_jax.train.config import TrainConfig, parse_passes
from eae_jax.train.data import TokenFile, make_batches
from eae_jax.train.sharding import RunSharding


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

    Example:
      >>> from eae_jax.train import TrainConfig
      >>> from eae_jax.train.loop import build
      >>> model, stack, tx, bound, state = build(TrainConfig(preset="tiny", dim=16, depth=1, heads=2, vocab_size=32))
      >>> model.depth, model.block.dim, bound is None, int(state.step)
      (1, 16, True, 0)
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
    """The `RunPlan` of a ``--memory-budget`` run, per device (on a mesh: the run's layout)."""
    from eae_jax.train.budget import host_adamw, parse_memory_budget, plan_run
    from eae_jax.train.costs_cache import costs_key, load_costs, save_costs

    micro = cfg.batch // cfg.microbatches
    planning = None if sharding is None else sharding.planning(params, fp8=bound is not None)
    key = costs_key(cfg)
    costs = load_costs(cfg.out, key, log_fn)  # a resumed run skips the probes
    run_plan = plan_run(parse_memory_budget(cfg.memory_budget), make_stack(cfg, model, bound),
                        segment_params(params, None if bound is None else bound.state, model), micro, cfg.seq_len,
                        tx, params, parse_compute_dtype(cfg.grad_accum_dtype),
                        make_stack=lambda storages: make_stack(cfg, model, bound, None, storages),
                        host_tx=lambda: host_adamw(lr_schedule(cfg), cfg.weight_decay, cfg.grad_clip),
                        mesh=planning, loss=cross_entropy, log_fn=log_fn, costs=costs)
    if costs is None:
        save_costs(cfg.out, key, run_plan.plan.costs)
    return run_plan


def make_stack(cfg: TrainConfig, model, bound_fp8=None, sharding: Optional[RunSharding] = None, storage=None):
    """The run's stack, with ``bound_fp8``'s block when given, laid out by ``sharding`` when given
    (``storage``: the planned storages of a ``memory_budget`` run).

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
    block_fn = None if bound_fp8 is None else bound_fp8.block_fn()
    if sharding is not None:
        return sharding.stack(cfg, parse_passes(cfg.passes), block_fn, fp8=bound_fp8 is not None, storage=storage)
    if storage is not None:
        return lm_stack(model, block_fn=block_fn, passes=parse_passes(cfg.passes), storage=storage)
    return lm_stack(model, block_fn=block_fn, passes=parse_passes(cfg.passes), boundary_dtype=cfg.boundary_dtype,
                    policy=cfg.policy, offload=cfg.offload)


#: Steps a delayed-gradient-scaling run waits for every seam to observe its
#: gradient scales before it gives up and stays with current scaling.
