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
