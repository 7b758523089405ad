"""The calibration's serving scenario trace (bench/serve_scenario.py): pure arithmetic."""
from __future__ import annotations

import pytest

from duetserve.bench.serve_scenario import LEVELS, PHASE_S, TRACE, capacity_sample, trace


def test_trace_phases_follow_the_capacity_and_are_seeded() -> None:
    convs, offsets, rates = trace(2.0, (1000, 40000), seed=5)
    assert rates == pytest.approx([2.0 * f for f in LEVELS])
    assert len(convs) == len(offsets)
    assert all(len(c) == TRACE["num_turns"] for c in convs)
    # phase i holds round(rate_i * PHASE_S) arrivals, all after the phase starts
    start = 0
    for i, rate in enumerate(rates):
        n = max(2, round(rate * PHASE_S))
        phase = offsets[start:start + n]
        assert min(phase) >= i * PHASE_S
        start += n
    assert start == len(offsets)
    again = trace(2.0, (1000, 40000), seed=5)
    assert again[1] == offsets and again[0] == convs
    assert trace(4.0, (1000, 40000), seed=5)[2] == pytest.approx([4.0 * f for f in LEVELS])
    with pytest.raises(ValueError, match="capacity must be > 0"):
        trace(0.0, (1000, 40000))


def test_capacity_sample_is_the_trace_kind_not_the_trace() -> None:
    sample = capacity_sample((1000, 40000), n=10)
    convs, _, _ = trace(0.5, (1000, 40000))
    assert len(sample) == 10 and all(len(c) == TRACE["num_turns"] for c in sample)
    assert sample[0] != convs[0]
