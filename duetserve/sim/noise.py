"""The machine's step-time noise, measured in the calibration and replayed by the simulator.

A calibrated cost model predicts a step's typical time. On a shared machine (a cloud VM
with neighbours on the same memory bus) the same step costs more or less from one moment
to the next, by more than the cost model misses by shape (docs/simulator.md §3: the same
workload measured three times has TPOT p90s 1.0-1.5x apart at 0.8 load). The spread
matters for what a plan is judged on: tails (p90, p99) and queueing near saturation. So
the simulator can multiply each step's predicted time by a factor drawn from a model of
that noise:

    factor(t) = exp(w + s(t) + L - (white² + slow² + level²) / 2)

    w     per step, independent, normal with standard deviation `white`
    s(t)  an Ornstein-Uhlenbeck process in simulated time: stationary standard deviation
          `slow`, correlation exp(-dt / tau_s) between two steps dt apart (a drift that
          lasts seconds, shared by every step in that stretch)
    L     per noise path (one instance's simulated run), normal with standard deviation
          `level`: the machine's speed from one run to the next, minutes apart

The mean factor is 1 (a log-normal's mean is exp(sigma² / 2)), so the calibrated level is
kept and only the spread is added. `estimate` measures the first three numbers from the
calibration's serving scenario: the log of measured / predicted time of each step, in
time bins (the spread inside a bin is `white`, the spread of the bins' means is `slow`,
the correlation of neighbouring bins gives `tau_s`). One calibration cannot see `level`
(each trace's mean is taken out); `level_of` measures it from several calibrations taken
minutes apart (sim_calibrate.pooled_profile: the spread of their levels under one fit).
Both see the machine during calibrations, never the runs a fidelity check judges.

Nothing here mutates anything but a `NoiseSampler`'s own state.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

BIN_S = 1.0              # time bins of the estimate
MIN_BIN_STEPS = 5        # bins with fewer steps do not count
OUTLIER_MADS = 6.0       # steps further from the median (in MADs) are stalls, not noise


@dataclass(frozen=True)
class StepNoise:
    """Log-normal step-time noise: `white` per step, `slow` with time constant `tau_s`,
    `level` per run (0: not measured)."""

    white: float
    slow: float
    tau_s: float
    level: float = 0.0

    def __post_init__(self) -> None:
        if not (self.white >= 0 and self.slow >= 0 and self.tau_s > 0 and self.level >= 0):
            raise ValueError(f"noise needs white, slow, level >= 0 and tau_s > 0, got {self}")

    def sampler(self, seed: int) -> "NoiseSampler":
        return NoiseSampler(self, seed)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> "StepNoise | None":
        return None if not d else cls(float(d["white"]), float(d["slow"]), float(d["tau_s"]),
                                      float(d.get("level", 0.0)))

    def describe(self) -> str:
        return (f"step-time noise: {100 * self.white:.1f}% per step, {100 * self.slow:.1f}% "
                f"drift over ~{self.tau_s:.1f} s"
                + (f", {100 * self.level:.1f}% from run to run" if self.level else ""))


class NoiseSampler:
    """One machine's noise path (seeded). Mutates: its generator and drift state."""

    def __init__(self, noise: StepNoise, seed: int) -> None:
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self.drift = float(self.rng.normal(0.0, noise.slow))   # stationary start
        self.t = 0.0
        # the run's level from a generator of its own, so that the per-step draws of a
        # seed are the same with and without it
        run_level = float(np.random.default_rng([seed, 1]).normal(0.0, noise.level)) \
            if noise.level > 0 else 0.0
        self.bias = (noise.white ** 2 + noise.slow ** 2 + noise.level ** 2) / 2.0 - run_level

    def factor(self, now: float) -> float:
        """The multiplier of a step that starts at simulated time `now` (non-decreasing
        over calls)."""
        n = self.noise
        dt = max(0.0, now - self.t)
        self.t = max(self.t, now)
        if n.slow > 0:
            keep = math.exp(-dt / n.tau_s)
            self.drift = self.drift * keep + self.rng.normal(0.0, n.slow) * math.sqrt(
                max(0.0, 1.0 - keep * keep))
        white = self.rng.normal(0.0, n.white) if n.white > 0 else 0.0
        return math.exp(white + self.drift - self.bias)


