"""A simulated instance schedules as the engine it models: the profile carries what the
engine derived its per-step token budget from (its step time, max_step_ms), and
SimProfile.scheduler_config rebuilds the SchedulerConfig through the engine's own
core.step_budget.derive_step_budget. The engine's step time is pinned here
(`--step-time`), so the derivation, not the machine, is what is compared."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from duetserve.config import ConfigError, EngineConfig
from duetserve.core.slo import SloPolicy, SloTargets
from duetserve.core.step_budget import FALLBACK_TOKEN_BUDGET, StepBudget
from duetserve.core.step_time import Layout, StepTime
from duetserve.engine.engine_core import EngineCore
from duetserve.errors import RequestError
from duetserve.sampling_params import SamplingParams
from duetserve.entrypoints.sim_calibrate import served_scheduler_settings
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.gpu import Efficiency
from duetserve.sim.plan import SLO, Candidate, Planner
from duetserve.sim.profile import calibrated_profile, load_profile, roofline_profile
from duetserve.sim.run import decode_instance_config

SIM = StepTime.of(Layout(few_rows=4), few_step=0.001, few_row=1e-4, many_step=0.002,
                  many_row=1e-4)
LINE = StepTime.of(Layout(), many_step=0.020, many_row=0.00025)     # 20 ms + 0.25 ms/row


@pytest.fixture
def tiny_engine(tiny_checkpoints, tmp_path):
    """EngineCore(**kw) on the tiny model, scheduling with `step_time` (nothing measured)."""
    path = tiny_checkpoints["llama-gqa-untied"]

    def build(step_time: StepTime, **kw) -> EngineCore:
        pinned = tmp_path / "step_time.json"
        pinned.write_text(json.dumps(step_time.to_json()))
        return EngineCore(EngineConfig(model=path, num_threads=1, kv_cache_memory=0.05,
                                       step_time=str(pinned), **kw))
    return build


def saved(engine: EngineCore, tmp_path):
    prof = calibrated_profile("t", SIM, served_scheduler_settings(engine), {})
    return load_profile(prof.save(tmp_path / "p.json"))


def test_profile_rebuilds_the_engines_scheduler_config(tiny_engine, tmp_path) -> None:
    engine = tiny_engine(LINE, max_num_seqs=32)
    cfg = engine.scheduler.config
    assert cfg.step_budget == StepBudget(LINE, None)
    assert engine.step_time_source.how == "file"
    profile = saved(engine, tmp_path)
    # everything the scheduler reads; the waiting cap is enforced by EngineCore.add_request,
    # outside the scheduler, and is not simulated
    assert profile.scheduler_config() == replace(cfg, max_num_waiting=0)
    # --max-step-ms: a fixed target, in the engine and in the simulator alike
    fixed_target = tiny_engine(LINE, max_num_seqs=32, max_step_ms=100.0).scheduler.config
    assert profile.scheduler_config(max_step_ms=100.0) == replace(fixed_target,
                                                                  max_num_waiting=0)
    assert fixed_target.step_budget.for_step(5) == 320
    # --max-num-batched-tokens: a fixed budget, no per-step policy
    explicit = tiny_engine(LINE, max_num_seqs=32, max_num_batched_tokens=256).scheduler.config
    assert explicit.step_budget is None
    assert profile.scheduler_config(max_num_batched_tokens=256) == replace(explicit,
                                                                           max_num_waiting=0)


def test_the_scheduling_objective_is_the_engines_in_the_simulator(tiny_engine,
                                                                   tmp_path) -> None:
    """--scheduling-policy and the SLO targets reach the scheduler (core/slo.py) and the
    profile rebuilds the same policy; a request may relax the targets, not tighten them."""
    engine = tiny_engine(LINE, slo_ttft_ms=500.0, slo_tpot_ms=40.0)
    cfg = engine.scheduler.config
    assert cfg.slo == SloPolicy(cfg.step_budget, SloTargets(0.5, 0.04))
    assert "goodput-first" in engine.resolved_config()["resolved"]["scheduling"]
    profile = saved(engine, tmp_path)
    assert profile.scheduler_config() == replace(cfg, max_num_waiting=0)
    assert profile.scheduler_config(scheduling_policy="fcfs").slo is None
    engine.validate_request([1, 2, 3], SamplingParams(slo_ttft_ms=500.0, slo_tpot_ms=1e4))
    with pytest.raises(RequestError, match="at least 40 ms") as e:
        engine.validate_request([1, 2, 3], SamplingParams(slo_tpot_ms=20.0))
    assert e.value.param == "slo_tpot_ms"
    assert tiny_engine(LINE, scheduling_policy="fcfs").scheduler.config.slo is None
    for bad in ({"scheduling_policy": "edf"}, {"slo_ttft_ms": 0.0},
                {"slo_tpot_ms": float("inf")}):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)


def test_an_implausible_step_time_falls_back_to_the_fixed_budget(tiny_engine, tmp_path) -> None:
    engine = tiny_engine(StepTime.of(Layout(), many_step=0.005))        # rows free: noise
    cfg = engine.scheduler.config
    assert cfg.step_budget is None and cfg.max_num_batched_tokens == FALLBACK_TOKEN_BUDGET
    assert saved(engine, tmp_path).scheduler_config() == replace(cfg, max_num_waiting=0)


def test_fixed_budgets_where_the_simulation_sets_them(tmp_path) -> None:
    settings = {"max_num_batched_tokens": 2048, "max_num_seqs": 64, "num_blocks": 100,
                "block_size": 16, "max_model_len": 4096, "enable_prefix_caching": True,
                "step_time": LINE.to_json(), "max_step_ms": None}
    profile = calibrated_profile("t", SIM, settings, {})
    base = profile.scheduler_config()
    assert base.step_budget is not None
    # a decode instance: one fixed budget holding a whole transferred prompt
    dec = decode_instance_config(base)
    assert dec.step_budget is None and dec.max_num_batched_tokens == 4096 + 64
    # duet plan's chunk sizes are fixed budgets
    planner = Planner([], profile, SLO(100, 10))
    cand = planner.config_for(Candidate(ClusterSpec(1), 512))
    assert cand.step_budget is None and cand.max_num_batched_tokens == 512
    # a GPU profile has no engine step time: a fixed budget, and no step-time target
    gpu = roofline_profile("llama-3-8b", "h100-sxm", Efficiency())
    assert gpu.scheduler_config().step_budget is None
    with pytest.raises(ConfigError, match="max_step_ms needs"):
        gpu.scheduler_config(max_step_ms=50.0)
    with pytest.raises(ConfigError, match="bad engine step_time"):
        calibrated_profile("t", SIM, {**settings, "step_time": {"fixed": 1}},
                           {}).scheduler_config()
