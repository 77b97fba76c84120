"""The planner on hand-made `Costs`: no stack, no compile.

Every expected plan comes from an independent brute force: all assignments
of blocks to options (runs in option order), each priced by the peak and
time model the planner's docstring states, the fastest within the budget.
"""

import itertools

import pytest

from eae_jax.reconstruct import Runs
from eae_jax.reconstruct.costs import Costs, OptionCost, SegmentCosts, default_options
from eae_jax.reconstruct.planner import BudgetError, Plan, SegmentPlan, fmt_bytes, fmt_seconds, make_plan, parse_budget

RANK = [o.name for o in default_options()]
OPTIONS = {o.name: o for o in default_options()}


def scanned_costs():
    """One scanned segment of 4 blocks; options on a convex ladder."""
    seg = SegmentCosts("blocks", 4, True, {
        "slots": OptionCost(100, 100, 0, 4e-3, 0),
        "device": OptionCost(120, 100, 0, 3e-3, 0),
        "dots": OptionCost(300, 280, 50, 2e-3, 0),
        "everything": OptionCost(600, 580, 200, 1e-3, 0)})
    return Costs([seg], "device", 5000, 0.02, 1000, 1000, "flops", "cpu",
                 {"slots": ("grad slots", "boundary"), "device": ("device", "boundary"),
                  "dots": ("device", "matmuls"), "everything": ("device", "all")})


def mixed_costs():
    """An unscanned head block, then a scanned segment of 3 blocks."""
    head = SegmentCosts("head", 1, False, {
        "device": OptionCost(64, 0, 0, 5e-3, 0),
        "everything": OptionCost(400, 300, 0, 4e-3, 0)})
    body = SegmentCosts("body", 3, True, {
        "slots": OptionCost(50, 50, 0, 6e-3, 0),
        "device": OptionCost(80, 50, 10, 5e-3, 0),
        "dots": OptionCost(200, 170, 90, 3.5e-3, 0),
        "everything": OptionCost(500, 470, 300, 2e-3, 0)})
    return Costs([head, body], "device", 8000, 0.05, 2000, 2000, "flops", "cpu")


def predict(costs, runs_per_segment):
    """The documented model: fixed bytes, each block's non-kept bytes, unscanned kept bytes held
    throughout, and the worst over the scanned runs (in depth order, the backward meeting them last
    first) of what they and every run before them keep plus the run's working memory."""
    fixed = costs.base_peak - sum((2 if s.scanned else 1) * s.options[costs.reference].bytes_per_block
                                  for s in costs.segments)
    seconds = costs.base_seconds
    bytes_, held, scanned_runs = fixed, 0, []
    for seg, runs in zip(costs.segments, runs_per_segment):
        seconds -= (2 if seg.scanned else 1) * seg.options[costs.reference].seconds_per_block
        for n, name in runs:
            o = seg.options[name]
            bytes_ += n * (o.bytes_per_block - o.kept_per_block)
            seconds += n * o.seconds_per_block
            if seg.scanned:
                scanned_runs.append((n * o.kept_per_block, o.transient))
            else:
                held += n * o.kept_per_block
    worst, live = held, held
    for i, (kept, transient) in enumerate(scanned_runs):
        live += kept
        worst = live + transient if i == 0 else max(worst, live + transient)
    return bytes_ + worst, seconds


def assignments(seg):
    """Every split of a segment's blocks over its options, runs in option order, no scanned run of one
    block (XLA inlines a one-trip loop)."""
    names = sorted(seg.options, key=RANK.index)
    out = []
    for counts in itertools.product(range(seg.depth + 1), repeat=len(names)):
        if sum(counts) != seg.depth:
            continue
        if seg.scanned and seg.depth >= 2 and 1 in counts:
            continue
        out.append(tuple((n, o) for n, o in zip(counts, names) if n))
    return out


def all_plans(costs):
    for combo in itertools.product(*(assignments(s) for s in costs.segments)):
        yield combo, *predict(costs, combo)


