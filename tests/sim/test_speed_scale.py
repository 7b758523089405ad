"""The speed probe's arithmetic (sim/speed.py): measured / predicted probe time, the
profile rescaled by now / then, and to a run's own steps (no engine; the probe's steps are synthetic here, the
engine runs it in tests/sim/test_fidelity_tiny.py)."""
from __future__ import annotations

import pytest

from duetserve.sim.cost import FEATURES, CalibratedCost, shape_of
from duetserve.sim.gpu import efficiency_for
from duetserve.sim.profile import calibrated_profile, profile_from_json, roofline_profile
from duetserve.sim.speed import (at_calibrated_level, at_run_speed, probe_ratio, rescaled,
                                 speed_factor)


def _cost() -> CalibratedCost:
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("step")] = 2e-3
    coef[FEATURES.index("rows_few")] = 1e-3
    coef[FEATURES.index("many_rows")] = 5e-3
    coef[FEATURES.index("rows_many")] = 1e-4
    coef[FEATURES.index("fresh_pairs")] = 1e-7
    return CalibratedCost(tuple(coef), 16, arrival_s=1e-4, flash_above=1000)


DECODE = [(1, 128, True)] * 3          # 3 streams: 2 + 3 ms
PREFILL = [(64, 0, True)]              # 5 + 6.4 + 0.208 ms


def _samples(decode_scale: float, prefill_scale: float, stall: float | None = None):
    cost = _cost()
    samples = [(DECODE, decode_scale * cost.step_seconds(shape_of(DECODE))) for _ in range(6)]
    samples += [(PREFILL, prefill_scale * cost.step_seconds(shape_of(PREFILL)))
                for _ in range(2)]
    if stall is not None:
        samples.append((DECODE, stall * cost.step_seconds(shape_of(DECODE))))
    return samples, [False] * len(samples)


def test_scaled_cost_multiplies_every_step() -> None:
    cost = _cost()
    twice = cost.scaled(1.25)
    for items in (DECODE, PREFILL, DECODE + PREFILL):
        assert twice.step_seconds(shape_of(items)) == pytest.approx(
            1.25 * cost.step_seconds(shape_of(items)))
    assert twice.arrival_s == pytest.approx(1.25e-4)
    assert (twice.breakpoint, twice.flash_above) == (16, 1000)
    with pytest.raises(ValueError, match="must be > 0"):
        cost.scaled(0.0)


def test_probe_ratio_is_measured_over_predicted_without_stalls() -> None:
    samples, cold = _samples(1.2, 0.9)
    r = probe_ratio(_cost(), samples, cold)
    cost = _cost()
    d, p = cost.step_seconds(shape_of(DECODE)), cost.step_seconds(shape_of(PREFILL))
    assert r["decode_ratio"] == pytest.approx(1.2)
    assert r["prefill_ratio"] == pytest.approx(0.9)
    assert r["ratio"] == pytest.approx((6 * 1.2 * d + 2 * 0.9 * p) / (6 * d + 2 * p))
    assert (r["steps"], r["dropped"]) == (8, 0)
    # a step stalled 10x (a page-cache reclaim, a neighbour) is not the machine's speed
    stalled, cold = _samples(1.2, 0.9, stall=12.0)
    r2 = probe_ratio(_cost(), stalled, cold)
    assert (r2["steps"], r2["dropped"]) == (9, 1)
    assert r2["ratio"] == pytest.approx(r["ratio"])
    with pytest.raises(ValueError, match="no steps"):
        probe_ratio(_cost(), [], [])
    with pytest.raises(ValueError, match="cold flags"):
        probe_ratio(_cost(), samples, [False])


def test_rescaled_profile_runs_at_the_probed_speed() -> None:
    cost = _cost()
    then = probe_ratio(cost, *_samples(1.0, 1.0))
    profile = calibrated_profile("p", cost, {"max_num_seqs": 8}, {"speed_probe": then})
    now = probe_ratio(cost, *_samples(1.1, 1.1))
    fast = rescaled(profile, now)
    assert speed_factor(then, now) == pytest.approx(1.1)
    assert fast.meta["speed_scale"]["factor"] == pytest.approx(1.1)
    assert fast.cost.step_seconds(shape_of(DECODE)) == pytest.approx(
        1.1 * cost.step_seconds(shape_of(DECODE)))
    # what is saved is the scaled cost; the original profile is untouched
    assert profile_from_json(fast.to_json()).cost == fast.cost
    assert profile.cost == cost and "speed_scale" not in profile.meta
    with pytest.raises(ValueError, match="no speed-probe record"):
        rescaled(calibrated_profile("old", cost, {}, {}), now)
    gpu = roofline_profile("llama-3-8b", "h100-sxm", efficiency_for("h100-sxm"))
    with pytest.raises(ValueError, match="only a calibrated profile"):
        rescaled(gpu, now)
    with pytest.raises(ValueError, match="must be > 0"):
        speed_factor({"ratio": 0.0}, now)


def test_profile_at_a_runs_own_speed_predicts_its_total() -> None:
    """The fidelity benchmark's diagnostic: scaled to a run's steps (no calibration-time
    probe needed), the profile predicts that run's total step time (stalls aside)."""
    cost = _cost()
    profile = calibrated_profile("p", cost, {"max_num_seqs": 8}, {})
    samples, cold = _samples(1.3, 1.1, stall=20.0)
    at = at_run_speed(profile, samples, cold)
    kept = samples[:-1]                     # the stalled step is dropped, as by the probe
    assert sum(at.cost.step_seconds(shape_of(sl)) for sl, _ in kept) == pytest.approx(
        sum(dt for _, dt in kept))
    assert at.meta["speed_scale"]["source"] == "run"
    assert at.meta["speed_scale"]["factor"] == pytest.approx(probe_ratio(cost, samples,
                                                                         cold)["ratio"])
    assert profile.cost == cost and "speed_scale" not in profile.meta
    with pytest.raises(ValueError, match="no steps"):
        at_run_speed(profile, [], [])
    gpu = roofline_profile("llama-3-8b", "h100-sxm", efficiency_for("h100-sxm"))
    with pytest.raises(ValueError, match="only a calibrated profile"):
        at_run_speed(gpu, samples, cold)


def test_profile_at_the_calibrations_level_scales_by_their_geometric_mean() -> None:
    """--local-level: the pooled fit at the level of the calibrations next to a run (their
    measured / predicted totals), every step by the same geometric mean; nothing mutated."""
    cost = _cost()
    profile = calibrated_profile("p", cost, {"max_num_seqs": 8}, {})
    at = at_calibrated_level(profile, [0.9, 1.6])
    for shape in (shape_of(DECODE), shape_of(PREFILL)):
        assert at.cost.step_seconds(shape) == pytest.approx(1.2 * cost.step_seconds(shape))
    assert at.meta["speed_scale"] == {"factor": pytest.approx(1.2), "source": "calibrations",
                                      "levels": [0.9, 1.6]}
    assert profile.cost == cost and "speed_scale" not in profile.meta
    for bad in ([], [1.0, 0.0]):
        with pytest.raises(ValueError, match="levels must be positive"):
            at_calibrated_level(profile, bad)
    gpu = roofline_profile("llama-3-8b", "h100-sxm", efficiency_for("h100-sxm"))
    with pytest.raises(ValueError, match="only a calibrated profile"):
        at_calibrated_level(gpu, [1.0])
