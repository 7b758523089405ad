"""Rescale a calibrated profile to the machine's current speed with the speed probe
(bench/speed_probe.py runs it; this module only does the arithmetic, numpy only).

A calibration records the probe's measured / predicted time (`probe_ratio`) in the
profile's meta ("speed_probe"). The probe run again later gives another ratio; the speed
factor is now / then, and every coefficient of the cost model is multiplied by it
(`rescaled`): a machine running 10% slower than during the calibration gets steps 10%
longer. One factor for every term, since the drift seen here moved decode-only and
prefill steps alike (docs/simulator.md §3).

`at_calibrated_level` rescales a profile pooled over calibrations taken at different times
(sim_calibrate.pooled_profile) to the level of the ones taken next to a run, before and
after it: still calibration, no step of the run enters it, but the machine's speed of that
stretch rather than the average over all of them.

`at_run_speed` is the fidelity benchmark's diagnostic, not a prediction: the profile
rescaled to a measured run's own steps (the same measured / predicted total), so that
what is left between the run and its simulation is the simulator's error (scheduling,
the cost model's shape, queueing) and not the machine's speed at that minute.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from duetserve.sim.cost import CalibratedCost, run_shapes

OUTLIER_RATIO = 3.0     # probe steps this far from the median measured/predicted are dropped


def probe_ratio(cost: CalibratedCost, samples: Sequence, cold: Sequence[bool]) -> dict:
    """Measured / predicted time of the probe's steps (samples: (slices, seconds)) under
    `cost`: the total over the steps whose own ratio is within OUTLIER_RATIO of the
    median (a stall is not the machine's speed), and the same for decode-only steps and
    for steps with prefill work, for the record. ValueError on no steps."""
    if not samples:
        raise ValueError("the speed probe measured no steps")
    if len(cold) != len(samples):
        raise ValueError(f"{len(cold)} cold flags for {len(samples)} probe steps")
    pred = np.array([cost.step_seconds(s)
                     for s in run_shapes(cost, [sl for sl, _ in samples], cold)])
    real = np.array([s for _, s in samples], dtype=np.float64)
    per = real / pred
    med = float(np.median(per))
    keep = (per <= OUTLIER_RATIO * med) & (per >= med / OUTLIER_RATIO)
    decode = np.array([all(n == 1 for n, _, _ in sl) for sl, _ in samples])

    def ratio(mask: np.ndarray) -> float | None:
        m = mask & keep
        return float(real[m].sum() / pred[m].sum()) if m.any() else None
    return {"ratio": ratio(np.ones_like(keep)), "decode_ratio": ratio(decode),
            "prefill_ratio": ratio(~decode), "steps": int(len(real)),
            "dropped": int((~keep).sum()), "measured_s": float(real.sum())}


def speed_factor(reference: dict, now: dict) -> float:
    """Now / then: the probe's ratio now over the one recorded at calibration."""
    ref, cur = reference.get("ratio"), now.get("ratio")
    if not ref or not cur or not (ref > 0 and cur > 0):
        raise ValueError(f"speed probe ratios must be > 0, got reference {ref}, now {cur}")
    return cur / ref


def probe_reference(profile) -> dict:
    """The speed-probe record a calibration stored in `profile`'s meta. ValueError when
    the profile is not calibrated or predates the probe (nothing to rescale against)."""
    _check_calibrated(profile)
    reference = profile.meta.get("speed_probe")
    if not reference:
        raise ValueError("the profile has no speed-probe record: re-run `duet simulate "
                         "--calibrate`")
    return reference


def _check_calibrated(profile) -> None:
    if profile.kind != "calibrated":
        raise ValueError(f"only a calibrated profile can be rescaled (this one: {profile.kind})")


def _with_cost_scaled(profile, factor: float, record: dict):
    """A copy of `profile` with its cost times `factor` and `record` as meta["speed_scale"]."""
    cost = profile.cost.scaled(factor)
    meta = {**profile.meta, "speed_scale": {"factor": factor, **record}}
    return replace(profile, cost=cost, cost_json=cost.to_json(), meta=meta)


def at_run_speed(profile, samples: Sequence, cold: Sequence[bool]):
    """A copy of the calibrated `profile` with its cost scaled by the measured / predicted
    total of a run's own steps (samples: (slices, seconds); `probe_ratio`'s total, stalls
    dropped), recorded as meta["speed_scale"] with source "run". ValueError when the
    profile is not calibrated or there are no steps. Mutates nothing."""
    _check_calibrated(profile)
    now = probe_ratio(profile.cost, samples, cold)
    return _with_cost_scaled(profile, now["ratio"], {"source": "run", "now": now})


def rescaled(profile, now: dict):
    """A copy of the calibrated `profile` (sim/profile.SimProfile) with its cost scaled by
    speed_factor(profile's recorded probe, `now`); the factor and both probe records go
    into the copy's meta ("speed_scale"). ValueError when the profile has no probe record
    (calibrated before the probe existed) or is not calibrated. Mutates nothing."""
    reference = probe_reference(profile)
    return _with_cost_scaled(profile, speed_factor(reference, now),
                             {"source": "probe", "reference": reference, "now": now})


def geometric_mean(levels: Sequence[float]) -> float:
    """The geometric mean of positive speed levels (ratios average in logs)."""
    return float(np.exp(np.mean(np.log(np.asarray(levels, dtype=np.float64)))))


def at_calibrated_level(profile, levels: Sequence[float]):
    """A copy of the calibrated `profile` with its cost scaled by the geometric mean of
    `levels`: measured / predicted totals under its fit of the calibrations taken next to
    a run (sim_calibrate.pooled_profile's meta["pooled"]["levels"], those around the run),
    recorded as meta["speed_scale"] with source "calibrations". ValueError when the
    profile is not calibrated or a level is not positive. Mutates nothing."""
    _check_calibrated(profile)
    if not levels or min(levels) <= 0:
        raise ValueError(f"calibration levels must be positive, got {list(levels)}")
    factor = geometric_mean(levels)
    return _with_cost_scaled(profile, factor, {"source": "calibrations",
                                               "levels": [float(x) for x in levels]})