def brute_best(costs, room):
    fits = [(s, p, c) for c, p, s in all_plans(costs) if p <= room]
    return min(fits, key=lambda t: (t[0], t[1])) if fits else None


def floor_of(costs):
    return min(p for _, p, _ in all_plans(costs))


# --- parse_budget, fmt_bytes, fmt_seconds ---

@pytest.mark.parametrize("given, want", [
    (1, 1), (4096, 4096), (1.0, 1.0), (0.25, 0.25), (5e-324, 5e-324),
    ("1", 1), ("6GiB", 6 * 2**30), ("512 MiB", 512 * 2**20), (" 2 kib ", 2048), ("3TiB", 3 * 2**40),
    ("7b", 7), ("7B", 7), ("1.5 kB", 1500), ("2mb", 2 * 10**6), ("8GB", 8 * 10**9), ("1tb", 10**12),
    ("6e9", 6 * 10**9), ("1.5E+3", 1500), ("25e-1", 2), ("1.6", 2), (".5kb", 500), ("2.5e-1kb", 250)])
def test_parse_budget_reads_bytes_fractions_and_units(given, want):
    got = parse_budget(given)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("given, message", [
    (True, "memory budget must be bytes or a fraction, got True"),
    (False, "memory budget must be bytes or a fraction, got False"),
    (0, "memory budget must be > 0 bytes, got 0"),
    (-5, "memory budget must be > 0 bytes, got -5"),
    (0.0, "a fractional memory budget must lie in (0, 1], got 0.0; give bytes as an int or a string such as "
          "'6GiB'"),
    (1.0000001, "a fractional memory budget must lie in (0, 1], got 1.0000001; give bytes as an int or a "
                "string such as '6GiB'"),
    (-0.5, "a fractional memory budget must lie in (0, 1], got -0.5; give bytes as an int or a string such "
           "as '6GiB'"),
    ("6 GiBs", "cannot read memory budget '6 GiBs'; write e.g. '6GiB', '512MiB', '8GB' or a number of bytes"),
    ("", "cannot read memory budget ''; write e.g. '6GiB', '512MiB', '8GB' or a number of bytes"),
    ("6.GiB", "cannot read memory budget '6.GiB'; write e.g. '6GiB', '512MiB', '8GB' or a number of bytes"),
    ("x6GiB", "cannot read memory budget 'x6GiB'; write e.g. '6GiB', '512MiB', '8GB' or a number of bytes"),
    ("-6", "cannot read memory budget '-6'; write e.g. '6GiB', '512MiB', '8GB' or a number of bytes"),
    ("0.999", "memory budget must be at least one byte, got '0.999'"),
    ("0 GiB", "memory budget must be at least one byte, got '0 GiB'"),
    (None, "memory budget must be bytes (int or '6GiB') or a fraction in (0, 1], got None"),
    ([1], "memory budget must be bytes (int or '6GiB') or a fraction in (0, 1], got [1]")])
def test_parse_budget_refuses_with_the_whole_message(given, message):
    with pytest.raises(ValueError) as e:
        parse_budget(given)
    assert str(e.value) == message


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1.9, "1 B"), (1023, "1023 B"), (-1023, "-1023 B"), (1024, "1.0 KiB"), (-1024, "-1.0 KiB"),
    (2**20 - 1, "1024.0 KiB"), (2**20, "1.0 MiB"), (-2**20, "-1.0 MiB"), (3 * 2**19, "1.5 MiB"),
    (2**30 - 1, "1024.0 MiB"), (2**30, "1.000 GiB"), (-2**30, "-1.000 GiB"), (3 * 2**29, "1.500 GiB")])
def test_fmt_bytes_switches_units_at_each_power_of_1024(n, text):
    assert fmt_bytes(n) == text


@pytest.mark.parametrize("t, text", [
    (1e-3, "1.00 ms"), (-1e-3, "-1.00 ms"), (0.0123, "12.30 ms"), (9.99e-4, "999.0 µs"), (-4.1e-6, "-4.1 µs"),
    (1.23499999e-5, "12.3 µs"), (1.23499999e-2, "12.35 ms"), (1.2344999e-2, "12.34 ms"),
    (0.0, "0.0 µs")])
