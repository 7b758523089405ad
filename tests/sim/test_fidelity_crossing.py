"""benchmarks/sim_fidelity.py's engine-side max rate: the crossing of the attainment
curve and its bootstrap over the runs at each rate."""
from __future__ import annotations

import pytest
from bench_scripts import import_benchmark

sim_fidelity = import_benchmark("sim_fidelity")


def test_crossing_interpolates_between_the_last_rate_meeting_the_target_and_the_next() -> None:
    pts = [(1.0, 0.98), (2.0, 0.94), (3.0, 0.84), (4.0, 0.5)]
    assert sim_fidelity.crossing(pts) == pytest.approx(2.4)
    assert sim_fidelity.crossing([(1.0, 0.8), (2.0, 0.5)]) is None
    assert sim_fidelity.crossing([(1.0, 0.95), (2.0, 0.92)]) == 2.0   # never falls below


def test_crossing_interval_brackets_the_pooled_crossing_and_shrinks_with_agreeing_runs() -> None:
    noisy = {1.0: [0.99, 0.97, 0.98], 2.0: [0.97, 0.80, 0.92], 3.0: [0.70, 0.85, 0.60]}
    pooled = sim_fidelity.crossing([(r, sum(a) / len(a)) for r, a in noisy.items()])
    got = sim_fidelity.crossing_interval(noisy)
    assert got["bracketed"] == 1.0
    assert got["lo"] < pooled < got["hi"]
    # runs that agree: no spread at all
    same = {r: [sum(a) / len(a)] * 3 for r, a in noisy.items()}
    tight = sim_fidelity.crossing_interval(same)
    assert tight["lo"] == pytest.approx(pooled) and tight["hi"] == pytest.approx(pooled)
    assert sim_fidelity.crossing_interval(noisy, seed=0) == got       # seeded
    # a curve that stays above the target: nothing bracketed, no interval
    high = sim_fidelity.crossing_interval({1.0: [0.99, 0.95], 2.0: [0.93, 0.97]})
    assert high["bracketed"] == 0.0 and high["lo"] is None


def test_median_interval_is_tight_for_agreeing_repeats_and_wide_for_a_stray_one() -> None:
    assert sim_fidelity.median_interval([5.0, 5.0, 5.0, 5.0]) == [1.0, 1.0]
    assert sim_fidelity.median_interval([7.0]) == [1.0, 1.0]
    lo, hi = sim_fidelity.median_interval([10.0, 10.5, 9.5, 20.0])
    assert 0.9 <= lo < 1.0 < hi          # the stray repeat moves the median up, not down
    wide_lo, wide_hi = sim_fidelity.median_interval([6.0, 12.0, 9.0, 20.0])
    assert wide_lo < 0.8 and wide_hi > 1.2
    assert sim_fidelity.median_interval([6.0, 12.0, 9.0, 20.0], seed=0) == [wide_lo, wide_hi]


def test_real_intervals_key_each_percentile_as_the_ratios_are() -> None:
    reps = [{"ttft_ms": {"p50": a, "p90": 2 * a, "p99": 3 * a},
             "tpot_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}} for a in (10.0, 11.0, 30.0)]
    got = sim_fidelity.real_intervals(reps)
    assert set(got) == {f"{n} {p}" for n in ("TTFT", "TPOT") for p in ("p50", "p90", "p99")}
    assert got["TPOT p90"] == [1.0, 1.0]
    assert got["TTFT p50"] == got["TTFT p90"]        # a scale does not change the interval
    assert got["TTFT p50"][0] < 1.0 < got["TTFT p50"][1]
