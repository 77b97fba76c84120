"""Multi-device checks run in a fresh process (``python tests/parallel_worker.py MODE DIR``).

The test modules ``test_parallel_*`` start it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before jax is
imported, which a pytest worker may have done already) and read the JSON
object it prints last. Each mode shares its process (and compilations)
across many checks. Numbers only: the assertions live in the tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))

from eae_jax.parallel.distributed import initialize  # noqa: E402

initialize()  # a process of a multi-host run (JAX_* variables) joins before anything computes

from conftest import quiet, rel_err  # noqa: E402
from eae_jax.passes.spec import parse_passes  # noqa: E402
from eae_jax.train import TrainConfig, init_state, make_optimizer, make_train_step, train  # noqa: E402
from eae_jax.train.data import synthetic_batch  # noqa: E402
from eae_jax.train.sharding import RunSharding, mesh_for  # noqa: E402

#: The meshes every scale-out run must train exactly like one device on.
MESHES = ("data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,model=2", "data=2,model=4", "stage=4,data=2")
#: The tiny model of those runs: 2 microbatches (the pipeline's), 8 sequences each.
RUN = dict(preset="tiny", batch=16, seq_len=8, microbatches=2, warmup=0, lr=1e-2)


def record_grads() -> optax.GradientTransformation:
    """Passes updates through and keeps the last ones (the step's gradients) in its state."""
    return optax.GradientTransformation(lambda params: {"grads": jax.tree_util.tree_map(jnp.zeros_like, params)},
                                        lambda updates, state, params=None: (updates, {"grads": updates}))


def three_steps(mesh: str, passes: str) -> dict:
    """Losses, last gradients and params after 3 steps on ``mesh`` (library API only)."""
    cfg = TrainConfig(mesh=mesh, passes=passes, **RUN)
    model = cfg.model()
    sharding = RunSharding(cfg, model, mesh_for(cfg))
    stack = sharding.stack(cfg, parse_passes(cfg.passes))
    tx = optax.chain(record_grads(), make_optimizer(cfg))
    make = jax.tree_util.Partial(init_state, cfg, model, stack, tx)
    shardings = sharding.state_shardings(jax.eval_shape(make), tx, stack)
    state = jax.jit(make, out_shardings=shardings)()
    step = sharding.jit_step(make_train_step(cfg, stack, tx, model, param_shardings=shardings.params), shardings)
    losses, grad_norms = [], []
    for i in range(3):
        tokens = synthetic_batch(jax.random.key(100 + i), cfg.batch, cfg.seq_len, model.vocab_size)
        state, metrics = step(state, jax.device_put(sharding.arrange_tokens(tokens), sharding.tokens_sharding()))
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    host = jax.device_get(state)
    return {"losses": losses, "grad_norms": grad_norms, "grads": host.opt_state[0]["grads"], "params": host.params,
            "stats": np.asarray(metrics["adjoint_norm_after_passes"]).tolist()}


def _errors(run: dict, ref: dict) -> dict:
    return {"losses": run["losses"], "grad_norms": run["grad_norms"], "stats": run["stats"],
            "grad_err": max(rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(run["grads"]),
                                                          jax.tree_util.tree_leaves(ref["grads"]))),
            "param_err": max(rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(run["params"]),
                                                           jax.tree_util.tree_leaves(ref["params"])))}