def test_fmt_seconds_switches_to_microseconds_below_a_millisecond(t, text):
    assert fmt_seconds(t) == text


# --- the search against the brute force ---

def check_plan(costs, budget, plan, optimizer=0):
    """The plan's peak and time are the model's for its runs, within the budget, and the fastest."""
    runs = [seg.runs for seg in plan.segments]
    peak, seconds = predict(costs, runs)
    assert plan.peak == peak + optimizer
    assert plan.seconds == pytest.approx(seconds, rel=1e-12)
    assert plan.peak <= budget
    best = brute_best(costs, budget - optimizer)
    assert plan.seconds == pytest.approx(best[0], rel=1e-12), (budget, runs, best)


@pytest.mark.parametrize("make", [scanned_costs, mixed_costs])
def test_the_plan_is_the_fastest_within_every_budget_met_exactly(make):
    costs = make()
    peaks = sorted({p for _, p, _ in all_plans(costs)})
    floor = peaks[0]
    for budget in peaks + [p + 1 for p in peaks] + [peaks[-1] + 10**6]:
        plan = make_plan(costs, budget)
        check_plan(costs, budget, plan)
        assert plan.floor == floor and plan.budget == budget
        assert [s.name for s in plan.segments] == [s.name for s in costs.segments]
        assert [s.scanned for s in plan.segments] == [s.scanned for s in costs.segments]
        assert [s.depth for s in plan.segments] == [s.depth for s in costs.segments]
        assert (plan.params, plan.grads, plan.optimizer, plan.optimizer_offloaded) == (
            costs.params, costs.grads, 0, False)
        assert plan.costs is costs and plan.compiled_peak is None and plan.reserve == 0
        assert list(plan.options) == RANK


def test_scanned_runs_are_least_memory_first_and_never_one_block():
    costs = scanned_costs()
    seen = set()
    for _, p, _ in all_plans(costs):
        runs = make_plan(costs, p).segments[0].runs
        assert [RANK.index(o) for _, o in runs] == sorted(RANK.index(o) for _, o in runs)
        assert all(n >= 2 for n, _ in runs)
        seen.add(runs)
    assert ((2, "device"), (2, "dots")) in seen and ((4, "everything"),) in seen


def test_the_floor_is_met_exactly_and_a_byte_below_is_refused_in_full():
    costs = mixed_costs()
    floor = floor_of(costs)
    # The floor: head on device (kept 0), body in slots with no working memory.
    assert floor == 8000 - 64 - 2 * 80 + 64 + 3 * 50 == 7990
    assert make_plan(costs, floor).peak == floor
    with pytest.raises(BudgetError) as e:
        make_plan(costs, floor - 1)
    assert str(e.value) == ("memory budget 7.8 KiB is below the floor 7.8 KiB (7989 < 7990 bytes): parameters "
                            "2.0 KiB + gradients 2.0 KiB + optimizer state 0 B + one block and what every block "
                            "must keep 3.9 KiB")
    assert isinstance(e.value, ValueError)


def test_a_lone_block_left_by_the_greedy_search_gets_a_neighbour():
    """Depth 3 with room for one 'dots' block only: the greedy search moves one block, and a run of one
    is then refused: the faster repair that fits wins (back to the ladder's lower run here)."""
    costs = scanned_costs()
    seg = costs.segments[0]
    costs.segments[0] = SegmentCosts("blocks", 3, True, seg.options)
    for _, p, _ in all_plans(costs):
        for budget in (p, p + 1, p + 150):
            plan = make_plan(costs, budget)
            check_plan(costs, budget, plan)
            assert all(n >= 2 for n, _ in plan.segments[0].runs if len(plan.segments[0].runs) > 1)


