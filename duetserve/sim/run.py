"""Run a simulation from a profile and a workload, and report it exactly as
`duet bench serve` reports a measured run (bench_metrics.summarize, the same JSON schema,
so `duet bench plot` overlays simulated and measured runs).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from duetserve.bench.bench_metrics import summarize
from duetserve.bench.token_workload import TokenConversation, arrival_offsets
from duetserve.config import SchedulerConfig
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.profile import SimProfile
from duetserve.sim.simulator import SimResult, Simulation


def decode_instance_config(config: SchedulerConfig) -> SchedulerConfig:
    """A decode instance's scheduler: a fixed token budget (no per-step StepBudget) that
    holds a whole transferred prompt (scheduled as one free slice, see sim/instance.py)
    plus a decode per sequence. The slice is a simulation device standing for KV that a
    real decode instance receives rather than schedules, so no budget may chunk it."""
    budget = max(config.max_num_batched_tokens, config.max_model_len + config.max_num_seqs)
    return replace(config, max_num_batched_tokens=budget, step_budget=None)


def kv_bytes_per_token(profile: SimProfile) -> float:
    """KV bytes per token the profile's model moves in a P/D transfer."""
    value = getattr(profile.step_time, "kv_bytes_per_token", None)
    return float(value if value is not None else profile.meta.get("kv_bytes_per_token", 0.0))


def simulate(convs: list[TokenConversation], profile: SimProfile, cluster: ClusterSpec,
             rate: float, burstiness: float = 1.0, seed: int = 0,
             max_concurrency: int | None = None, config: SchedulerConfig | None = None,
             id_range: tuple[int, int] = (1000, 40000)) -> SimResult:
    """Simulate `convs` arriving at `rate` (the bench generator's schedule for `seed`),
    each step priced by the profile's step-time model."""
    config = config or profile.scheduler_config()
    if cluster.disaggregated and not cluster.kv_bytes_per_token:
        cluster = replace(cluster, kv_bytes_per_token=kv_bytes_per_token(profile))
    offsets = arrival_offsets(len(convs), rate, burstiness, seed)
    sim = Simulation(convs, offsets.tolist(), cluster, config, profile.step_time,
                     max_concurrency, id_range, decode_instance_config(config),
                     profile.arrival_s)
    return sim.run()


def run_json(result: SimResult, rate: float | str, burstiness: float,
             max_concurrency: int | None, percentiles: list[float],
             slo_ms: dict[str, float]) -> dict[str, Any]:
    """One entry of the results document's "runs" (bench serve's shape plus "sim")."""
    summary = summarize(result.records, result.duration_s, percentiles, slo_ms)
    return {"request_rate": rate, "burstiness": burstiness, "max_concurrency": max_concurrency,
            "summary": summary, "requests": [r.to_json() for r in result.records],
            "sim": {"wall_s": result.wall_s, "instances": result.instances,
                    "kv_transfer": result.kv_transfer}}