def meshes(tmp: str) -> dict:
    """Every mesh against one device, with `reconstruct` alone and with the int8 + clip
    chain; then a checkpoint written on data=8 resumed on fsdp=4 x model=2."""
    jax.config.update("jax_disable_most_optimizations", True)  # compile time; numerics are compared like for like
    out = {"devices": jax.device_count()}
    for passes in ("int8,clip=0.01", ""):
        ref = three_steps("data=1", passes)
        out[passes or "none"] = {"data=1": _errors(ref, ref), **{m: _errors(three_steps(m, passes), ref)
                                                                    for m in MESHES}}
    run = dict(preset="tiny", steps=4, batch=16, seq_len=8, warmup=0, log_every=1, checkpoint_every=2)
    whole = train(TrainConfig(out=os.path.join(tmp, "whole"), devices=8, **run), log_fn=quiet)
    # The run as if killed after its step-2 checkpoint (a second run to step 2 would compile
    # and compute the same thing again): the resumed run drops the log records past it.
    part = os.path.join(tmp, "part")
    shutil.copytree(os.path.join(tmp, "whole"), part, ignore=shutil.ignore_patterns("ckpt_00000004"))
    moved = train(TrainConfig(out=part, mesh="fsdp=4,model=2", **run), log_fn=quiet)
    logs = {name: [json.loads(line) for line in open(os.path.join(tmp, name, "log.jsonl"))]
            for name in ("whole", "part")}
    out["checkpoint"] = {"whole": [r["loss"] for r in logs["whole"]], "moved": [r["loss"] for r in logs["part"]],
                         "resumed_from": moved["resumed_from"], "mesh": moved["mesh"],
                         "whole_final": whole["final_loss"], "moved_final": moved["final_loss"]}
    out["fp8"] = fp8_runs(tmp)
    return out


def fp8_runs(tmp: str) -> dict:
    """Two fp8 training steps (seams bound, delayed scales, the step guard) on one device and on
    data=2 x fsdp=4: their summaries and logs."""
    run = dict(preset="tiny", steps=2, batch=8, seq_len=8, warmup=0, log_every=1, checkpoint_every=100,
               dtype="fp8_e4m3")
    out = {}
    for mesh in ("data=1", "data=2,fsdp=4"):
        folder = os.path.join(tmp, "fp8_" + mesh.replace(",", "_").replace("=", ""))
        summary = train(TrainConfig(out=folder, mesh=mesh, **run), log_fn=quiet)
        out[mesh] = {"summary": summary,
                     "losses": [json.loads(line)["loss"] for line in open(os.path.join(folder, "log.jsonl"))]}
    return out


def _numeric(tree) -> list:
    """The leaves of ``tree``, typed PRNG keys as their key data."""
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree_util.tree_leaves(tree)]


def _worst(tree, ref) -> float:
    return max((rel_err(a, b) for a, b in zip(_numeric(tree), _numeric(ref))), default=0.0)