def test_no_scanned_run_is_left_with_one_block_when_no_neighbour_move_fits():
    """3 blocks as 1 + 2: no single move gives both runs two blocks. The greedy search reached
    ``(1, 'device'), (2, 'dots')`` here (head first), and the repair found no move that fits, so the
    plan kept a one-trip scan; now the lone block steps down the ladder (all three on the device)."""
    costs = mixed_costs()
    costs.segments[0] = SegmentCosts("head", 1, False, {"device": OptionCost(64, 0, 0, 5e-3, 0),
                                                        "everything": OptionCost(100, 50, 0, 2e-3, 0)})
    for _, p, _ in all_plans(costs):
        plan = make_plan(costs, p)
        assert all(n >= 2 for n, _ in plan.segments[1].runs), (p, plan.segments)
        peak, seconds = predict(costs, [s.runs for s in plan.segments])
        assert plan.peak == peak <= p and plan.seconds == pytest.approx(seconds, rel=1e-12)
    plan = make_plan(costs, 8530)
    assert [s.runs for s in plan.segments] == [((1, "everything"),), ((3, "device"),)]


def test_a_one_block_scanned_segment_may_be_a_run_of_one():
    seg = SegmentCosts("one", 1, True, {"device": OptionCost(120, 100, 0, 3e-3, 0),
                                        "dots": OptionCost(300, 280, 0, 2e-3, 0)})
    costs = Costs([seg], "device", 1000, 0.01, 0, 0, "flops", "cpu")
    fixed = 1000 - 2 * 120
    assert make_plan(costs, fixed + 300).segments[0].runs == ((1, "dots"),)
    assert make_plan(costs, fixed + 299).segments[0].runs == ((1, "device"),)


def test_working_memory_caps_let_a_cheaper_plan_fit():
    """'dots' needs much working memory here: under a tight budget only the caps below it find a plan."""
    seg = SegmentCosts("blocks", 4, True, {"device": OptionCost(120, 100, 0, 3e-3, 0),
                                           "ffn": OptionCost(150, 120, 5, 2.5e-3, 0),
                                           "dots": OptionCost(200, 180, 1000, 1e-3, 0)})
    costs = Costs([seg], "device", 5000, 0.02, 0, 0, "flops", "cpu")
    for _, p, _ in all_plans(costs):
        for budget in (p, p + 1):
            check_plan(costs, budget, make_plan(costs, budget))


def test_equal_times_prefer_the_smaller_peak():
    seg = SegmentCosts("blocks", 2, True, {"slots": OptionCost(100, 100, 0, 3e-3, 0),
                                           "device": OptionCost(120, 100, 0, 3e-3, 0),
                                           "dots": OptionCost(300, 280, 0, 3e-3, 0)})
    costs = Costs([seg], "device", 1000, 0.01, 0, 0, "flops", "cpu")
    plan = make_plan(costs, 10**6)
    assert plan.segments[0].runs == ((2, "slots"),) and plan.peak == 1000 - 240 + 200


# --- the optimizer state, fractions, margin, bad arguments ---

def test_optimizer_state_stays_on_the_device_while_it_fits_exactly():
    costs = scanned_costs()
    floor, opt, rate = floor_of(costs), 10**6, 1e6
    plan = make_plan(costs, floor + opt, optimizer_bytes=opt, host_bytes_per_s=rate)
    assert (plan.optimizer_offloaded, plan.optimizer, plan.floor) == (False, opt, floor + opt)
    check_plan(costs, floor + opt, plan, optimizer=opt)
    plan = make_plan(costs, floor + opt - 1, optimizer_bytes=opt, host_bytes_per_s=rate)
    assert (plan.optimizer_offloaded, plan.optimizer, plan.floor) == (True, 0, floor)
    best = brute_best(costs, floor + opt - 1)
    assert plan.seconds == pytest.approx(best[0] + 2 * opt / rate, rel=1e-12)
    assert plan.peak == best[1]


