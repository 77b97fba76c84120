"""Adjoint passes under sharding: every pass that needs a statistic of the whole adjoint
(a norm, an int8 or fp8 scale, statistics, a top-k threshold, a non-finite check) gets the
same result on an adjoint split over 8 devices, whether the split is XLA's (``jit``) or
sits inside a pipeline stage's `shard_map` (``stage`` manual, ``data`` automatic)."""

from conftest import run_worker

#: Passes that change the adjoint they are given (the rest only record statistics).
CHANGING = ("clip=1.0", "int8", "cast=bf16", "fp16", "bf16", "fp8", "decay=0.5", "noise=1e-3", "topk=0.25",
            "guard=skip")


def test_every_pass_sees_the_whole_adjoint_when_it_is_split(tmp_path):
    results = run_worker("passes", tmp_path)  # one process, one test: xdist never starts it twice
    pipeline = results.pop("pipeline")
    assert set(CHANGING) < set(results)
    for spec, r in results.items():
        # adjoint and pass state alike: equal up to the order of a sum (a norm, a mean)
        assert r["jit"] <= 1e-6 and r["stage"] <= 1e-6, (spec, r)
        if spec in CHANGING:
            assert r["changes"] > 1e-6, (spec, r)  # the pass really acted
    # The control: run on each device's shard alone, clip and int8 give other adjoints.
    assert results["clip=1.0"]["per_shard"] > 0.1 and results["int8"]["per_shard"] > 1e-3
    # A 4-stage pipeline (x data=2) applies a pass chain where and as the unpipelined stack
    # does: each stage sees its blocks' boundaries under the whole model's indices.
    assert abs(pipeline["loss"] - pipeline["ref_loss"]) <= 1e-5 * pipeline["ref_loss"]
    assert pipeline["grad_err"] <= 1e-5 and pipeline["stats_err"] <= 1e-5 and pipeline["calls"] == 1.0
    assert pipeline["clipped"] == [2, 5]
