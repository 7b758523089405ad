"""benchmarks/machine_drift.py's arithmetic: the spread of burst times and window means."""
from __future__ import annotations

import pytest

from tests.bench_scripts import import_benchmark

drift = import_benchmark("machine_drift")


def test_summary_sees_a_two_speed_machine_in_stretches() -> None:
    # 1 ms for the first 10 s, 2 ms for the next 10 s (bursts every 0.5 s): a machine
    # that halves its speed for a stretch, as AMX did on r27's Intel VM
    stamps = [0.5 * i for i in range(40)]
    times = [0.001 if t < 10 else 0.002 for t in stamps]
    r = drift.summary(times, stamps, window_s=5.0)
    assert r["bursts"] == 40 and r["min_ms"] == pytest.approx(1.0)
    assert r["max_ms"] == pytest.approx(2.0)
    assert r["window_means_ms"] == pytest.approx([1.0, 1.0, 2.0, 2.0])
    assert r["window_max_over_min"] == pytest.approx(2.0)
    assert r["lag1_autocorrelation"] > 0.9          # stretches, not step-to-step noise
    # the same times shuffled step to step: the spread stays, the stretches go
    alternating = [0.001 if i % 2 else 0.002 for i in range(40)]
    r2 = drift.summary(alternating, stamps, window_s=5.0)
    assert r2["p90_over_p10"] == pytest.approx(2.0)
    assert r2["lag1_autocorrelation"] < -0.9
    assert r2["window_max_over_min"] == pytest.approx(1.0)


def test_summary_refuses_too_few_or_unstamped_bursts() -> None:
    with pytest.raises(ValueError, match="two or more bursts"):
        drift.summary([0.001], [0.0], 5.0)
    with pytest.raises(ValueError, match="a stamp each"):
        drift.summary([0.001, 0.002], [0.0], 5.0)


def test_window_correlations_pair_every_kernel_once() -> None:
    c = drift.window_correlations({"a": [1.0, 2.0, 3.0, 4.0], "b": [2.0, 4.0, 6.0, 8.0],
                                   "c": [4.0, 3.0, 2.0, 1.0]})
    assert c == pytest.approx({"a~b": 1.0, "a~c": -1.0, "b~c": -1.0})