def test_optimizer_state_goes_to_host_when_that_is_faster_overall():
    costs = scanned_costs()
    floor, opt = floor_of(costs), 4000
    every = max(p for _, p, _ in all_plans(costs))
    budget = floor + opt  # on the device: only the floor fits; on the host: everything
    slow, fast = brute_best(costs, floor), brute_best(costs, budget)
    assert fast[0] < slow[0]
    for rate, offloaded in [(1e12, True), (2 * opt / (slow[0] - fast[0]) * 0.999, False)]:
        plan = make_plan(costs, budget, optimizer_bytes=opt, host_bytes_per_s=rate)
        assert plan.optimizer_offloaded is offloaded
        want = fast[0] + 2 * opt / rate if offloaded else slow[0]
        assert plan.seconds == pytest.approx(want, rel=1e-12)
    assert every <= budget
    # Forced either way, and a tie in time keeps the state on the device.
    on = make_plan(costs, budget, optimizer_bytes=opt, offload_optimizer=False, host_bytes_per_s=1e12)
    assert (on.optimizer_offloaded, on.peak, on.optimizer) == (False, slow[1] + opt, opt)
    off = make_plan(costs, budget, optimizer_bytes=opt, offload_optimizer=True, host_bytes_per_s=1e12)
    assert (off.optimizer_offloaded, off.peak, off.optimizer) == (True, fast[1], 0)
    big = floor + opt + 10**6
    tie = make_plan(costs, big, optimizer_bytes=opt, host_bytes_per_s=1e300)
    assert tie.optimizer_offloaded is False


def test_offloading_with_no_optimizer_state_is_a_no_op():
    costs = scanned_costs()
    plan = make_plan(costs, 10**6, offload_optimizer=True)
    assert (plan.optimizer_offloaded, plan.optimizer) == (False, 0)


def test_the_host_rate_defaults_to_the_devices():
    costs = scanned_costs()
    floor, opt = floor_of(costs), 10**6
    plan = make_plan(costs, floor, optimizer_bytes=opt)  # CPU: 10 GB/s
    assert plan.optimizer_offloaded
    assert plan.seconds == pytest.approx(brute_best(costs, floor)[0] + 2 * opt / 10e9, rel=1e-12)


def test_refusals_with_optimizer_state_name_it():
    costs = scanned_costs()
    floor, opt = floor_of(costs), 3 * 2**20
    with pytest.raises(BudgetError) as e:
        make_plan(costs, floor - 1, optimizer_bytes=opt, offload_optimizer=False)
    assert str(e.value) == (
        f"memory budget 5.0 KiB is below the floor 3.0 MiB ({floor - 1} < {floor + opt} bytes): parameters "
        f"1000 B + gradients 1000 B + optimizer state 3.0 MiB + one block and what every block must keep "
        f"{fmt_bytes(floor - 2000)}; with the optimizer state in host memory (offload_optimizer) it is "
        f"{fmt_bytes(floor)}")
    with pytest.raises(BudgetError) as e:
        make_plan(costs, floor - 1, optimizer_bytes=opt)
    assert str(e.value) == (
        f"memory budget 5.0 KiB is below the floor 5.0 KiB ({floor - 1} < {floor} bytes): parameters "
        f"1000 B + gradients 1000 B + optimizer state in pinned host memory + one block and what every block "
        f"must keep {fmt_bytes(floor - 2000)}")


def test_the_margin_is_left_unused_and_named_when_nothing_fits():
    costs = scanned_costs()
    floor = floor_of(costs)
    for margin in (1, 100, 700):
        for _, p, _ in all_plans(costs):
            if p + margin <= floor + 3000:
                plan = make_plan(costs, p + margin, margin=margin)
                assert plan.peak <= p and plan.seconds == pytest.approx(brute_best(costs, p)[0], rel=1e-12)
    plan = make_plan(costs, floor + 5, margin=5)
    assert plan.peak == floor
    with pytest.raises(BudgetError) as e:
        make_plan(costs, floor + 5, margin=6)
    assert str(e.value) == (f"memory budget {fmt_bytes(floor + 5)}: no plan fits once 6 B are set aside (the "
                            f"runtime's reserve and what the compiled step needs beyond its prediction; "
                            f"predicted floor {fmt_bytes(floor)})")
    with pytest.raises(BudgetError) as e:
        make_plan(costs, 2**20, margin=2**20, optimizer_bytes=7, offload_optimizer=False)
    assert str(e.value) == ("memory budget 1.0 MiB: no plan fits once 1.0 MiB are set aside (the runtime's "
                            f"reserve and what the compiled step needs beyond its prediction; predicted floor "
                            f"{fmt_bytes(floor + 7)})")


