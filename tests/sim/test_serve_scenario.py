"""The calibration's serving scenario traces (bench/serve_scenario.py): pure arithmetic."""
from __future__ import annotations

import pytest

from duetserve.bench.serve_scenario import (MAX_PER_PHASE, QUICK_TRACES, TRACES, ServingSteps,
                                            capacity_sample, summary, trace, traces)


@pytest.mark.parametrize("tr", TRACES, ids=lambda t: t.name)
def test_trace_phases_follow_the_capacity_and_are_seeded(tr) -> None:
    convs, offsets, rates = trace(tr, 2.0, (1000, 40000))
    assert rates == pytest.approx([2.0 * f for f in tr.levels])
    assert len(convs) == len(offsets)
    assert all(len(c) == tr.spec["num_turns"] for c in convs)
    # phase i holds round(rate_i * phase_s) arrivals, all after the phase starts
    start = 0
    for i, rate in enumerate(rates):
        n = max(2, round(rate * tr.phase_s))
        phase = offsets[start:start + n]
        assert min(phase) >= i * tr.phase_s
        start += n
    assert start == len(offsets)
    again = trace(tr, 2.0, (1000, 40000))
    assert again[1] == offsets and again[0] == convs
    assert trace(tr, 4.0, (1000, 40000))[2] == pytest.approx([4.0 * f for f in tr.levels])
    with pytest.raises(ValueError, match="capacity must be > 0"):
        trace(tr, 0.0, (1000, 40000))


@pytest.mark.parametrize("tr", TRACES + QUICK_TRACES, ids=lambda t: t.name)
def test_a_fast_engine_gets_capped_phases_at_the_same_rates(tr) -> None:
    # a tiny model's capacity: uncapped, phases of thousands of arrivals would overrun the
    # engine's waiting queue (max_waiting_requests 1024: EngineOverloadedError)
    capacity = 10 * MAX_PER_PHASE / min(tr.levels) / tr.phase_s
    convs, offsets, rates = trace(tr, capacity, (1000, 40000))
    assert len(offsets) == len(convs) == MAX_PER_PHASE * len(tr.levels) < 1024
    assert rates == pytest.approx([capacity * f for f in tr.levels])
    for i, rate in enumerate(rates):
        phase = offsets[i * MAX_PER_PHASE:(i + 1) * MAX_PER_PHASE]
        assert i * tr.phase_s <= min(phase) and max(phase) < (i + 1) * tr.phase_s
        # the phase keeps its rate and ends early: 200 arrivals span about 200 / rate
        assert max(phase) - i * tr.phase_s == pytest.approx(MAX_PER_PHASE / rate, rel=0.5)


def test_the_short_trace_has_more_shorter_conversations_than_the_long_one() -> None:
    long_, short = traces()
    lens = {}
    for tr in (long_, short):
        convs, _, _ = trace(tr, 1.0, (1000, 40000))
        lens[tr.name] = max(len(t.new_token_ids) for c in convs for t in c)
    assert lens["short"] <= 96 < lens["long"]
    assert traces(quick=True) != TRACES


def test_capacity_sample_is_the_trace_kind_not_the_trace() -> None:
    for tr in TRACES:
        sample = capacity_sample(tr, (1000, 40000), n=10)
        convs, _, _ = trace(tr, 0.5, (1000, 40000))
        assert len(sample) == 10 and all(len(c) == tr.spec["num_turns"] for c in sample)
        assert sample[0] != convs[0]


def test_summary_totals_its_traces() -> None:
    a = ServingSteps(samples=[([(1, 5, True)], 0.01)] * 3, cold=[False] * 3, conversations=2,
                     requests=4, duration_s=1.5, rates=[0.1])
    b = ServingSteps(samples=[([(1, 5, True)], 0.02)] * 2, cold=[False] * 2, conversations=1,
                     requests=2, duration_s=2.0, rates=[0.3])
    s = summary([(TRACES[0], a), (TRACES[1], b)])
    assert (s["steps"], s["requests"], s["conversations"]) == (5, 6, 3)
    assert s["duration_s"] == pytest.approx(3.5) and s["engine_s"] == pytest.approx(0.07)
    assert [t["name"] for t in s["traces"]] == ["long", "short"]
    assert s["traces"][1]["rates"] == [0.3]
