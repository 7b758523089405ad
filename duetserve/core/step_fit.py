"""Fit a StepTime (core/step_time.py) to measured steps (numpy only, no torch).

Each sample is one step that ran: its StepShape and its wall time. The fit is
non-negative least squares on relative error, so a 10 ms decode counts as much as a 1 s
prefill and no term can come out negative (a negative cost would let a larger step be
priced cheaper). Steps the machine stalled on (another process, a page-cache flush) are
dropped when they miss by more than OUTLIER_FACTOR x the median miss of a first fit.

Relative least squares fits the typical step, which sits below the mean when the noise has
a long tail; latencies are sums of steps (TPOT is a mean over a request's steps), so the
coefficients are finally scaled by one factor that makes the predicted total time of the
kept steps equal the measured total.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from duetserve.core.step_time import TERMS, Layout, StepShape, StepTime

OUTLIER_FACTOR = 6.0


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set). A column that cannot
    enter the solution with a positive value (it is a combination of those in it, as on
    noise-free data) is skipped until the solution moves."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    skipped = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        free = ~passive & ~skipped
        if not free.any() or w[free].max() <= 1e-12 * (1 + np.abs(w).max()):
            break
        j = int(np.argmax(np.where(free, w, -np.inf)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = x[neg] - z[neg]               # >= 0; 0 where x and z are both 0
            alpha = np.min(np.where(step > 0, x[neg] / np.where(step > 0, step, 1.0), 0.0))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        if passive[j]:
            skipped[:] = False
        else:
            skipped[j] = True
    return x


def _solve(x: np.ndarray, seconds: np.ndarray, keep: np.ndarray) -> np.ndarray:
    w = 1.0 / seconds
    return nnls(x[keep] * w[keep, None], np.ones(int(keep.sum())))


def fit_step_time(samples: Sequence[tuple[StepShape, float]], layout: Layout,
                  terms: Sequence[str] = TERMS) -> tuple[StepTime, dict]:
    """The StepTime over `terms` (the others 0) that best fits `samples` (shape, seconds),
    and a report: steps, outliers dropped, RMS / median / p90 relative error, the final
    scale. A term no sample has stays 0, but for the many-row path when no sample went past
    a bounded few-row limit (engine/step_probe.py keeps its start-up probes within a
    limit above 64 rows): that path is priced as the mixed one, which the few-row limit's
    measurement (models/kernels.py) found about as fast at the limit and slower past it,
    so those steps are overpriced a little. ValueError with fewer steps than the terms
    they have, or a non-positive duration."""
    feats = [s.features() for s, _ in samples]
    cols = [TERMS.index(t) for t in terms if any(f[TERMS.index(t)] for f in feats)]
    if len(samples) < len(cols):
        raise ValueError(f"need at least {len(cols)} steps to fit {len(cols)} terms, got "
                         f"{len(samples)}")
    x = np.array([[f[i] for i in cols] for f in feats], dtype=np.float64)
    seconds = np.array([t for _, t in samples], dtype=np.float64)
    if not (seconds > 0).all():
        raise ValueError("every measured step must take a positive time")
    keep = np.ones(len(samples), dtype=bool)
    coef = _solve(x, seconds, keep)
    miss = np.abs(x @ coef / seconds - 1.0)
    keep = miss <= OUTLIER_FACTOR * max(float(np.median(miss)), 0.01)
    coef = _solve(x, seconds, keep)
    pred = x @ coef
    scale = float(seconds[keep].sum() / pred[keep].sum()) if pred[keep].sum() > 0 else 1.0
    full = [0.0] * len(TERMS)
    for i, c in zip(cols, coef):
        full[i] = float(c * scale)
    if ("many_row" in terms and layout.few_rows and not layout.is_unbounded
            and not any(f[TERMS.index("many_step")] for f in feats)):
        for path_term in ("step", "row"):
            full[TERMS.index(f"many_{path_term}")] = full[TERMS.index(f"mixed_{path_term}")]
    model = StepTime(layout, tuple(full))
    rel = pred * scale / seconds - 1.0
    report = {"num_steps": len(samples), "num_outliers": int((~keep).sum()),
              "rms_rel_error": float(np.sqrt(np.mean(rel[keep] ** 2))),
              "median_abs_rel_error": float(np.median(np.abs(rel[keep]))),
              "p90_abs_rel_error": float(np.percentile(np.abs(rel[keep]), 90)),
              "scale": scale}
    return model, report