def test_a_fraction_is_of_plain_autodiffs_activations():
    costs = mixed_costs()
    every, _ = predict(costs, [((1, "everything"),), ((3, "everything"),)])
    fixed = costs.params + costs.grads
    for f in (1.0, 0.95, 0.9):
        want = int(fixed + f * (every - fixed))
        assert want >= floor_of(costs)
        plan = make_plan(costs, f)
        assert plan.budget == want
        check_plan(costs, want, plan)
    plan = make_plan(costs, 1.0, optimizer_bytes=100, offload_optimizer=False)
    assert plan.budget == every + 100 and plan.peak == every + 100
    # A segment without 'everything' counts at the reference.
    head = SegmentCosts("head", 1, False, {"device": OptionCost(64, 0, 0, 5e-3, 0)})
    costs.segments[0] = head
    every, _ = predict(costs, [((1, "device"),), ((3, "everything"),)])
    assert make_plan(costs, 1.0).budget == every


def test_a_fraction_needs_the_everything_option():
    costs = mixed_costs()
    for s in costs.segments:
        del s.options["everything"]
    with pytest.raises(ValueError) as e:
        make_plan(costs, 0.5)
    assert str(e.value) == ("a fractional budget is a fraction of what plain autodiff keeps: measure the costs "
                            "with the 'everything' option")


@pytest.mark.parametrize("bad", ["yes", None, 1, 0])
def test_offload_optimizer_takes_auto_true_or_false(bad):
    if bad in (1, 0):  # 1 == True and 0 == False: accepted as such
        make_plan(scanned_costs(), 10**6, offload_optimizer=bad)
        return
    with pytest.raises(ValueError) as e:
        make_plan(scanned_costs(), 10**6, offload_optimizer=bad)
    assert str(e.value) == f"offload_optimizer must be 'auto', True or False, got {bad!r}"


def test_options_given_name_the_storages_in_their_order():
    costs = scanned_costs()
    given = [OPTIONS[n] for n in ("everything", "dots", "device", "slots")]
    plan = make_plan(costs, predict(costs, [((2, "device"), (2, "dots"))])[0], options=given)
    assert list(plan.options) == ["everything", "dots", "device", "slots"]
    assert plan.segments[0].runs == ((2, "dots"), (2, "device"))


# --- the Plan ---

def a_plan(**kw):
    costs = scanned_costs()
    fields = dict(budget=3 * 2**30, segments=(SegmentPlan("blocks", True, ((2, "device"), (2, "dots"))),
                                              SegmentPlan("head", False, ((1, "everything"),))),
                  peak=2**30, seconds=0.0123, floor=2**20, params=2**20, grads=2**21, optimizer=3 * 2**20,
                  optimizer_offloaded=False, costs=costs, options=OPTIONS)
    fields.update(kw)
    return Plan(**fields)


def test_segment_plan_depth_and_plan_storages():
    assert SegmentPlan("s", True, ((3, "slots"), (1, "dots"))).depth == 4
    assert SegmentPlan("s", False, ()).depth == 0
    plan = a_plan()
    runs, single = plan.storages
    assert isinstance(runs, Runs) and runs == Runs(((2, OPTIONS["device"].storage), (2, OPTIONS["dots"].storage)))
    assert single == OPTIONS["everything"].storage


def test_to_dict_is_plain_data():
    assert a_plan(compiled_peak=99).to_dict() == {
        "budget": 3 * 2**30, "peak": 2**30, "seconds": 0.0123, "floor": 2**20, "params": 2**20,
        "grads": 2**21, "optimizer": 3 * 2**20, "optimizer_offloaded": False, "compiled_peak": 99,
        "segments": [{"name": "blocks", "runs": [[2, "device"], [2, "dots"]]},
                     {"name": "head", "runs": [[1, "everything"]]}]}


