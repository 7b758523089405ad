"""A simulated instance schedules as the engine it models: the profile carries what the
engine derived its per-step token budget from (its measured step cost, max_step_ms), and
SimProfile.scheduler_config rebuilds the SchedulerConfig through the engine's own
core.step_budget.derive_step_budget. The step cost is fixed here (the start-up
measurement is replaced), so the derivation, not the machine, is what is compared."""
from __future__ import annotations

from dataclasses import replace

import pytest

from duetserve.config import ConfigError, EngineConfig
from duetserve.core.step_budget import FALLBACK_TOKEN_BUDGET, StepBudget, StepCost
from duetserve.engine import engine_core
from duetserve.engine.engine_core import EngineCore
from duetserve.entrypoints.sim_calibrate import served_scheduler_settings
from duetserve.sim.cost import FEATURES, CalibratedCost
from duetserve.sim.gpu import Efficiency
from duetserve.sim.plan import SLO, Candidate, Planner
from duetserve.sim.profile import calibrated_profile, load_profile, roofline_profile
from duetserve.sim.run import decode_instance_config
from duetserve.sim.cluster import ClusterSpec

COST = CalibratedCost(tuple([0.001] + [0.0] * (len(FEATURES) - 1)), 4)


@pytest.fixture
def tiny_engine(tiny_checkpoints, monkeypatch):
    """EngineCore(**kw) on the tiny model whose start-up step measurement returns `cost`."""
    path = tiny_checkpoints["llama-gqa-untied"]

    def build(cost: StepCost, **kw) -> EngineCore:
        monkeypatch.setattr(engine_core, "measured_step_cost", lambda *a, **k: (cost, True))
        return EngineCore(EngineConfig(model=path, num_threads=1, kv_cache_memory=0.05, **kw))
    return build


def saved(engine: EngineCore, tmp_path):
    prof = calibrated_profile("t", COST, served_scheduler_settings(engine), {})
    return load_profile(prof.save(tmp_path / "p.json"))


def test_profile_rebuilds_the_engines_scheduler_config(tiny_engine, tmp_path) -> None:
    cost = StepCost(fixed_ms=20.0, per_token_ms=0.25)
    engine = tiny_engine(cost, max_num_seqs=32)
    cfg = engine.scheduler.config
    assert cfg.step_budget == StepBudget(cost, None)
    profile = saved(engine, tmp_path)
    # everything the scheduler reads; the waiting cap is enforced by EngineCore.add_request,
    # outside the scheduler, and is not simulated
    assert profile.scheduler_config() == replace(cfg, max_num_waiting=0)
    # --max-step-ms: a fixed target, in the engine and in the simulator alike
    fixed_target = tiny_engine(cost, max_num_seqs=32, max_step_ms=100.0).scheduler.config
    assert profile.scheduler_config(max_step_ms=100.0) == replace(fixed_target,
                                                                  max_num_waiting=0)
    assert fixed_target.step_budget.for_step(5) == 320
    # --max-num-batched-tokens: a fixed budget, no per-step policy
    explicit = tiny_engine(cost, max_num_seqs=32, max_num_batched_tokens=256).scheduler.config
    assert explicit.step_budget is None
    assert profile.scheduler_config(max_num_batched_tokens=256) == replace(explicit,
                                                                           max_num_waiting=0)


def test_an_implausible_step_cost_falls_back_to_the_fixed_budget(tiny_engine, tmp_path) -> None:
    engine = tiny_engine(StepCost(fixed_ms=5.0, per_token_ms=1e-6))
    cfg = engine.scheduler.config
    assert cfg.step_budget is None and cfg.max_num_batched_tokens == FALLBACK_TOKEN_BUDGET
    assert saved(engine, tmp_path).scheduler_config() == replace(cfg, max_num_waiting=0)


def test_fixed_budgets_where_the_simulation_sets_them(tmp_path) -> None:
    settings = {"max_num_batched_tokens": 2048, "max_num_seqs": 64, "num_blocks": 100,
                "block_size": 16, "max_model_len": 4096, "enable_prefix_caching": True,
                "step_cost": {"fixed_ms": 20.0, "per_token_ms": 0.25}, "max_step_ms": None}
    profile = calibrated_profile("t", COST, settings, {})
    base = profile.scheduler_config()
    assert base.step_budget is not None
    # a decode instance: one fixed budget holding a whole transferred prompt
    dec = decode_instance_config(base)
    assert dec.step_budget is None and dec.max_num_batched_tokens == 4096 + 64
    # duet plan's chunk sizes are fixed budgets
    planner = Planner([], profile, SLO(100, 10))
    cand = planner.config_for(Candidate(ClusterSpec(1), 512))
    assert cand.step_budget is None and cand.max_num_batched_tokens == 512
    # a GPU profile has no measured step cost: a fixed budget, and no step-time target
    gpu = roofline_profile("llama-3-8b", "h100-sxm", Efficiency())
    assert gpu.scheduler_config().step_budget is None
    with pytest.raises(ConfigError, match="max_step_ms needs"):
        gpu.scheduler_config(max_step_ms=50.0)
    with pytest.raises(ConfigError, match="bad step_cost"):
        calibrated_profile("t", COST, {**settings, "step_cost": {"fixed": 1}},
                           {}).scheduler_config()
