"""The campaign schedule (experiments/bench_plan.py): seeded rounds of
permutations, one checking process per variant, references first, batches
kept small while variants compile cold, and the time estimate."""

import json
import os

import pytest

from conftest import load_experiment

bst = load_experiment("bench_stack")
import bench_common as bc  # noqa: E402  (load_experiment put experiments/ on the path)
import bench_plan as bp  # noqa: E402


def _plan(tmp_path, *argv):
    args = bst.parse_args(["--smoke", "--workdir", str(tmp_path), *argv])
    os.makedirs(tmp_path / "specs", exist_ok=True)
    return args, bp.build_plan(args, bc.configs(True), str(tmp_path), bp.parse_injections(args.inject_failure))


def test_timing_order_is_seeded_rounds_of_permutations():
    units = [f"v{i}" for i in range(8)]
    order = bp.timing_order(units, 3, seed=5)
    assert [r for r, _ in order] == [0] * 8 + [1] * 8 + [2] * 8
    for r in range(3):
        assert sorted(u for rr, u in order if rr == r) == units
    assert order == bp.timing_order(units, 3, seed=5) != bp.timing_order(units, 3, seed=6)
    assert [u for _, u in order[:8]] != units or [u for _, u in order[8:16]] != units  # shuffled


def test_plan_references_first_then_rounds_and_one_check_per_variant(tmp_path):
    args, [(group, jobs)] = _plan(tmp_path, "--variants", "J-plain,eae,T-ckpt", "--repeats", "3",
                                  "--inject-failure", "eae@medium#2:raise,T-ckpt@medium:hang")
    assert group == "medium" and jobs[0].role == "ref" and jobs[0].variant == "J-plain"
    timed = jobs[1:]
    assert [j.order for j in timed] == list(range(9))
    assert sorted(j.variant for j in timed) == ["J-plain"] * 3 + ["T-ckpt"] * 3 + ["eae"] * 3
    for v in ("J-plain", "eae", "T-ckpt"):
        mine = [j for j in timed if j.variant == v]
        assert [j.check for j in mine] == [True, False, False] and sorted(j.round for j in mine) == [0, 1, 2]
    specs = {(j.variant, j.round): json.load(open(j.spec_path)) for j in timed}
    assert specs[("eae", 2)]["inject"] == "raise" and specs[("eae", 0)]["inject"] is None
    assert all(specs[("T-ckpt", r)]["inject"] == "hang" for r in range(3))
    assert specs[("J-plain", 0)]["steps"] == args.steps and specs[("J-plain", 0)]["sdpa_backend"] == "flash"
    _, [(_, no_ref)] = _plan(tmp_path, "--variants", "eae", "--no-reference")
    assert [j.role for j in no_ref] == ["timed"]
    with pytest.raises(SystemExit, match="unknown variant"):
        _plan(tmp_path, "--variants", "eae,nope")


def test_batches_are_small_while_variants_compile_cold(tmp_path):
    args, [(_, jobs)] = _plan(tmp_path, "--variants", "J-plain,eae,T-ckpt", "--repeats", "3")
    pending, compiled, sizes = list(jobs), set(), []
    while pending:
        sizes.append([j.key for j in bp.next_batch(pending, compiled, 3, 5)])
    # ref + two first processes; then the third variant's first process keeps the cap at 3;
    # then every variant has compiled: batches of 5
    assert [len(b) for b in sizes] == [3, 3, 4]
    firsts = [j.key for j in jobs if j.role == "ref" or j.check]
    assert all(k in sizes[0] + sizes[1] for k in firsts)
    assert sum(sizes, []) == [j.key for j in jobs]  # the order is kept


def test_estimate_grows_with_fewer_jobs_and_more_steps(tmp_path):
    args, plan = _plan(tmp_path, "--variants", "J-plain,eae,T-ckpt,T-compile", "--repeats", "3", "--jobs", "4")
    base = bp.estimate(plan, args)
    assert base["total_s"] == pytest.approx(base["prep_s"] + base["timing_s"] + 30.0)
    args2, plan2 = _plan(tmp_path, "--variants", "J-plain,eae,T-ckpt,T-compile", "--repeats", "3", "--jobs", "1")
    assert bp.estimate(plan2, args2)["prep_s"] > base["prep_s"]
    args3, plan3 = _plan(tmp_path, "--variants", "J-plain,eae,T-ckpt,T-compile", "--repeats", "3", "--jobs", "4",
                         "--steps", "30")
    assert bp.estimate(plan3, args3)["timing_s"] > base["timing_s"]