def test_the_table_in_full():
    costs = scanned_costs()
    costs.segments.append(SegmentCosts("head", 1, False, {"everything": OptionCost(2**20, 3 * 2**19, 0, -4e-6, 0)}))
    costs.what.pop("everything")
    plan = a_plan(costs=costs)
    assert str(plan) == plan.table() == "\n".join([
        "segment  blocks  keeps                   where   kept/block           device/block  time/block",
        "-------  ------  ----------------------  ------  -------------------  ------------  -------------------",
        "blocks   2       device: boundary        device  100 B                120 B         3.00 ms",
        "blocks   2       dots: matmuls           device  280 B                300 B         2.00 ms",
        "head     1       everything: everything  ?       1.5 MiB (vs device)  1.0 MiB       -4.0 µs (vs device)",
        "",
        "predicted peak 1.000 GiB of budget 3.000 GiB (floor 1.0 MiB): params 1.0 MiB + grads 2.0 MiB + optimizer "
        "state 3.0 MiB + activations and working memory 1018.0 MiB",
        "predicted step time 12.30 ms (flops timing, cpu)"])


def test_the_table_names_an_offloaded_optimizer_the_reserve_and_the_compiled_peak():
    plan = a_plan(optimizer=0, optimizer_offloaded=True, reserve=2**20, compiled_peak=2**29)
    tail = plan.table().split("\n")[-3:]
    assert tail == [
        "predicted peak 1.000 GiB of budget 3.000 GiB (floor 1.0 MiB): params 1.0 MiB + grads 2.0 MiB + optimizer "
        "state in pinned host memory + activations and working memory 1021.0 MiB; 1.0 MiB of the budget kept free "
        "for the runtime",
        "compiled step peak 512.0 MiB (prediction / compiled 2.000)",
        "predicted step time 12.30 ms (flops timing, cpu)"]


def test_a_two_block_scan_is_never_split_one_and_one():
    """Depth 2: the search upgrades one block, leaving 1 + 1; the repair must merge them (the fastest
    pair that fits), every budget met exactly."""
    costs = scanned_costs()
    costs.segments[0] = SegmentCosts("blocks", 2, True, costs.segments[0].options)
    peaks = sorted({p for _, p, _ in all_plans(costs)})
    for budget in sorted(set(peaks) | set(range(peaks[0], peaks[-1] + 50, 10))):
        plan = make_plan(costs, budget)
        assert len(plan.segments[0].runs) == 1, (budget, plan.segments)
        check_plan(costs, budget, plan)


def test_a_lone_run_is_repaired_with_what_an_earlier_repair_freed():
    """Hand-traced greedy on an additive model (kept = bytes, no working memory: the peak is
    ``fixed + sum of block bytes``), 250 bytes over the start. Up the hulls: A's upgrade buys 5 ms per
    100 B, B's 1 ms per 50 B: A, A (200 B; a third, 300 B, does not fit), then B once (250 B): A is
    1 device + 2 dots, B 3 device + 1 dots. No further move fits. A's lone run cannot take a second
    block (no neighbour run of 3, the upgrade does not fit), so it steps down: A all on the device
    (50 B used). B's lone run then takes a second block from its run of 3 (100 B, 1 ms faster)."""
    a = SegmentCosts("a", 3, True, {"device": OptionCost(100, 100, 0, 10e-3, 0),
                                    "dots": OptionCost(200, 200, 0, 5e-3, 0)})
    b = SegmentCosts("b", 4, True, {"device": OptionCost(100, 100, 0, 10e-3, 0),
                                    "dots": OptionCost(150, 150, 0, 9e-3, 0)})
    costs = Costs([a, b], "device", 5000, 0.1, 0, 0, "flops", "cpu")
    start = 5000 - 400 + 700
    plan = make_plan(costs, start + 250)
    assert [s.runs for s in plan.segments] == [((3, "device"),), ((2, "device"), (2, "dots"))]
    # Base 0.1 s less the 4 reference blocks it holds, plus 7 blocks at 10 ms, less 2 x 1 ms.
    assert plan.peak == start + 100 and plan.seconds == pytest.approx(0.1 - 0.04 + 0.07 - 2e-3, rel=1e-12)