def estimate(traces: Sequence[tuple[Sequence[float], Sequence[float]]],
             bin_s: float = BIN_S) -> StepNoise | None:
    """StepNoise from traces of (step start times in s, log(measured / predicted)) per
    step; each trace's mean log ratio is removed (the level is the fit's, the probe's).
    None when there are too few bins to tell (fewer than 8 with MIN_BIN_STEPS steps).

    `white`: the spread inside a bin. The drift from the bins' means: for an
    Ornstein-Uhlenbeck process of variance s² and time constant tau, means of bins b long
    k >= 1 bins apart covary by s² e^(-k x) ((1 - e^-x) / x)² e^x... reduced: lag 1 by
    s² ((1 - e^-x) / x)², lag 2 by that times e^-x (x = b / tau). So e^-x is the ratio of
    the lag-2 to the lag-1 covariance, and s² follows from the lag-1 one."""
    inside, lag1, lag2, nbins = [], [], [], 0
    for starts, logs in traces:
        t = np.asarray(starts, dtype=np.float64)
        r = np.asarray(logs, dtype=np.float64)
        if len(t) != len(r):
            raise ValueError(f"{len(t)} start times for {len(r)} steps")
        if len(r) < MIN_BIN_STEPS:
            continue
        med = np.median(r)
        mad = 1.4826 * np.median(np.abs(r - med)) or 1e-9
        keep = np.abs(r - med) <= OUTLIER_MADS * mad
        t, r = t[keep], r[keep] - r[keep].mean()
        bins = np.floor((t - t.min()) / bin_s).astype(np.int64)
        means: dict[int, float] = {}
        for b in np.unique(bins):
            x = r[bins == b]
            if len(x) >= MIN_BIN_STEPS:
                inside.append(float(x.var(ddof=1)))
                means[int(b)] = float(x.mean())
        nbins += len(means)
        for b, m in means.items():
            if b + 1 in means:
                lag1.append(m * means[b + 1])
            if b + 2 in means:
                lag2.append(m * means[b + 2])
    if nbins < 8:
        return None
    white = math.sqrt(float(np.mean(inside)))
    c1 = float(np.mean(lag1)) if len(lag1) >= 4 else 0.0
    c2 = float(np.mean(lag2)) if len(lag2) >= 4 else 0.0
    # bins' means that do not go together (within twice the covariance's standard
    # error): no drift to tell from the jitter
    if c1 <= 2.0 * float(np.std(lag1)) / math.sqrt(max(1, len(lag1))):
        return StepNoise(white, 0.0, bin_s)
    x = -math.log(min(max(c2 / c1, 0.01), 0.99))
    slow2 = c1 * x * x / (1.0 - math.exp(-x)) ** 2
    return StepNoise(white, math.sqrt(slow2), bin_s / x)


def level_of(levels: Sequence[float]) -> float:
    """StepNoise.level from the levels (measured / predicted total under one fit) of
    calibrations taken minutes apart: the standard deviation of their logs; 0 for fewer
    than three (too few to tell a spread)."""
    if len(levels) < 3:
        return 0.0
    if min(levels) <= 0:
        raise ValueError(f"levels must be positive, got {list(levels)}")
    return float(np.std(np.log(np.asarray(levels, dtype=np.float64)), ddof=1))


def log_ratios(cost, samples: Sequence[tuple[Sequence[tuple[int, int, bool]], float]],
               cold: Sequence[bool]) -> list[float]:
    """log(measured / predicted) of each measured step (slices, seconds; in the order
    they ran) under `cost`."""
    from duetserve.sim.cost import run_shapes
    shapes = run_shapes(cost, [sl for sl, _ in samples], cold)
    return [math.log(max(dt, 1e-9) / max(cost.step_seconds(s), 1e-9))
            for (_, dt), s in zip(samples, shapes)]