def pipeline_vs_stack(mesh: str) -> dict:
    """`PipelinedLM` on ``mesh`` against `lm_stack` run microbatch by microbatch (two of
    them, as the training step accumulates) on one device: loss, gradients and the
    per-boundary statistics, with passes acting at two boundaries only (int8 everywhere,
    a clip at boundary 5 and a tighter one at 2), so that a wrong boundary index shows,
    and one that turns a zero adjoint into a nonzero one (a shift), so that anything
    a pipeline's idle ticks compute and let into the gradients shows."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eae_jax.blocks import BlockConfig
    from eae_jax.models import LMConfig, init_lm, lm_stack, split_params
    from eae_jax.models.llama import cross_entropy
    from eae_jax.parallel import make_mesh
    from eae_jax.parallel.pipeline_lm import PipelinedLM, interleave_microbatches
    from eae_jax.passes import at_layers, chain, clip_by_norm, int8_fake_quant, stateless

    cfg = LMConfig(32, 8, BlockConfig(16, 2, 1, 24, max_seq_len=8))
    params = split_params(jax.jit(init_lm, static_argnums=1)(jax.random.key(0), cfg), cfg)
    tokens = jax.random.randint(jax.random.key(1), (4, 7), 0, 32)
    shift = stateless(lambda a, ctx: a + 1e-6, "shift")
    chain_ = chain(shift, int8_fake_quant(), at_layers(clip_by_norm(1e-4), [5]), at_layers(clip_by_norm(1e-6), [2]))
    ref = lm_stack(cfg, passes=chain_)

    def ref_loss(p, c, tok):
        return cross_entropy(ref(p, tok[:, :-1], c), tok[:, 1:])

    rc = jax.jit(ref.init)(params, tokens[:2, :-1], jax.random.key(2))
    ref_grad = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))
    (l0, (g0, _)), (l1, (g1, gc)) = (ref_grad(params, rc, tokens[2 * m:2 * m + 2]) for m in range(2))
    _, ref_stats = jax.jit(ref.update)(rc, gc)

    grid = make_mesh(mesh)
    pipe = PipelinedLM(cfg, grid, microbatches=2, passes=chain_)
    tok = interleave_microbatches(tokens, 2)
    pc = jax.jit(pipe.init)(params, tok[:, :-1], jax.random.key(2))
    placed = [params[0], jax.device_put(params[1], NamedSharding(grid, P("stage"))), params[2]]
    loss, (g, gc) = jax.jit(jax.value_and_grad(lambda p, c: cross_entropy(pipe(p, tok[:, :-1], c), tok[:, 1:]),
                                               argnums=(0, 1)))(placed, pc)
    _, stats = jax.jit(pipe.update)(pc, gc)
    before, after = np.asarray(stats["adjoint_norm"]), np.asarray(stats["adjoint_norm_after_passes"])
    mean = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, g0, g1)
    return {"loss": float(loss), "ref_loss": float((l0 + l1) / 2), "grad_err": _worst(g, mean),
            "stats_err": max(rel_err(stats[k], ref_stats[k]) for k in ("adjoint_norm", "adjoint_norm_after_passes")),
            "clipped": np.flatnonzero(after < 0.9 * before).tolist(), "calls": float(stats["calls"])}


def passes(tmp: str) -> dict:
    """Every built-in pass on an adjoint split over 8 devices (by ``jit``, and inside a
    pipeline stage's `shard_map`) against the same adjoint on one device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eae_jax.parallel import make_mesh
    from eae_jax.passes.base import PassContext

    specs = ["clip=1.0", "int8", "cast=bf16", "fp16", "bf16", "fp8", "decay=0.5", "noise=1e-3", "stats", "topk=0.25",
             "guard=skip", "synthetic", "capture"]
    # An adjoint whose statistics only the whole array gives: one device's rows are 100x larger.
    g_all = jax.random.normal(jax.random.key(0), (8, 4, 32)) * jnp.where(jnp.arange(8) == 5, 100.0, 1.0)[:, None, None]
    ctx = PassContext(jnp.int32(3), jnp.int32(3), jnp.int32(2), 6)
    one = jax.devices()[0]
    flat = make_mesh("data=8")
    staged = make_mesh("stage=2,data=4")
    out = {}
    for spec in specs:
        p = parse_passes(spec)
        # the guard's statistic: is anything non-finite, on any device (one NaN on device 5: all is zeroed)
        g = g_all.at[5, 0, 0].set(jnp.nan) if spec == "guard=skip" else g_all
        state = p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(1))
        update = jax.jit(lambda a, st: p.update(a, st, ctx))
        ref = jax.device_get(update(jax.device_put(g, one), jax.device_put(state, one)))
        split = jax.device_get(update(jax.device_put(g, NamedSharding(flat, P("data"))), state))

        def in_stage(a, st):  # as a pipeline stage runs it: `stage` manual, `data` automatic
            return jax.shard_map(lambda a_, st_: p.update(a_, st_, ctx), mesh=staged, in_specs=(P(), P()),
                                 out_specs=P(), axis_names={"stage"}, check_vma=False)(a, st)

        staged_out = jax.device_get(jax.jit(in_stage)(jax.device_put(g, NamedSharding(staged, P("data"))), state))

        def per_shard(a, st):  # what a pass would see if the batch axis were manual too: its shard only
            return jax.shard_map(lambda a_, st_: p.update(a_, st_, ctx), mesh=flat, in_specs=(P("data"), P()),
                                 out_specs=(P("data"), P()), check_vma=False)(a, st)[0]

        out[spec] = {"jit": _worst(split, ref), "stage": _worst(staged_out, ref),
                     "changes": rel_err(np.nan_to_num(ref[0]), np.nan_to_num(g))}
        if spec in ("clip=1.0", "int8"):  # the control: statistics of one shard are not the whole adjoint's
            out[spec]["per_shard"] = rel_err(jax.device_get(jax.jit(per_shard)(g, state)), ref[0])
    out["pipeline"] = pipeline_vs_stack("stage=4,data=2")
    return out


def _computations(hlo: str) -> dict:
    """``{name: text}`` of every computation of an HLO module's text."""
    out = {}
    for chunk in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", chunk)
        if m:
            out[m.group(1)] = chunk
    return out


