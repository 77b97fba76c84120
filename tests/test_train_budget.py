"""``eae-jax train --memory-budget`` (`eae_jax.train.budget`): the budget read as
bytes or a fraction, the floor refused before and by the planner, the
optimizer state moved to host memory when the plan says so (and left on the
device, with a message, where the backend has no host memory kind), and a
run that trains within its plan."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eae_jax.cli import main
from eae_jax.offload_optim import OffloadedOptimizer
from eae_jax.reconstruct import BudgetError, Scan, measure_costs, reconstruct
from eae_jax.reconstruct.costs import float_bytes, nbytes
from eae_jax.train import budget as train_budget
from eae_jax.train.budget import host_adamw, parse_memory_budget, plan_run

BLOCKS = [lambda t, tok: t[tok], Scan(lambda w, h: jnp.tanh(h @ w))]
PARAMS = [jnp.full((16, 8), 0.1), jnp.full((4, 8, 8), 0.1)]
TX = optax.adam(1e-3)


def small_run(budget, costs=None, log=None):
    return plan_run(budget, reconstruct(BLOCKS), PARAMS, 2, 8, TX, PARAMS, jnp.float32,
                    make_stack=lambda s: reconstruct(BLOCKS, storage=s), host_tx=lambda: host_adamw(1e-3, 0.0, None),
                    loss=lambda y, t: jnp.mean(y), log_fn=(log if log is not None else (lambda line: None)),
                    costs=costs)


@functools.lru_cache(maxsize=None)
def small_costs():
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    return measure_costs(reconstruct(BLOCKS), PARAMS, tokens, loss=lambda y, t: jnp.mean(y), loss_args=(tokens,))


def test_budgets_read_as_bytes_or_fractions():
    assert parse_memory_budget("6GiB") == 6 << 30 and parse_memory_budget("512MiB") == 512 << 20
    assert parse_memory_budget("0.5") == 0.5 and parse_memory_budget("1") == 1.0
    assert parse_memory_budget("1.5") == 2 and parse_memory_budget("4096") == 4096  # above 1: bytes
    for bad in ("0", "lots", "-1GiB", ""):
        with pytest.raises(ValueError, match="memory"):
            parse_memory_budget(bad)


def test_the_floor_is_refused_before_probing_and_then_by_the_planner():
    held = nbytes(PARAMS) + float_bytes(PARAMS) + nbytes(PARAMS)  # params, grads, accumulator
    with pytest.raises(BudgetError, match=rf"below the floor, which is at least .* \({held - 1} < {held} bytes\)"):
        small_run(held - 1, small_costs())
    # at exactly what every plan holds the early check passes; the measured floor is higher
    with pytest.raises(BudgetError, match=r"is below the floor \d"):
        small_run(held, small_costs())


def test_the_optimizer_moves_to_host_memory_when_its_state_does_not_fit():
    costs, reserved = small_costs(), nbytes(PARAMS)
    opt = nbytes(jax.eval_shape(TX.init, PARAMS))
    fits = small_run(small_run(1.0, costs).plan.floor + reserved, costs)  # the floor with the state on the device
    assert not fits.offloaded and fits.plan.compiled_peak <= fits.plan.budget
    lines = []
    run = small_run(fits.plan.floor + reserved - 1, costs, lines.append)
    assert run.offloaded and isinstance(run.tx, OffloadedOptimizer) and run.plan.optimizer_offloaded
    assert run.plan.floor == fits.plan.floor - opt
    assert any("pinned host memory" in line for line in lines)
    assert any(line.startswith("predicted peak") for line in lines)
    # the planned step and the host optimizer train as plain autodiff and AdamW on the device
    x = jnp.arange(16).reshape(2, 8) % 16

    def grads(stack, p):
        return jax.grad(lambda pp: jnp.mean(stack(pp, x)))(p)

    g = grads(run.stack, PARAMS)
    want = grads(reconstruct(BLOCKS), PARAMS)
    for a, b in zip(g, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    tx = host_adamw(1e-3, 0.0, None)
    new, _ = jax.jit(tx.apply)(g, tx.init(PARAMS), PARAMS)
    dev = optax.adamw(1e-3, weight_decay=0.0)
    upd, _ = dev.update(g, dev.init(PARAMS), PARAMS)
    for a, b in zip(new, optax.apply_updates(PARAMS, upd)):
        np.testing.assert_array_equal(a, b)


def test_without_a_host_memory_kind_the_state_stays_on_the_device(monkeypatch):
    costs, reserved = small_costs(), nbytes(PARAMS)
    floor = small_run(1.0, costs).plan.floor
    monkeypatch.setattr(train_budget, "host_memory_kind", lambda *a: None)
    lines = []
    run = small_run(floor + reserved - 1, costs, lines.append)
    assert run.plan.optimizer_offloaded and not run.offloaded and run.tx is TX
    assert any("has no pinned_host memory kind: it stays in device memory" in line for line in lines)


def test_a_run_with_a_memory_budget_prints_its_plan_and_trains(tmp_path, capsys, fast_compiles):
    code = main(["train", "--out", str(tmp_path / "run"), "--synthetic", "--depth", "2", "--dim", "16",
                 "--heads", "2", "--batch", "2", "--seq-len", "8", "--steps", "2", "--no-plot", "--no-tensorboard",
                 "--quiet", "--passes", "clip=1.0", "--memory-budget", "0.5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    plan = summary["memory_plan"]
    assert plan["compiled_peak"] <= plan["budget"] and np.isfinite(summary["final_loss"])
    assert "memory plan (per device" in out and "predicted step time" in out and "decoder_block" in out
    code = main(["train", "--out", str(tmp_path / "low"), "--synthetic", "--depth", "2", "--dim", "16", "--heads",
                 "2", "--batch", "2", "--seq-len", "8", "--steps", "2", "--memory-budget", "64KiB"])
    _, err = capsys.readouterr()
    assert code == 2 and "below the floor, which is at least" in err and len(err.strip().splitlines()) == 1


def test_a_run_whose_optimizer_state_moves_to_host_memory_trains_and_resumes_like_one_on_the_device(
        tmp_path, fast_compiles):
    from eae_jax.train import TrainConfig, train

    def run(out, budget, steps, log_fn=lambda m: None):
        return train(TrainConfig(preset="tiny", batch=2, seq_len=8, steps=steps, out=str(tmp_path / out),
                                 memory_budget=budget, log_every=1, checkpoint_every=2, plot=False,
                                 tensorboard=False), log_fn=log_fn)

    on_device = run("device", "1", 3)
    plan = on_device["memory_plan"]
    assert not plan["optimizer_in_host_memory"]
    # One byte below what holds the state on the device: the plan moves it to host memory.
    budget = str(plan["floor"] + plan["reserved_for_grad_accumulator"] - 1)
    part = run("host", budget, 2)
    assert part["memory_plan"]["optimizer_in_host_memory"]
    said = []
    done = run("host", budget, 3, said.append)  # resumes from the step-2 checkpoint
    assert done["resumed_from"] and done["steps_run"] == 1
    # the resumed run plans from the costs the first one measured, to the same plan
    assert [m for m in said if m.startswith("memory costs reused from")]
    assert done["memory_plan"]["segments"] == part["memory_plan"]["segments"]
    assert done["memory_plan"]["peak"] == part["memory_plan"]["peak"]
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "host" / "log.jsonl")) if "loss" in r]
    want = [r["loss"] for r in map(json.loads, open(tmp_path / "device" / "log.jsonl")) if "loss" in r]
    np.testing.assert_allclose(losses, want, rtol=1e-6)


def test_a_budget_on_an_fsdp_and_tensor_parallel_mesh_is_per_device(tmp_path):
    # 4 CPU devices in a fresh process (tests/parallel_worker.py `budget`): a budget of two
    # thirds of what one device needs before any activation is planned on fsdp=2 x model=2 and trains.
    from conftest import run_worker

    got = run_worker("budget", tmp_path, devices=4)
    whole, shard, budget = got["whole_params"], got["shard_params"], got["budget"]
    plan = got["runs"]["planned"]["plan"]
    assert shard < whole and plan["params"] == plan["grads"] == shard  # one device's shards (all float32)
    assert plan["reserved_for_grad_accumulator"] == shard
    assert plan["compiled_peak"] + plan["reserved_for_grad_accumulator"] <= budget
    assert abs(plan["peak"] - plan["compiled_peak"]) <= 0.05 * plan["compiled_peak"]
    # on a CPU mesh AdamW's state stays in device memory (docs/training.md), and the blocks keep less
    assert not plan["optimizer_in_host_memory"] and 2 * shard <= plan["optimizer"] <= 2 * shard + 16  # + counts
    blocks = [run for seg in plan["segments"] if seg["name"] == "decoder_block" for _, run in seg["runs"]]
    assert blocks and "slots" not in blocks  # gradient slots are plain device boundaries on a mesh
    assert "everything" not in blocks  # plain autodiff's activations do not fit
    np.testing.assert_allclose(got["runs"]["planned"]["losses"], got["runs"]["flags"]["losses"], rtol=1e-6)
    assert f"({budget} < {3 * whole} bytes)" in got["one_device"] and "below the floor" in got["one_device"]
    assert "not a pipeline" in got["pipeline"] and "stage=2" in got["pipeline"]
