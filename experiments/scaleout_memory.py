"""Per-device memory of the training step on meshes, measured against a formula (CPU).

    python experiments/scaleout_memory.py [--devices 8] [--out experiments/results/scaleout_memory.json]

For each mesh, the train step of ``eae-jax train`` (AdamW, fp32 params,
boundary-only reconstruction) is compiled for a model whose parameters
dominate its memory, and XLA's buffer assignment (``memory_analysis()``)
gives the per-device peak: arguments + outputs + temporaries - donated
aliases. Nothing runs: CPU devices (``--devices``, forced with XLA_FLAGS
before jax starts) stand in for GPUs, whose buffer assignment follows the
same program. The formula of docs/scale-out.md predicts it term by term:

* state ``P``: the params on the device, each leaf split over the axes that
  split it (``fsdp`` x ``model`` for weights, ``stage`` for the block
  ranges), 4 bytes each;
* the optimizer phase: params, both AdamW moments, the gradients and one
  param-sized temporary of the update: ``5 P``;
* the backward phase: params, moments and the gradients being accumulated
  (``4 P``), plus one block's weights gathered for the forward, again for
  the backward with that block's full gradient beside them (split over
  ``model`` only), plus the activations: the stored boundaries of the
  local batch (a pipeline keeps its stage's for every tick, and one
  tick's gradient of the stage's blocks before it is accumulated), one
  block's internals while it is recomputed and differentiated (q, k, v and
  the attention output, scores and probabilities, the FFN's hidden
  activations and their gradients; heads and FFN width split over
  ``model``) and the logits with their softmax and gradient (vocabulary
  split over ``model``);
* the peak is the larger phase.

A second table compiles the default storage (boundaries in gradient slots)
against plain on-device boundaries on each mesh and counts the collectives
that move boundaries: the reason `eae_jax.parallel.Sharded` keeps gradient
slots to one-device meshes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scaleout_memory.json"))
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax

    from eae_jax.train import config

    config.PRESETS["params-heavy"] = dict(vocab_size=1024, depth=16, dim=256, num_heads=4, num_kv_heads=4,
                                          ffn_hidden_dim=1024, seq_len=256, batch=16)
    meshes = ["data=1", "data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,model=2", "data=2,model=4", "model=4",
              "stage=4,data=2"]
    rows = [measure(mesh) for mesh in meshes]
    storage = [collectives(mesh) for mesh in ("data=8", "fsdp=8", "data=2,fsdp=4", "data=2,model=4")]
    print(f"{'mesh':<16}{'measured MiB':>14}{'formula MiB':>13}{'ratio':>8}   P / gathered / activations MiB")
    for r in rows:
        f = r["formula"]
        print(f"{r['mesh']:<16}{r['peak'] / 2**20:>14.1f}{f['total'] / 2**20:>13.1f}{r['peak'] / f['total']:>8.3f}   "
              f"{f['params'] / 2**20:.1f} / {f['gathered'] / 2**20:.1f} / {f['activations'] / 2**20:.1f}")
    print(f"\n{'mesh':<16}{'storage':<12}{'peak MiB':>10}{'all-gathers (MiB)':>20}{'all-to-alls (MiB)':>20}")
    for r in storage:
        for kind in ("grad_slots", "device"):
            c = r[kind]
            print(f"{r['mesh']:<16}{kind:<12}{c['peak'] / 2**20:>10.1f}"
                  f"{'%d (%.2f)' % (c['all-gather'], c['all-gather bytes'] / 2**20):>20}"
                  f"{'%d (%.2f)' % (c['all-to-all'], c['all-to-all bytes'] / 2**20):>20}")
    result = {"command": " ".join(["python", "experiments/scaleout_memory.py"] + list(argv or sys.argv[1:])),
              "jax": jax.__version__, "machine": platform.machine(), "devices": args.devices,
              "config": config.PRESETS["params-heavy"], "meshes": rows, "storage": storage,
              "date": time.strftime("%Y-%m-%d")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


def _compile(mesh: str, storage=None):
    """The compiled train step of the ``params-heavy`` preset on ``mesh``, and its config."""
    import jax
    import jax.numpy as jnp

    from eae_jax.models.llama import lm_stack
    from eae_jax.passes.spec import parse_passes
    from eae_jax.train import TrainConfig, init_state, make_optimizer, make_train_step
    from eae_jax.train.sharding import RunSharding, mesh_for

    cfg = TrainConfig(preset="params-heavy", mesh=mesh)
    model = cfg.model()
    sharding = RunSharding(cfg, model, mesh_for(cfg))
    stack = sharding.stack(cfg, parse_passes(""))
    if storage is not None:  # the same gathered blocks, with this storage forced on every segment
        from jax.sharding import PartitionSpec

        from eae_jax.blocks.transformer import decoder_block
        from eae_jax.parallel import gather_block

        axes = sharding.batch_axes
        block = gather_block(decoder_block(model.block), sharding.block_specs(), sharding.mesh,
                             x_spec=PartitionSpec((axes[0] if len(axes) == 1 else axes) or None))
        stack = lm_stack(model, block_fn=block, storage=storage)
    tx = make_optimizer(cfg)
    shapes = jax.eval_shape(jax.tree_util.Partial(init_state, cfg, model, stack, tx))
    shardings = sharding.state_shardings(shapes, tx, stack)
    step = sharding.jit_step(make_train_step(cfg, stack, tx, model, param_shardings=shardings.params), shardings)
    tokens = jax.ShapeDtypeStruct(sharding.arrange_tokens(jnp.zeros((cfg.batch, cfg.seq_len + 1))).shape, jnp.int32)
    return step.lower(shapes, tokens).compile(), cfg, sharding


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def formula(cfg, sizes: dict) -> dict:
    """The per-device bytes docs/scale-out.md predicts for the train step (fp32, AdamW)."""
    import numpy as np

    model = cfg.model()
    f, t, s, d = (sizes.get(a, 1) for a in ("fsdp", "model", "stage", "data"))
    block = model.block.param_shapes()
    weights = sum(int(np.prod(sh)) for sh in (block["attn"]["wq"], block["attn"]["wk"], block["attn"]["wv"],
                                                block["attn"]["wo"], block["ffn"]["w_gate"], block["ffn"]["w_up"],
                                                block["ffn"]["w_down"]))
    norms = 2 * model.dim
    kv_split = t if model.block.num_kv_heads % t == 0 else 1
    kv = 2 * int(np.prod(block["attn"]["wk"]))
    # a block's weights split over fsdp x model (k/v over model only when the kv heads split)
    block_local = (weights - kv) / (f * t) + kv / (f * kv_split) + norms
    tables = 2 * model.vocab_size * model.dim / (f * t) + model.dim
    params = 4 * (model.depth / s * block_local + tables)  # bytes, fp32
    gathered_block = ((weights - kv) / t + kv / kv_split) * 4
    gathered = 3 * gathered_block if f > 1 else 0.0  # forward copy, backward copy and the block's full gradient
    micro = cfg.batch // cfg.microbatches
    if s > 1:  # the pipeline: one microbatch per tick, the stage's boundaries kept for every tick
        from eae_jax.parallel.pipeline import ticks

        boundaries = ticks(s, cfg.microbatches) * model.depth / s * micro // d * cfg.seq_len * model.dim * 4
        boundaries += 4 * model.depth / s * block_local  # a tick's gradient of the stage's blocks
        logit_rows = cfg.batch // d
    else:
        boundaries = model.depth * micro // (d * f) * cfg.seq_len * model.dim * 4
        logit_rows = micro // (d * f)
    logits = 3 * logit_rows * cfg.seq_len * model.vocab_size / t * 4  # logits, softmax, their gradient
    rows = micro // d if s > 1 else micro // (d * f)
    seq, width, heads, hidden = cfg.seq_len, model.dim, model.block.num_heads / t, model.block.ffn_hidden_dim / t
    internals = 4 * rows * (4 * seq * width + 2 * heads * seq * seq + 4 * seq * hidden)
    activations = boundaries + internals + logits
    optimizer, backward = 5 * params, 4 * params + gathered + activations
    return {"params": params, "gathered": gathered, "activations": activations, "optimizer_phase": optimizer,
            "backward_phase": backward, "total": max(optimizer, backward)}


def measure(mesh: str) -> dict:
    compiled, cfg, sharding = _compile(mesh)
    return {"mesh": mesh, "peak": _peak(compiled), "formula": formula(cfg, sharding.sizes)}


def collectives(mesh: str) -> dict:
    """Peak and boundary-moving collectives of the gradient-slot storage against on-device boundaries."""
    from eae_jax.reconstruct import GradSlots, OnDevice

    out = {"mesh": mesh}
    for kind, storage in (("grad_slots", GradSlots()), ("device", OnDevice())):
        compiled, _, _ = _compile(mesh, storage)
        text = compiled.as_text()
        out[kind] = {"peak": _peak(compiled)}
        for op in ("all-gather", "all-to-all"):
            sizes = _result_bytes(text, op)
            out[kind][op], out[kind][op + " bytes"] = len(sizes), sum(sizes)
    return out


def _result_bytes(hlo: str, op: str) -> list:
    """Bytes of the result of every ``op`` instruction in an HLO module's text (a tuple: summed).
    A collective in a loop body counts once, however many times the loop runs it."""
    import numpy as np

    width = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
    out = []
    for m in re.finditer(rf"=\s*(\(?[^=]*?\)?)\s+{op}(?:-start)?\(", hlo):
        out.append(sum(width.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                       for dt, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", m.group(1))))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