def _gathered_elements(text: str) -> list:
    """Elements of the result of every all-gather in ``text`` (a tuple result: summed)."""
    sizes = []
    for m in re.finditer(r"=\s*(\(?[^=]*?\)?)\s+all-gather(?:-start)?\(", text):
        shapes = re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))
        sizes.append(sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes))
    return sizes


def fsdp(tmp: str) -> dict:
    """The compiled train step of a model whose params dominate, on one device and at
    fsdp=8: per-device peak memory, and where the all-gathers are."""
    from eae_jax.train import config

    config.PRESETS["params-heavy"] = dict(vocab_size=256, depth=16, dim=256, num_heads=4, num_kv_heads=4,
                                          ffn_hidden_dim=1024, seq_len=8, batch=8)
    out = {}
    for mesh in ("data=1", "fsdp=8"):
        cfg = TrainConfig(preset="params-heavy", mesh=mesh)
        model = cfg.model()
        sharding = RunSharding(cfg, model, mesh_for(cfg))
        stack = sharding.stack(cfg, None)
        tx = make_optimizer(cfg)
        shapes = jax.eval_shape(jax.tree_util.Partial(init_state, cfg, model, stack, tx))
        shardings = sharding.state_shardings(shapes, tx, stack)
        step = sharding.jit_step(make_train_step(cfg, stack, tx, model, param_shardings=shardings.params),
                                 shardings)
        compiled = step.lower(shapes, jax.ShapeDtypeStruct((1, cfg.batch, cfg.seq_len + 1), jnp.int32)).compile()
        mem = compiled.memory_analysis()
        hlo = compiled.as_text()
        comps = _computations(hlo)
        bodies = sorted(set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo)))
        shapes_one = jax.tree_util.tree_leaves(model.block.param_shapes(), is_leaf=lambda x: isinstance(x, tuple))
        out[mesh] = {
            "peak": mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes,
            "body_gathers": [_gathered_elements(comps.get(b, "")) for b in bodies],
            "body_reductions": [len(re.findall(r"(?:all-reduce|reduce-scatter)(?:-start)?\(", comps.get(b, "")))
                                for b in bodies],
            "all_gathers": _gathered_elements(hlo),
            "block_weights": int(sum(np.prod(s) for s in shapes_one if len(s) == 2)),
            "largest_block_leaf": int(max(np.prod(s) for s in shapes_one)),
            "depth": model.depth}
    return out


#: The run the multi-host test repeats on one process and on two: on the text folder
#: ``text`` beside the run directory (the test writes it), validated every 2 steps.
MULTIHOST_RUN = dict(preset="tiny", steps=3, batch=16, seq_len=8, warmup=0, log_every=1, checkpoint_every=3,
                     mesh="data=2,fsdp=4", val_every=2, val_batches=2, tensorboard=False)


def train_run(tmp: str) -> dict:
    """`MULTIHOST_RUN` into ``tmp`` (on every process of a multi-host run, from the JAX_*
    variables), its summary and log, and what this process saw."""
    jax.config.update("jax_disable_most_optimizations", True)
    text = os.path.join(os.path.dirname(os.path.abspath(tmp)), "text")
    summary = train(TrainConfig(out=tmp, text=[text], **MULTIHOST_RUN), log_fn=quiet)
    log = os.path.join(tmp, "log.jsonl")
    return {"summary": summary, "process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "local_devices": jax.local_device_count(),
            "log": [json.loads(line) for line in open(log)] if os.path.exists(log) else []}


#: ``--memory-budget`` on a mesh that splits the params (FSDP and tensor parallel, 4 devices).
BUDGET_MESH = "fsdp=2,model=2"
BUDGET_RUN = dict(preset="tiny", batch=8, seq_len=8, steps=2, warmup=0, log_every=1, plot=False,
                  tensorboard=False)


