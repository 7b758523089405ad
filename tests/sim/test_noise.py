"""Step-time noise (sim/noise.py): its estimate from measured steps, its sampler, and the
simulator with it (no engine, no timing: synthetic series from seeded generators)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from duetserve.bench.token_workload import TokenTurn
from duetserve.config import SchedulerConfig
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.cost import FEATURES, CalibratedCost
from duetserve.sim.noise import StepNoise, estimate, level_of
from duetserve.sim.profile import calibrated_profile, profile_from_json
from duetserve.sim.run import simulate


def linear_cost(step: float, per_token: float) -> CalibratedCost:
    """t = step + per_token * T."""
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("step")] = step
    coef[FEATURES.index("rows_many")] = per_token
    return CalibratedCost(tuple(coef), 0)


def synthetic_trace(seed: int, seconds: float, step_s: float, white: float, slow: float,
                    tau_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Step start times and log(measured / predicted) with a known drift and jitter."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, seconds, step_s)
    keep = math.exp(-step_s / tau_s)
    drift = np.empty(len(t))
    x = rng.normal(0.0, slow)
    for i in range(len(t)):
        x = x * keep + rng.normal(0.0, slow) * math.sqrt(1 - keep * keep)
        drift[i] = x
    return t, drift + rng.normal(0.0, white, len(t)) + 0.3     # a level: removed


def test_estimate_recovers_the_jitter_the_drift_and_its_time_constant() -> None:
    traces = [synthetic_trace(s, 120.0, 0.01, 0.06, 0.08, 4.0) for s in (1, 2)]
    traces[0][1][100] += 5.0                      # a stall: not noise
    noise = estimate(traces)
    assert noise.white == pytest.approx(0.06, rel=0.1)   # + the drift inside a bin
    assert noise.slow == pytest.approx(0.08, rel=0.25)
    assert 2.0 < noise.tau_s < 8.0
    # no drift: the bins' means spread only as the jitter says
    flat = estimate([synthetic_trace(4, 120.0, 0.01, 0.06, 0.0, 4.0)])
    assert flat.white == pytest.approx(0.06, rel=0.05) and flat.slow < 0.02
    # too short to tell
    assert estimate([synthetic_trace(4, 5.0, 0.01, 0.06, 0.08, 4.0)]) is None


def test_sampler_has_mean_one_and_is_seeded() -> None:
    noise = StepNoise(white=0.05, slow=0.08, tau_s=2.0)
    times = np.arange(0.0, 2000.0, 0.01)
    a = noise.sampler(7)
    f = np.array([a.factor(t) for t in times])
    assert f.mean() == pytest.approx(1.0, abs=0.01)
    assert np.log(f).std() == pytest.approx(math.hypot(0.05, 0.08), rel=0.1)
    # neighbours share the drift: correlated over a step, not over a minute
    lf = np.log(f)
    near = np.corrcoef(lf[:-1], lf[1:])[0, 1]
    far = np.corrcoef(lf[:-6000], lf[6000:])[0, 1]
    assert near > 0.6 and abs(far) < 0.1
    b = noise.sampler(7)
    assert [b.factor(t) for t in times[:50]] == list(f[:50])
    c = noise.sampler(8)
    assert [c.factor(t) for t in times[:50]] != list(f[:50])
    with pytest.raises(ValueError):
        StepNoise(white=-0.1, slow=0.0, tau_s=1.0)


def test_level_is_one_draw_per_path_that_keeps_the_mean_and_the_per_step_draws() -> None:
    times = np.arange(0.0, 20.0, 0.01)
    base, lev = StepNoise(0.05, 0.08, 2.0), StepNoise(0.05, 0.08, 2.0, level=0.1)
    assert StepNoise.from_json(lev.to_json()) == lev
    assert StepNoise.from_json(base.to_json() | {"level": 0.0}) == base
    assert "from run to run" in lev.describe() and "run to run" not in base.describe()
    logs_base, logs_lev = [], []
    for seed in range(400):
        a, b = base.sampler(seed), lev.sampler(seed)
        fa = np.log([a.factor(t) for t in times[:40]])
        fb = np.log([b.factor(t) for t in times[:40]])
        shift = fb - fa                   # the same per-step draws, one shift per path
        assert np.ptp(shift) < 1e-9
        logs_base.append(fa.mean())
        logs_lev.append(fb.mean())
    spread = np.std(np.array(logs_lev) - np.array(logs_base))
    assert spread == pytest.approx(0.1, rel=0.15)
    path = lev.sampler(5)                 # mean 1 over paths and steps
    means = [np.mean([lev.sampler(s).factor(t) for t in times[::50]]) for s in range(400)]
    assert np.mean(means) == pytest.approx(1.0, abs=0.02)
    assert path.factor(0.0) == lev.sampler(5).factor(0.0)
    with pytest.raises(ValueError):
        StepNoise(0.05, 0.0, 1.0, level=-0.01)


def test_level_of_is_the_spread_of_the_calibrations_logs() -> None:
    assert level_of([1.0, 1.1]) == 0.0                   # two: too few to tell
    assert level_of([1.0, 1.0, 1.0]) == 0.0
    got = level_of([0.9, 1.0, 1.1])
    assert got == pytest.approx(np.std(np.log([0.9, 1.0, 1.1]), ddof=1))
    assert level_of([1.8, 2.0, 2.2]) == pytest.approx(got)     # scale-free
    with pytest.raises(ValueError):
        level_of([1.0, 0.0, 1.0])


def test_simulation_with_noise_keeps_the_work_and_spreads_the_times() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512,
                          block_size=4, num_blocks=256)
    convs = [[TokenTurn(tuple(range(1000 + 20 * i, 1020 + 20 * i)), 30)] for i in range(24)]
    plain = calibrated_profile("plain", linear_cost(0.01, 1e-4), {}, {})
    noisy = calibrated_profile("noisy", plain.cost, {}, {"noise": StepNoise(
        0.05, 0.1, 1.0).to_json()})
    assert plain.step_noise is None and noisy.step_noise == StepNoise(0.05, 0.1, 1.0)
    assert profile_from_json(noisy.to_json()).step_noise == noisy.step_noise
    base = simulate(convs, plain, ClusterSpec(1), 4.0, 1.0, 3, None, cfg)
    quiet = simulate(convs, noisy, ClusterSpec(1), 4.0, 1.0, 3, None, cfg, noise=False)
    one = simulate(convs, noisy, ClusterSpec(1), 4.0, 1.0, 3, None, cfg, noise_seed=1)
    again = simulate(convs, noisy, ClusterSpec(1), 4.0, 1.0, 3, None, cfg, noise_seed=1)
    other = simulate(convs, noisy, ClusterSpec(1), 4.0, 1.0, 3, None, cfg, noise_seed=2)
    key = lambda res: [(r.req_id, r.ttft, r.itl) for r in res.records]  # noqa: E731
    assert key(quiet) == key(base)                 # noise off: exactly the cost model
    assert key(one) == key(again) != key(other)    # seeded paths
    for res in (one, other):                       # the same requests and tokens
        assert [(r.req_id, r.output_tokens) for r in res.records] == \
            [(r.req_id, r.output_tokens) for r in base.records]
        assert key(res) != key(base)
    # mean 1: the same work takes about as long in all (a drift of 0.1 over ~1 s stretches)
    busy = lambda res: res.instances[0]["busy_s"]  # noqa: E731
    for res in (one, other):
        assert busy(res) / busy(base) == pytest.approx(1.0, abs=0.1)
