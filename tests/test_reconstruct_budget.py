"""The memory planner (`eae_jax.reconstruct.budget`, `.planner`, `.costs`): its
predicted peak against the compiled step's ``memory_analysis()``, its
gradients against plain `jax.grad`, the floor it refuses below, and the
optimizer state it moves to host memory when the budget cannot hold it.

"The peak" is argument + output + temp - alias bytes of the compiled step
(`costs.compiled_peak`): device memory only, what a GPU allocator's
``peak_bytes_in_use`` reaches for a step that holds nothing else. These
are XLA:CPU's numbers; the GPU's are measured by experiments/bench_budget.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rel_err
from jax.ad_checkpoint import checkpoint_name

import eae_jax
from eae_jax.blocks import BlockConfig
from eae_jax.models import LMConfig, cross_entropy, init_lm, lm_apply, lm_stack, merge_grads, split_params
from eae_jax.passes import clip_by_norm
from eae_jax.reconstruct import (BudgetError, Costs, MemoryBudget, OnDevice, Policy, Runs, default_options, make_plan,
                                 measure_costs, parse_budget, plan_memory, runtime_reserve)
from eae_jax.reconstruct.budget import step_peak
from eae_jax.reconstruct.costs import compiled_peak, jaxpr_flops, probe_depth


def ffn_block(p, h):
    """A residual SwiGLU block naming its gate and up projections like `eae_jax.blocks.swiglu`."""
    gate = checkpoint_name(h @ p["w1"], "ffn_gate")
    up = checkpoint_name(h @ p["w3"], "ffn_up")
    return h + (jax.nn.silu(gate) * up) @ p["w2"]


def ffn_params(depth, dim=32, hidden=96, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"w1": 0.2 * jax.random.normal(k[0], (depth, dim, hidden)),
            "w3": 0.2 * jax.random.normal(k[1], (depth, dim, hidden)),
            "w2": 0.2 * jax.random.normal(k[2], (depth, hidden, dim))}


X = jax.random.normal(jax.random.key(9), (64, 32))


@functools.lru_cache(maxsize=None)
def ffn_costs(passes: bool = False):
    stack = eae_jax.reconstruct(ffn_block, passes=clip_by_norm(1.0) if passes else None)
    options = [o for o in default_options() if o.name in ("device", "ffn", "everything")] if passes else None
    return stack, measure_costs(stack, ffn_params(8), X, options=options)


LM = LMConfig(vocab_size=128, depth=6, block=BlockConfig(dim=32, num_heads=4, num_kv_heads=2, ffn_hidden_dim=96))
TOKENS = jax.random.randint(jax.random.key(3), (2, 33), 0, 128)
LM_OPTIONS = [o for o in default_options() if o.name in ("device", "ffn", "dots", "everything")]


@functools.lru_cache(maxsize=None)
def lm_costs():
    params = split_params(init_lm(jax.random.key(0), LM), LM)
    stack = lm_stack(LM)
    costs = measure_costs(stack, params, TOKENS[:, :-1], loss=cross_entropy, loss_args=(TOKENS[:, 1:],),
                          options=LM_OPTIONS, block_options=("device",))
    return stack, params, costs


@functools.lru_cache(maxsize=None)
def lm_reference():
    """Loss and gradients of plain autodiff over the LM (`lm_apply`)."""
    loss = lambda p: cross_entropy(lm_apply(p, TOKENS[:, :-1], LM), TOKENS[:, 1:])  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(init_lm(jax.random.key(0), LM))


def test_budgets_are_read_as_bytes_or_a_fraction():
    assert parse_budget("6GiB") == 6 << 30 and parse_budget("512 MiB") == 512 << 20
    assert parse_budget("8GB") == 8 * 10**9 and parse_budget("6e9") == 6 * 10**9 and parse_budget(4096) == 4096
    assert parse_budget(1.0) == 1.0 and parse_budget(0.25) == 0.25
    for bad, match in ((0, "> 0 bytes"), (1.5, r"fractional memory budget must lie in \(0, 1\]"), ("6 parsecs", "cannot read"),
                       (True, "bytes or a fraction"), ("0.1", "at least one byte"), (None, "bytes")):
        with pytest.raises(ValueError, match=match):
            parse_budget(bad)


@pytest.mark.parametrize("budget", [0.2, 0.4, 0.75, 1.0, 1_000_000])  # the floor is at 0.17
def test_predicted_peak_is_within_5_percent_of_the_compiled_step(budget):
    stack, costs = ffn_costs()
    plan = make_plan(costs, budget)
    compiled = step_peak(stack, plan, ffn_params(8), X)
    assert abs(plan.peak / compiled - 1) <= 0.05, (plan.segments, plan.peak, compiled)
    assert plan.peak <= plan.budget


@pytest.mark.parametrize("budget", [0.3, 0.6, 1.0])
def test_heterogeneous_lm_stack_prediction_and_gradients(budget):
    stack, params, costs = lm_costs()
    plan = make_plan(costs, budget, options=LM_OPTIONS)
    planned = lm_stack(LM, storage=plan.storages)

    def loss(p):
        return cross_entropy(planned(p, TOKENS[:, :-1]), TOKENS[:, 1:])

    step = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    assert abs(plan.peak / compiled_peak(step) - 1) <= 0.05, (plan.segments, plan.peak, compiled_peak(step))
    value, grads = step(params)
    want_value, want = lm_reference()
    assert rel_err(value, want_value) <= 1e-6
    chex.assert_trees_all_close(merge_grads(grads, LM), want, rtol=2e-4, atol=2e-6)


def test_plans_mix_storages_within_a_scan_and_keep_the_gradients():
    stack, costs = ffn_costs()
    seen = set()
    for fraction in (0.2, 0.3, 0.45, 0.6, 0.75):
        plan = make_plan(costs, fraction)
        seen.add(plan.segments[0].runs)
        params = ffn_params(8)
        planned = eae_jax.reconstruct(ffn_block, storage=plan.storages)
        got = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(planned(p, X)))))(params)

        def plain(p):
            h = X
            for i in range(8):
                h = ffn_block(jax.tree_util.tree_map(lambda a: a[i], p), h)
            return jnp.sum(jnp.sin(h))

        chex.assert_trees_all_close(got, jax.grad(plain)(params), rtol=1e-5, atol=1e-6)
    mixed = [runs for runs in seen if len(runs) > 1]
    assert mixed, seen  # some budget falls between two options
    assert all(n >= 2 for runs in mixed for n, _ in runs)  # no one-block run (XLA would inline its loop)
    assert any(isinstance(make_plan(costs, f).storages[0], Runs) for f in (0.2, 0.3, 0.45, 0.6, 0.75))


def test_a_pass_chain_is_part_of_what_the_probes_measure():
    stack, costs = ffn_costs(passes=True)
    plan = make_plan(costs, 0.5, options=[o for o in default_options() if o.name in costs.segments[0].options])
    assert abs(plan.peak / step_peak(stack, plan, ffn_params(8), X) - 1) <= 0.05
    planned = eae_jax.reconstruct(ffn_block, passes=clip_by_norm(1.0), storage=plan.storages)
    uniform = eae_jax.reconstruct(ffn_block, passes=clip_by_norm(1.0), storage=OnDevice())
    grad = lambda s: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(s(p, X)))))(ffn_params(8))  # noqa: E731
    chex.assert_trees_all_close(grad(planned), grad(uniform), rtol=1e-5, atol=1e-6)


def test_the_floor_is_accepted_at_equality_and_refused_a_byte_below():
    _, costs = ffn_costs()
    floor = make_plan(costs, 1.0).floor
    plan = make_plan(costs, floor)
    assert plan.peak == floor and plan.budget == floor
    with pytest.raises(BudgetError, match=rf"below the floor .* \({floor - 1} < {floor} bytes\): parameters .* "
                                          r"gradients .* optimizer state 0 B \+ one block"):
        make_plan(costs, floor - 1)


def test_optimizer_state_goes_to_host_memory_when_the_budget_cannot_hold_it():
    _, costs = ffn_costs()
    floor, opt = make_plan(costs, 1.0).floor, 10 * 2**20
    # on the device the floor holds the state too; in host memory it does not
    assert make_plan(costs, floor + opt, optimizer_bytes=opt).optimizer_offloaded is False
    plan = make_plan(costs, floor + opt - 1, optimizer_bytes=opt)
    assert plan.optimizer_offloaded and plan.optimizer == 0 and plan.peak <= floor + opt - 1
    assert plan.seconds >= make_plan(costs, floor + opt - 1, optimizer_bytes=0).seconds + 2 * opt / 10e9 * 0.999
    with pytest.raises(BudgetError, match="with the optimizer state in host memory"):
        make_plan(costs, floor + opt - 1, optimizer_bytes=opt, offload_optimizer=False)
    with pytest.raises(BudgetError, match=r"optimizer state in pinned host memory"):
        make_plan(costs, floor - 1, optimizer_bytes=opt)


def test_more_memory_never_makes_a_slower_plan():
    _, costs = ffn_costs()
    times = [make_plan(costs, f).seconds for f in np.linspace(0.18, 1.0, 12)]
    assert all(b <= a + 1e-15 for a, b in zip(times, times[1:])), times


def test_plan_memory_verifies_the_compiled_step_and_reports():
    stack, costs = ffn_costs()
    plan = plan_memory(stack, ffn_params(8), X, 0.5, costs=costs)
    assert plan.compiled_peak <= plan.budget
    table = str(plan)
    assert "ffn_block" in table and "predicted peak" in table and "compiled step peak" in table
    assert plan.to_dict()["segments"][0]["runs"] == [list(r) for r in plan.segments[0].runs]
    with pytest.raises(ValueError, match="optimizer or optimizer_bytes"):
        plan_memory(stack, ffn_params(8), X, 0.5, costs=costs, optimizer=optax.adam(1e-3), optimizer_bytes=4)


def test_the_runtime_reserve_is_kept_free_and_met_at_equality():
    stack, costs = ffn_costs()
    assert runtime_reserve(jax.devices("cpu")[0]) == 0
    floor, reserve = make_plan(costs, 1.0).floor, 256 << 10
    at = plan_memory(stack, ffn_params(8), X, floor + reserve, costs=costs, reserve=reserve, verify=False)
    assert at.peak == floor and at.reserve == reserve and "kept free for the runtime" in str(at)
    with pytest.raises(BudgetError, match="no plan fits once 256.0 KiB are set aside"):
        plan_memory(stack, ffn_params(8), X, floor + reserve - 1, costs=costs, reserve=reserve, verify=False)
    # the search plans for the budget less the reserve; the verified step leaves the reserve free
    budget = int(make_plan(costs, 0.6).budget)
    plan = plan_memory(stack, ffn_params(8), X, budget, costs=costs, reserve=reserve)
    assert plan.segments == make_plan(costs, budget - reserve).segments or plan.peak < budget - reserve
    assert plan.compiled_peak + reserve <= budget
    with pytest.raises(ValueError, match="reserve must be 'auto' or a byte count >= 0, got -1"):
        plan_memory(stack, ffn_params(8), X, budget, costs=costs, reserve=-1)


def test_optimizer_bytes_come_from_the_transformation():
    stack, costs = ffn_costs()
    plan = plan_memory(stack, ffn_params(8), X, "64MiB", costs=costs, optimizer=optax.adam(1e-3), verify=False)
    assert plan.optimizer == 2 * costs.params + 4  # mu and nu, and the int32 step count


def test_reconstruct_with_a_memory_budget_plans_on_its_first_call():
    stack = eae_jax.reconstruct(ffn_block, memory_budget=MemoryBudget(0.5, costs=ffn_costs()[1]))
    params = ffn_params(8)
    got = jax.jit(jax.grad(lambda p: jnp.sum(stack(p, X))))(params)
    plan = stack.plan(params, X)
    assert plan.compiled_peak <= plan.budget
    served = eae_jax.reconstruct(ffn_block, storage=plan.storages).storages(params, X)
    assert [type(s).__name__ for s in stack.storages(params, X)] == [type(s).__name__ for s in served]
    uniform = eae_jax.reconstruct(ffn_block, storage=OnDevice())
    chex.assert_trees_all_close(got, jax.grad(lambda p: jnp.sum(uniform(p, X)))(params), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="storage= or memory_budget="):
        eae_jax.reconstruct(ffn_block, memory_budget="1GiB", storage=OnDevice())
    with pytest.raises(ValueError, match="memory_budget= or policy"):
        eae_jax.reconstruct(ffn_block, memory_budget="1GiB", policy="dots")
    with pytest.raises(ValueError, match="cannot read memory budget"):
        eae_jax.reconstruct(ffn_block, memory_budget="lots")
    with pytest.raises(ValueError, match="without memory_budget"):
        uniform.plan(params, X)


def test_costs_survive_json():
    _, costs = ffn_costs()
    again = Costs.from_json(costs.to_json())
    assert again == costs
    assert make_plan(again, 0.5).segments == make_plan(costs, 0.5).segments


def test_probe_flops_count_every_iteration_of_a_scan():
    # XLA's cost analysis counts a loop body once: the time model reads the jaxpr.
    def scanned(w, x):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    flops = jaxpr_flops(jax.make_jaxpr(scanned)(jnp.ones((5, 8, 8)), jnp.ones((4, 8))).jaxpr)
    assert flops == 5 * 2 * 4 * 8 * 8
    assert [probe_depth(d) for d in (1, 3, 8, 9)] == [3, 3, 8, 8]


def test_probes_run_the_wrapped_storages_and_count_one_devices_shards():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    stack = eae_jax.reconstruct(lambda w, x: jnp.tanh(x @ w))
    params, x = jnp.ones((4, 8, 8)), jnp.ones((2, 8))
    # a stack that runs plain autodiff where the plan says "device": the probes measure that
    wrap = lambda stores: [Policy("everything") if isinstance(s, OnDevice) else s for s in stores]  # noqa: E731
    plain, wrapped = measure_costs(stack, params, x), measure_costs(stack, params, x, wrap=wrap)
    assert plain.segments[0].options["device"].kept_per_block == 2 * 8 * 4
    got, want = wrapped.segments[0].options["device"], plain.segments[0].options["everything"]
    assert (got.bytes_per_block, got.kept_per_block) == (want.bytes_per_block, want.kept_per_block)
    assert wrapped.segments[0].options["device"].kept_per_block > 2 * 8 * 4
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rep = NamedSharding(mesh, PartitionSpec())
    shardings = lambda p, xs: (rep, NamedSharding(mesh, PartitionSpec("data")), None, ())  # noqa: E731
    sharded = measure_costs(stack, params, x, in_shardings=shardings)
    assert (sharded.params, sharded.grads) == (plain.params, plain.grads) == (4 * 64 * 4, 4 * 64 * 4)
    with pytest.raises(ValueError, match="give mesh \\(data parallel\\) or in_shardings, not both"):
        plan_memory(stack, params, x, "1MiB", mesh=mesh, in_shardings=shardings)
