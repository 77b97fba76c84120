"""Statistics of the stack benchmark (experiments/bench_stats.py): the
statistic, its intervals (checked against closed forms and by coverage on
simulated campaigns), the verdict at its boundaries, the clock log parser."""

import math
import time

import numpy as np
import pytest

from conftest import load_experiment

bs = load_experiment("bench_stats")

# Student's t 97.5% quantiles from printed tables (df = 2 and 4).
T975_DF2 = 4.302652729911275
T975_DF4 = 2.7764451051977987


def test_statistic_is_the_median_of_process_medians():
    rng = np.random.default_rng(0)
    procs = [rng.normal(size=n) for n in (5, 6, 7)]
    assert bs.statistic(procs) == np.median([np.median(p) for p in procs])
    with pytest.raises(ValueError, match="at least one value"):
        bs.statistic([[1.0], []])
    with pytest.raises(ValueError, match="at least one value"):
        bs.bootstrap([], seed=0)


def test_bootstrap_is_reproducible_and_stays_within_the_data():
    procs = [[1.0, 2.0, 3.0], [2.0, 4.0], [0.5, 9.0, 3.0, 3.0]]
    a, b = bs.bootstrap(procs, seed=7, draws=500), bs.bootstrap(procs, seed=7, draws=500)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, bs.bootstrap(procs, seed=8, draws=500))
    assert a.min() >= 0.5 and a.max() <= 9.0


def test_t_interval_matches_the_closed_form():
    lo, hi = bs.t_interval_log([1.0, math.e, math.e ** 2])
    half = T975_DF2 / math.sqrt(3)
    assert (lo, hi) == pytest.approx((math.exp(1 - half), math.exp(1 + half)), rel=1e-9)
    # Welch with equal variances and sizes: df = 4, variance sum of the two
    lo, hi = bs.t_interval_log([1.0, math.e, math.e ** 2], [math.e, math.e ** 2, math.e ** 3])
    half = T975_DF4 * math.sqrt(2 / 3)
    assert (lo, hi) == pytest.approx((math.exp(-1 - half), math.exp(-1 + half)), rel=1e-9)
    assert bs.t_interval_log([2.0, 2.0], [1.0]) is None


def test_reported_interval_spans_both_and_covers_on_simulated_campaigns():
    """Three processes whose medians differ more than their steps: the
    bootstrap alone misses the true value often, the reported interval
    covers it about 95% of the time."""
    rng = np.random.default_rng(123)
    reps, hit_boot, hit = 120, 0, 0
    for r in range(reps):
        procs = [100 * (1 + 0.01 * rng.standard_normal()) + 0.1 * rng.standard_normal(10) for _ in range(3)]
        s = bs.summarize(procs, seed=r, draws=2000)
        assert s["ci"][0] <= min(s["ci_bootstrap"][0], s["ci_t"][0])
        assert s["ci"][1] >= max(s["ci_bootstrap"][1], s["ci_t"][1])
        hit_boot += s["ci_bootstrap"][0] <= 100 <= s["ci_bootstrap"][1]
        hit += s["ci"][0] <= 100 <= s["ci"][1]
    assert hit / reps >= 0.9
    assert hit_boot < hit


def test_ratio_of_identical_variants_is_a_tie_and_a_clear_gap_is_not():
    rng = np.random.default_rng(1)
    a = [100 + rng.standard_normal(10) for _ in range(3)]
    b = [100 + rng.standard_normal(10) for _ in range(3)]
    r = bs.ratio(a, b, 1, 2, draws=2000)
    assert r["ci"][0] < 1 < r["ci"][1] and bs.verdict(r["ci"], True) == "tie"
    fast = [80 + rng.standard_normal(10) for _ in range(3)]
    r = bs.ratio(a, fast, 1, 3, draws=2000)
    assert r["value"] == pytest.approx(bs.statistic(a) / bs.statistic(fast))
    assert r["ci"][0] > 1 and bs.verdict(r["ci"], True) == "win" and bs.verdict(r["ci"], False) == "loss"


@pytest.mark.parametrize("ci,higher,want", [
    ([1.0, 1.5], True, "tie"), ([1.0 + 1e-12, 1.5], True, "win"), ([0.5, 1.0], True, "tie"),
    ([0.5, 1.0 - 1e-12], True, "loss"), ([0.5, 1.0 - 1e-12], False, "win"), ([1.0 + 1e-12, 2], False, "loss"),
    (None, True, "n/a"), ([None, 1.2], True, "n/a")])
def test_verdict_boundaries(ci, higher, want):
    assert bs.verdict(ci, higher) == want


def _stamp(t):
    return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + ".500"


def test_smi_log_parses_both_header_forms_and_skips_broken_lines():
    t = 1_700_000_000.0
    units = ("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, "
             "clocks_throttle_reasons.active\n"
             f"{_stamp(t)}, 1755 MHz, 2619 MHz, 699.10 W, 70, 0x0000000000000004\n"
             f"{_stamp(t + 1)}, [N/A], 2619 MHz, 650.00 W, 71, 0x0000000000000000\n"
             f"{_stamp(t + 2)}, 1980 MHz\n"
             "timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, "
             "clocks_throttle_reasons.active\n")
    s = bs.parse_smi(units)
    assert len(s) == 2
    assert s[0]["t"] == pytest.approx(t + 0.5) and s[0]["sm_mhz"] == 1755.0 and s[0]["power_w"] == 699.1
    assert s[0]["reasons"] == 4 and s[1]["sm_mhz"] is None and s[1]["reasons"] == 0
    bare = f"timestamp, clocks.sm, clocks.mem, power.draw, temperature.gpu\n{_stamp(t)}, 1980, 2619, 300, 40\n"
    (one,) = bs.parse_smi(bare)
    assert one["sm_mhz"] == 1980.0 and one["reasons"] is None
    assert bs.parse_smi("") == []


def test_window_clocks_include_both_ends():
    samples = [{"t": float(i), "sm_mhz": 1000.0 + 100 * i, "mem_mhz": 2600.0, "power_w": 400.0 + i, "temp_c": 50.0,
                "reasons": 4 if i == 2 else 0} for i in range(6)]
    w = bs.window_clocks(samples, 2.0, 4.0)
    assert w["samples"] == 3 and w["sm_mhz_min"] == 1200.0 and w["sm_mhz_max"] == 1400.0
    assert w["clock_event_reasons"] == ["0x4"]
    assert bs.window_clocks(samples, 10.0, 11.0) == {"samples": 0}
