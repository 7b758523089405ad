"""Fit a CalibratedCost to measured engine steps (numpy only).

Each sample is one real step: its slices (num_new, num_computed_before, sampled) and its
wall time. The fit is non-negative least squares on relative error (every step counts by
its relative miss, so 10 ms decodes weigh as much as 1 s prefills), at the engine's kernel
breakpoint when it is given, else over every candidate breakpoint (the best wins). Steps
the machine stalled on (a foreign process, page-cache reclaim) are dropped when they miss
by more than OUTLIER_FACTOR x the median miss after a first fit, and counted in the
report.

Relative least squares fits the typical step, which sits below the mean when the noise
has a long tail (a garbage collection, a busy neighbour). Latencies are sums of steps
(TPOT is a mean over a request's steps), so the coefficients are finally scaled by one
factor that makes the predicted total time of the kept steps equal the measured total.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from duetserve.sim.cost import FEATURES, CalibratedCost, StepShape, rewarm_counts, shape_of

BREAKPOINTS = (0, 1, 2, 4, 8, 16, 32)
OUTLIER_FACTOR = 6.0

Sample = tuple[Sequence[tuple[int, int, bool]], float]   # (slices, seconds)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * (1 + np.abs(w).max()):
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def _design(shapes: list[StepShape], breakpoint: int) -> np.ndarray:
    probe = CalibratedCost((0.0,) * len(FEATURES), breakpoint)
    return np.array([probe.features(s) for s in shapes], dtype=np.float64)


def _fit_one(shapes: list[StepShape], seconds: np.ndarray, breakpoint: int,
             keep: np.ndarray) -> tuple[np.ndarray, float]:
    x = _design(shapes, breakpoint)
    if breakpoint == 0:
        x[:, FEATURES.index("many_rows")] = 0.0     # collinear with "step" when T > 0
    w = 1.0 / seconds
    coef = nnls(x[keep] * w[keep, None], np.ones(int(keep.sum())))
    rel = x @ coef / seconds - 1.0
    return coef, float(np.sqrt(np.mean(rel[keep] ** 2)))


def fit_cost(samples: Sequence[Sample], arrival_s: float = 0.0,
             cold: Sequence[float | bool] | None = None, flash_above: int = 0,
             chunk_rows: int = 0, breakpoint: int = 0,
             decode_split: tuple[int, int] = (0, 0)) -> tuple[CalibratedCost, dict]:
    """The best CalibratedCost for `samples`, and a report of the fit (RMS and median
    relative error, outliers dropped, per-breakpoint RMS). `cold[i]`: sample i was the
    first step after the engine went idle, and for how long (sim/cost.py cold_state;
    None: none was); the samples are in the order
    they ran (the steps after a reset are counted from it, per candidate breakpoint:
    rewarm_counts). `flash_above`: the engine's split of chunks after context and
    `chunk_rows` its chunks run as decode rows (sim/cost.py StepShape), kept in the cost,
    as is `decode_split` (its decode attention's threads and KV heads). `breakpoint`: the
    engine's kernel switch (rows up to which its few-row kernels run, models/kernels.py
    few_row_limit) when known; 0: the best of BREAKPOINTS is fitted."""
    if cold is not None and len(cold) != len(samples):
        raise ValueError(f"{len(cold)} cold flags for {len(samples)} samples")
    flags = cold if cold is not None else [False] * len(samples)
    shapes = [shape_of(slices, c, flash_above, chunk_rows, decode_split)
              for (slices, _), c in zip(samples, flags)]
    rows = [s.num_tokens for s in shapes]

    def count_rewarm(bp: int) -> None:         # mutates shapes' rewarm counts
        for s, k in zip(shapes, rewarm_counts(flags, rows, bp)):
            s.rewarm = k
    seconds = np.array([s for _, s in samples], dtype=np.float64)
    if len(samples) < 2 * len(FEATURES):
        raise ValueError(f"need at least {2 * len(FEATURES)} steps to fit, got {len(samples)}")
    keep = np.ones(len(samples), dtype=bool)
    best = None
    scores = {}
    for bp in (breakpoint,) if breakpoint > 0 else BREAKPOINTS:
        count_rewarm(bp)
        coef, _ = _fit_one(shapes, seconds, bp, keep)
        miss = np.abs(_design(shapes, bp) @ coef / seconds - 1.0)
        keep_bp = miss <= OUTLIER_FACTOR * max(np.median(miss), 0.01)
        coef, rms = _fit_one(shapes, seconds, bp, keep_bp)
        scores[bp] = rms
        if best is None or rms < best[2]:
            best = (bp, coef, rms, keep_bp)
    bp, coef, rms, keep = best
    count_rewarm(bp)
    scale = seconds[keep].sum() / (_design(shapes, bp)[keep] @ coef).sum()
    cost = CalibratedCost(tuple(float(c * scale) for c in coef), bp, arrival_s, flash_above,
                          chunk_rows, tuple(decode_split))
    pred = np.array([cost.step_seconds(s) for s in shapes])
    rel = pred / seconds - 1.0
    report = {"num_steps": len(samples), "num_outliers": int((~keep).sum()),
              "rms_rel_error": float(np.sqrt(np.mean(rel[keep] ** 2))),
              "median_abs_rel_error": float(np.median(np.abs(rel[keep]))),
              "median_rel_error": float(np.median(rel[keep])), "mean_scale": float(scale),
              "p90_abs_rel_error": float(np.percentile(np.abs(rel[keep]), 90)),
              "total_time_ratio": float(pred[keep].sum() / seconds[keep].sum()),
              "rms_by_breakpoint": {str(k): v for k, v in scores.items()}}
    return cost, report
