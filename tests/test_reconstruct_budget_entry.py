"""The memory-budget entry points (`eae_jax.reconstruct.budget`) called
directly on a 4-block stack of 8 x 8 matmuls, with hand-made `Costs` (no
probes): `MemoryBudget`, `plan_memory`'s arguments, its verifying loop
(every threshold met exactly, the margin it adds), `planned_for`'s cache,
`step_peak` against the compiled step built by hand, `runtime_reserve`.

"The peak" is argument + output + temp - alias bytes of the compiled
step's ``memory_analysis()``, computed here from the analysis itself.
Each test compiles a handful of tiny steps (the whole file takes seconds);
`test_reconstruct_budget.py` checks the planner on measured costs.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_worker
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import eae_jax
from eae_jax.passes import clip_by_norm
from eae_jax.reconstruct import (BudgetError, Costs, MemoryBudget, OnDevice, Policy, default_options, make_plan,
                                 plan_memory, runtime_reserve)
from eae_jax.reconstruct.budget import ACCELERATOR_RESERVE, _data_parallel, planned_for, step_peak
from eae_jax.reconstruct.costs import OptionCost, SegmentCosts, measure_costs
from eae_jax.reconstruct.planner import fmt_bytes


def block(w, x):
    return jnp.tanh(x @ w)


PARAMS = 0.1 * jax.random.normal(jax.random.key(0), (4, 8, 8))
X = jax.random.normal(jax.random.key(1), (2, 8))
TARGET = jnp.ones((2, 8))
DEVICE = [o for o in default_options() if o.name == "device"]


def tiny_costs(segments=((4, True),), base_peak=300) -> Costs:
    """Segments of (depth, scanned) whose only option is "device"; for one scanned segment of 4 blocks
    the predicted peak is ``base_peak + 200`` bytes (the floor; 500 by default): fixed ``base_peak - 2 *
    100``, plus 4 blocks of 50 working and 50 kept bytes."""
    segs = [SegmentCosts(f"segment{i}", depth, scanned, {"device": OptionCost(100, 50, 0, 1e-3, 0)})
            for i, (depth, scanned) in enumerate(segments)]
    return Costs(segs, "device", base_peak, 1e-2, 1024, 1024, "flops", "cpu")


FLOOR = 500


def peak_of(compiled) -> int:
    ma = compiled.memory_analysis()
    return ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes


def plain_data(plan):
    """The plan with its options by name (`default_options` makes new policy functions each call)."""
    return dataclasses.replace(plan, options=list(plan.options))


def sum_loss(out):
    return jnp.sum(out.astype(jnp.float32))


def reference_peak(stack, loss=sum_loss, args=(), params=PARAMS, x=X):
    """The peak of the gradient step of ``stack`` written out by hand: loss of its output, every input an argument."""
    def step(p, xx, a):
        return jax.value_and_grad(lambda pp: loss(stack(pp, xx), *a))(p)

    return peak_of(jax.jit(step).lower(params, x, tuple(args)).compile())


def counting(loss, calls):
    def counted(out, *args):
        calls.append(len(args))
        return loss(out, *args)

    return counted


def test_a_memory_budget_reads_its_budget_when_made():
    assert MemoryBudget("6GiB").bytes_or_fraction == 6 << 30 and MemoryBudget(0.5).bytes_or_fraction == 0.5
    b = MemoryBudget(1000)
    assert (b.budget, b.optimizer_bytes, b.offload_optimizer, b.loss, b.loss_args, b.timing, b.options, b.costs,
            b.mesh, b.verify, b.reserve) == (1000, 0, "auto", None, (), "flops", None, None, None, True, "auto")
    with pytest.raises(ValueError) as err:
        MemoryBudget("lots")
    assert str(err.value) == "cannot read memory budget 'lots'; write e.g. '6GiB', '512MiB', '8GB' or a number of bytes"


def test_plan_memory_unverified_is_the_planners_plan_with_the_reserve_set_aside():
    stack, costs = eae_jax.reconstruct(block), tiny_costs()
    plan = plan_memory(stack, PARAMS, X, 600, costs=costs, verify=False)
    assert plain_data(plan) == plain_data(make_plan(costs, 600)) and plan.compiled_peak is None
    assert plan.reserve == 0  # 'auto': 0 on the CPU
    assert (plan.peak, plan.floor, plan.optimizer, plan.segments[0].runs) == (FLOOR, FLOOR, 0, ((4, "device"),))
    assert list(plan.options) == [o.name for o in default_options()]
    # the reserve is taken off the budget: met exactly at 100, refused a byte above
    at = plan_memory(stack, PARAMS, X, 600, costs=costs, verify=False, reserve=100.0, options=DEVICE)
    assert at == dataclasses.replace(make_plan(costs, 600, margin=100, options=DEVICE), reserve=100)
    assert type(at.reserve) is int and list(at.options) == ["device"]
    with pytest.raises(BudgetError) as err:
        plan_memory(stack, PARAMS, X, 600, costs=costs, verify=False, reserve=101)
    assert str(err.value) == ("memory budget 600 B: no plan fits once 101 B are set aside (the runtime's reserve and "
                              "what the compiled step needs beyond its prediction; predicted floor 500 B)")
    assert plan_memory(stack, PARAMS, X, 600, costs=costs, verify=False, reserve=0).reserve == 0
    with pytest.raises(ValueError) as err:
        plan_memory(stack, PARAMS, X, 600, costs=costs, verify=False, reserve=-1)
    assert str(err.value) == "reserve must be 'auto' or a byte count >= 0, got -1"


def test_plan_memory_hands_the_optimizer_state_to_the_planner():
    stack, costs = eae_jax.reconstruct(block), tiny_costs()
    kept = plan_memory(stack, PARAMS, X, 600, costs=costs, verify=False, optimizer_bytes=100, offload_optimizer=False)
    assert (kept.optimizer, kept.optimizer_offloaded, kept.peak, kept.floor) == (100, False, 600, 600)
    moved = plan_memory(stack, PARAMS, X, 600, costs=costs, verify=False, optimizer_bytes=100, offload_optimizer=True)
    assert (moved.optimizer, moved.optimizer_offloaded, moved.peak) == (0, True, FLOOR)
    with pytest.raises(BudgetError, match=r"^memory budget 599 B is below the floor 600 B \(599 < 600 bytes\)"):
        plan_memory(stack, PARAMS, X, 599, costs=costs, verify=False, optimizer_bytes=100, offload_optimizer=False)
    # adam keeps mu and nu of the float32 params and an int32 count
    adam = plan_memory(stack, PARAMS, X, 1 << 20, costs=costs, verify=False, optimizer=optax.adam(1e-3))
    assert adam.optimizer == 2 * PARAMS.size * 4 + 4 and adam.optimizer_offloaded is False
    with pytest.raises(ValueError) as err:
        plan_memory(stack, PARAMS, X, 600, costs=costs, optimizer=optax.adam(1e-3), optimizer_bytes=4)
    assert str(err.value) == "give optimizer or optimizer_bytes, not both"


def test_plan_memory_measures_the_costs_it_is_not_given():
    stack, seen = eae_jax.reconstruct(lambda w, x, s: jnp.tanh(x @ w * s)), []
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rep = NamedSharding(mesh, PartitionSpec())

    def shardings(p_spec, x_spec):
        seen.append((p_spec.shape, x_spec.shape))
        return (rep, NamedSharding(mesh, PartitionSpec("data")), rep, rep)

    # a stack that runs plain autodiff where the plan says "device"
    wrap = lambda stores: [Policy("everything") if isinstance(s, OnDevice) else s for s in stores]  # noqa: E731
    kw = dict(loss=lambda out, t: jnp.sum(out * jnp.mean(t)), loss_args=(jnp.ones((32, 32)),), options=DEVICE,
              in_shardings=shardings, wrap=wrap)
    side = jnp.ones(8)
    plan = plan_memory(stack, PARAMS, X, 1 << 30, side, verify=False, **kw)
    assert seen and {xs for _, xs in seen} == {(2, 8)}  # the probes compiled with the shardings given
    assert plan.costs == measure_costs(stack, PARAMS, X, side, **kw)
    assert plan.costs.timing == "flops" and list(plan.costs.segments[0].options) == ["device"]
    with pytest.raises(ValueError) as err:
        plan_memory(stack, PARAMS, X, 1 << 30, side, timing="guess", **kw)
    assert str(err.value) == "timing must be one of ('flops', 'profile'), got 'guess'"
    with pytest.raises(ValueError) as err:
        plan_memory(stack, PARAMS, X, 1 << 30, side, mesh=mesh, **kw)
    assert str(err.value) == "give mesh (data parallel) or in_shardings, not both"


def test_plan_memory_verifies_once_when_the_compiled_step_fits_exactly():
    stack, costs, calls = eae_jax.reconstruct(block), tiny_costs(), []
    loss = counting(lambda out, t: jnp.sum((out - t) ** 2), calls)
    want = reference_peak(eae_jax.reconstruct(block, storage=OnDevice()), loss, (TARGET,))
    calls.clear()
    # the compiled peak, 100 bytes of optimizer state and a 64-byte reserve fill the budget to the byte
    plan = plan_memory(stack, PARAMS, X, want + 100 + 64, loss=loss, loss_args=(TARGET,), optimizer_bytes=100,
                       offload_optimizer=False, reserve=64, options=DEVICE, costs=costs)
    assert plan.compiled_peak == want + 100 and plan.optimizer == 100 and plan.reserve == 64
    assert calls == [1]  # one compile, the loss given its target
    assert plan.segments == make_plan(costs, want + 164, margin=64, options=DEVICE, optimizer_bytes=100).segments
    # the verifying compile runs the wrapped storages
    wrap = lambda stores: [Policy("everything")] * len(stores)  # noqa: E731
    wrapped = plan_memory(stack, PARAMS, X, 1 << 20, options=DEVICE, costs=costs, wrap=wrap)
    assert wrapped.compiled_peak == reference_peak(eae_jax.reconstruct(block, storage=Policy("everything")))
    assert wrapped.storages == [OnDevice()]  # the plan keeps the unwrapped storages


def test_plan_memory_sets_aside_what_the_compiled_step_needs_beyond_the_prediction():
    stack, costs, calls = eae_jax.reconstruct(block), tiny_costs(), []
    loss = counting(sum_loss, calls)
    want = reference_peak(eae_jax.reconstruct(block, storage=OnDevice()))
    calls.clear()
    # predicted 500 B fits 700 - 200; the step needs `want`: the margin becomes 200 + (want + 200 - 700)
    with pytest.raises(BudgetError) as err:
        plan_memory(stack, PARAMS, X, 700, loss=loss, reserve=200, options=DEVICE, costs=costs)
    assert str(err.value) == (f"memory budget 700 B: no plan fits once {fmt_bytes(want - 300)} are set aside (the "
                              "runtime's reserve and what the compiled step needs beyond its prediction; predicted "
                              "floor 500 B)")
    assert calls == [0]


def test_plan_memory_refuses_a_step_still_over_the_budget_after_three_plans():
    want = reference_peak(eae_jax.reconstruct(block, storage=OnDevice()))
    stack, costs, calls = eae_jax.reconstruct(block), tiny_costs(base_peak=want - 204), []  # floor: want - 4
    loss = counting(sum_loss, calls)
    # one byte short: each plan sets aside one byte more and is the same plan, the last at the floor exactly
    with pytest.raises(BudgetError) as err:
        plan_memory(stack, PARAMS, X, want + 10 - 1, loss=loss, reserve=10, options=DEVICE, costs=costs)
    assert str(err.value) == (f"memory budget {fmt_bytes(want + 9)}: the compiled step still needs {fmt_bytes(want)} "
                              f"+ {fmt_bytes(10)} kept free after 3 plans, each leaving what the last one needed "
                              f"beyond its prediction unused (predicted {fmt_bytes(want - 4)})")
    assert calls == [0, 0, 0, 0]  # the first plan and three more, each compiled


def test_planned_for_plans_once_per_input_shapes_with_the_budgets_options():
    costs = tiny_costs()
    budget = MemoryBudget(600, optimizer_bytes=100, offload_optimizer=True, options=DEVICE, costs=costs,
                          verify=False, reserve=50)
    stack, plans = eae_jax.reconstruct(block, memory_budget=budget), {}
    plan = planned_for(stack, plans, PARAMS, X)
    assert plain_data(plan) == plain_data(plan_memory(stack, PARAMS, X, 600, optimizer_bytes=100,
                                                      offload_optimizer=True, options=DEVICE, costs=costs,
                                                      verify=False, reserve=50))
    assert (plan.optimizer_offloaded, plan.reserve, list(plan.options), plan.compiled_peak) == (True, 50, ["device"],
                                                                                                None)
    # the same shapes and dtypes, other values or array types: the plan made first
    assert planned_for(stack, plans, np.zeros((4, 8, 8), np.float32), jnp.ones((2, 8))) is plan and len(plans) == 1
    side = planned_for(stack, plans, PARAMS, X, 1.0)  # a Python float reads as a float32 scalar
    assert planned_for(stack, plans, PARAMS, X, jnp.float32(2)) is side and side is not plan
    others = [planned_for(stack, plans, PARAMS, jnp.ones((3, 8))),
              planned_for(stack, plans, PARAMS, X.astype(jnp.bfloat16)),
              planned_for(stack, plans, [PARAMS], X), planned_for(stack, plans, PARAMS, X, (1.0,)),
              planned_for(stack, plans, PARAMS, X, jnp.ones(2))]
    others += [planned_for(stack, plans, jnp.ones((5, 8, 8)), X),
               planned_for(stack, plans, PARAMS.astype(jnp.bfloat16), X)]
    assert len(plans) == 9 and len({id(p) for p in [plan, side, *others]}) == 9
    # shapes alone (as plan_memory takes them) find the plan of the arrays
    shapes = jax.eval_shape(lambda *a: a, PARAMS, X, jnp.float32(2))
    assert planned_for(stack, plans, *shapes) is side and len(plans) == 9


def test_planned_for_hands_on_the_loss_and_verifies():
    costs, calls = tiny_costs(), []
    loss = counting(lambda out, t: jnp.sum((out - t) ** 2), calls)
    want = reference_peak(eae_jax.reconstruct(block, storage=OnDevice()), loss, (TARGET,))
    calls.clear()
    budget = MemoryBudget(1 << 20, loss=loss, loss_args=(TARGET,), options=DEVICE, costs=costs)
    plan = planned_for(eae_jax.reconstruct(block, memory_budget=budget), {}, PARAMS, X)
    assert plan.compiled_peak == want and calls == [1]
    # the side input reaches the verifying compile
    sided = lambda w, x, s: jnp.tanh(x @ w * s)  # noqa: E731
    plain = eae_jax.reconstruct(sided, storage=OnDevice())
    want = peak_of(jax.jit(lambda p, x, s, t: jax.value_and_grad(lambda q: loss(plain(q, x, side=s), t))(p)).lower(
        PARAMS, X, jnp.ones(8), TARGET).compile())
    plan = planned_for(eae_jax.reconstruct(sided, memory_budget=budget), {}, PARAMS, X, jnp.ones(8))
    assert plan.compiled_peak == want


@pytest.mark.parametrize("field, value, message", [
    ("offload_optimizer", "sometimes", "offload_optimizer must be 'auto', True or False, got 'sometimes'"),
    ("reserve", -2, "reserve must be 'auto' or a byte count >= 0, got -2"),
    ("timing", "guess", None),
])
def test_planned_for_hands_on_each_planning_option(field, value, message):
    costs = None if field == "timing" else tiny_costs()
    budget = MemoryBudget(1 << 20, options=DEVICE, costs=costs, verify=False, **{field: value})
    stack = eae_jax.reconstruct(block, memory_budget=budget)
    with pytest.raises(ValueError) as err:
        planned_for(stack, {}, PARAMS, X)
    with pytest.raises(ValueError) as want:
        plan_memory(stack, PARAMS, X, 1 << 20, options=DEVICE, costs=costs, verify=False, **{field: value})
    assert str(err.value) == str(want.value) and (message is None or str(err.value) == message)


@pytest.mark.parametrize("storage, wrap", [(OnDevice(), None), (Policy("everything"), None),
                                           (Policy("everything"), lambda stores: [Policy("everything")] * len(stores))])
def test_step_peak_is_the_peak_of_the_step_written_by_hand(storage, wrap):
    costs = tiny_costs()
    stack = eae_jax.reconstruct(block)
    plan = make_plan(costs, 1 << 20, options=[DEVICE[0]._replace(storage=storage if wrap is None else OnDevice())])
    assert step_peak(stack, plan, PARAMS, X, wrap=wrap) == reference_peak(eae_jax.reconstruct(block, storage=storage))


def test_step_peak_of_a_step_with_a_loss_side_input_passes_and_several_blocks():
    # blocks given as a list (params a list), a side input, a clipping pass, no statistics
    def first(w, x, s):
        return jnp.tanh(x @ w + s)

    blocks, params = [first, eae_jax.Scan(lambda w, x, s: block(w, x) * s)], [PARAMS[0], PARAMS[1:]]
    side = jnp.full((8,), 0.5)
    loss = lambda out, t: jnp.sum((out - t) ** 2)  # noqa: E731
    for kw in ({}, {"passes": clip_by_norm(1e-3), "stats": False}):
        stack = eae_jax.reconstruct(blocks, **kw)
        plan = make_plan(tiny_costs(((1, False), (3, True))), 1 << 20)
        plain = eae_jax.reconstruct(blocks, storage=plan.storages, **kw)
        got = step_peak(stack, plan, params, X, side, loss=loss, loss_args=(TARGET,))

        def step(p, xx, s, t):
            return jax.value_and_grad(lambda pp: loss(plain(pp, xx, side=s), t))(p)

        assert got == peak_of(jax.jit(step).lower(params, X, side, TARGET).compile()), kw


def test_step_peak_of_a_block_state_stack_reads_its_output():
    stack = eae_jax.reconstruct(lambda p, x: (jnp.tanh(x @ p["w"]), p["n"] + 1), block_state=True)
    params = {"w": PARAMS, "n": jnp.zeros((4, 3))}
    plan = make_plan(tiny_costs(), 1 << 20)
    plain = eae_jax.reconstruct(lambda p, x: (jnp.tanh(x @ p["w"]), p["n"] + 1), block_state=True,
                                storage=plan.storages)
    want = reference_peak(lambda p, x: plain(p, x)[0], params=params)
    assert step_peak(stack, plan, params, X) == want


def test_step_peak_lays_the_step_out_with_the_shardings_given():
    mesh, seen = Mesh(np.array(jax.devices()[:1]), ("data",)), []
    stack = eae_jax.reconstruct(block)
    plan = make_plan(tiny_costs(), 1 << 20)

    def shardings(p_spec, x_spec):
        seen.append((p_spec, x_spec))
        return (NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data")), None, ())

    got = step_peak(stack, plan, PARAMS, X, in_shardings=shardings)
    assert seen == [(jax.ShapeDtypeStruct((4, 8, 8), jnp.float32), jax.ShapeDtypeStruct((2, 8), jnp.float32))]
    assert got == reference_peak(eae_jax.reconstruct(block, storage=plan.storages))


def test_data_parallel_shardings_replicate_params_and_split_the_batch_over_the_first_axis():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("batch", "model"))
    p, x, side, args = _data_parallel(mesh)({"a": PARAMS, "b": [X]}, X)
    rep = NamedSharding(mesh, PartitionSpec())
    assert p == {"a": rep, "b": [rep]} and x == NamedSharding(mesh, PartitionSpec("batch"))
    assert side is None and args is None


def test_the_runtime_reserve_is_kept_on_accelerators_only():
    assert runtime_reserve() == 0 and runtime_reserve(jax.devices("cpu")[0]) == 0
    assert ACCELERATOR_RESERVE == 64 << 20
    for platform in ("gpu", "tpu"):
        assert runtime_reserve(types.SimpleNamespace(platform=platform)) == 64 << 20


def test_a_data_parallel_mesh_reaches_the_verifying_compile(tmp_path):
    # 2 CPU devices in a fresh process: the batch split over them, the params replicated
    got = run_worker("budget_mesh", tmp_path, devices=2)
    assert got["plan_memory"] == got["memory_budget"] == got["split"] < got["whole"], got