def budget(tmp: str) -> dict:
    """``--memory-budget`` on `BUDGET_MESH` at a budget one device cannot meet (below
    its params, gradients and accumulator): the plan (per device), what one device of
    the mesh holds of the params, and the run's losses beside the flags' storage."""
    jax.config.update("jax_disable_most_optimizations", True)
    from eae_jax.models import init_lm
    from eae_jax.reconstruct import BudgetError

    cfg = TrainConfig(mesh=BUDGET_MESH, **BUDGET_RUN)
    shapes = jax.eval_shape(lambda: init_lm(jax.random.key(0), cfg.model()))
    whole = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(shapes))
    shardings = RunSharding(cfg, cfg.model(), mesh_for(cfg)).param_shardings(shapes)
    one_device_shard = sum(int(np.prod(s.shard_shape(leaf.shape))) * leaf.dtype.itemsize for leaf, s in
                           zip(jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(shardings)))
    # Two thirds of what one device needs before any activation (params, f32 gradients, f32
    # accumulator): the mesh holds AdamW's state too, and fewer activations than plain autodiff.
    budget_bytes = 2 * whole
    runs = {}
    for name, extra in (("planned", {"memory_budget": str(budget_bytes)}), ("flags", {})):
        summary = train(TrainConfig(mesh=BUDGET_MESH, out=os.path.join(tmp, name), **BUDGET_RUN, **extra),
                        log_fn=quiet)
        log = [json.loads(line) for line in open(os.path.join(tmp, name, "log.jsonl"))]
        runs[name] = {"losses": [r["loss"] for r in log if "loss" in r], "plan": summary.get("memory_plan")}
    try:
        train(TrainConfig(mesh="data=1", out=os.path.join(tmp, "one"), memory_budget=str(budget_bytes),
                          **BUDGET_RUN), log_fn=quiet)
        one_device = "trained"
    except BudgetError as err:
        one_device = str(err)
    try:
        train(TrainConfig(mesh="stage=2,data=2", out=os.path.join(tmp, "pipe"), memory_budget="1", **BUDGET_RUN),
              log_fn=quiet)
        pipeline = "trained"
    except ValueError as err:
        pipeline = str(err)
    return {"whole_params": whole, "shard_params": one_device_shard, "budget": budget_bytes, "runs": runs,
            "one_device": one_device, "pipeline": pipeline}


def budget_mesh(tmp: str) -> dict:
    """`plan_memory` and a `MemoryBudget` given a data-parallel mesh of every device: the
    verified step's peak (one device's), and that of the step compiled by hand with the
    params replicated and the batch split, and unsplit."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import eae_jax
    from eae_jax.reconstruct import MemoryBudget, OnDevice, default_options, plan_memory
    from eae_jax.reconstruct.budget import planned_for
    from eae_jax.reconstruct.costs import Costs, OptionCost, SegmentCosts

    def block(w, x):
        return jnp.tanh(x @ w)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, x = jnp.ones((4, 64, 64)) / 64, jnp.ones((len(jax.devices()) * 8, 64))
    costs = Costs([SegmentCosts("blocks", 4, True, {"device": OptionCost(100, 50, 0, 1e-3, 0)})], "device", 300,
                  1e-2, 1024, 1024, "flops", "cpu")
    device = [o for o in default_options() if o.name == "device"]
    plain = eae_jax.reconstruct(block, storage=OnDevice())

    def step(p, xx):
        return jax.value_and_grad(lambda q: jnp.sum(plain(q, xx)))(p)

    def peak(jitted):
        ma = jitted.lower(params, x).compile().memory_analysis()
        return ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes

    split = (NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data")))
    stack = eae_jax.reconstruct(block)
    budgeted = eae_jax.reconstruct(block, memory_budget=MemoryBudget(1 << 30, options=device, costs=costs, mesh=mesh))
    return {"plan_memory": plan_memory(stack, params, x, 1 << 30, options=device, costs=costs, mesh=mesh).compiled_peak,
            "memory_budget": planned_for(budgeted, {}, params, x).compiled_peak,
            "split": peak(jax.jit(step, in_shardings=split)), "whole": peak(jax.jit(step))}


MODES = {"meshes": meshes, "passes": passes, "fsdp": fsdp, "train": train_run, "budget": budget,
         "budget_mesh": budget_mesh}

if __name__ == "__main__":
    mode, tmp = sys.argv[1], sys.argv[2]
    print(json.dumps(MODES[mode](tmp)))
