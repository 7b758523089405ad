"""`duet plan`: search deployments for the highest goodput per GPU under SLOs.

DistServe's measure: a deployment's goodput is the highest request rate at which the SLO
attainment holds, i.e. at least `attainment` (e.g. 90%) of requests meet both the TTFT and
the TPOT SLO (bench_metrics.meets_slo); per GPU, divided by the GPUs it uses. The search
covers

    colocated      N instances x chunk size (the scheduler's token budget per step)
    disaggregated  xPyD: x prefill + y decode instances, KV moved over the link

and finds each candidate's highest rate by doubling then bisecting (attainment is taken to
fall with the rate). Every evaluation is one simulation of the same workload (same
conversations; the arrival schedule of the seed, scaled to the rate).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from duetserve.bench.bench_metrics import meets_slo, stats_ms
from duetserve.bench.token_workload import TokenConversation
from duetserve.config import SchedulerConfig
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.profile import SimProfile
from duetserve.sim.run import simulate


@dataclass(frozen=True)
class Candidate:
    """One deployment: a cluster and the token budget of its (prefill or colocated) steps."""

    cluster: ClusterSpec
    chunk: int

    @property
    def name(self) -> str:
        if self.cluster.disaggregated:
            return f"{self.cluster.num_prefill}P{self.cluster.num_decode}D"
        return f"{self.cluster.num_instances}x chunk {self.chunk}"

    @property
    def mode(self) -> str:
        return "disaggregated" if self.cluster.disaggregated else "colocated"


@dataclass
class Evaluation:
    rate: float
    attainment: float
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None


@dataclass
class CandidateResult:
    candidate: Candidate
    max_rate: float                       # req/s at which attainment still holds (0: never)
    evaluations: list[Evaluation] = field(default_factory=list)

    @property
    def goodput_per_gpu(self) -> float:
        return self.max_rate / self.candidate.cluster.num_gpus

    def at_max(self) -> Evaluation | None:
        ok = [e for e in self.evaluations if e.rate == self.max_rate]
        return ok[0] if ok else None


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float
    attainment: float = 0.9               # fraction of requests that must meet both

    def as_dict(self) -> dict[str, float]:
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms}


class Planner:
    """Evaluates candidates on one workload and profile. Mutates nothing but its cache."""

    def __init__(self, convs: list[TokenConversation], profile: SimProfile, slo: SLO,
                 seed: int = 0, burstiness: float = 1.0, rel_tol: float = 0.03,
                 progress: Callable[[str], None] | None = None) -> None:
        self.convs, self.profile, self.slo = convs, profile, slo
        self.seed, self.burstiness, self.rel_tol = seed, burstiness, rel_tol
        self.progress = progress
        self.base = profile.scheduler_config()

    def config_for(self, cand: Candidate) -> SchedulerConfig:
        """The candidate's chunk size as a fixed budget (no StepBudget), as the engine's
        explicit --max-num-batched-tokens is."""
        return replace(self.base, max_num_batched_tokens=cand.chunk, step_budget=None)

    def evaluate(self, cand: Candidate, rate: float) -> Evaluation:
        result = simulate(self.convs, self.profile, cand.cluster, rate, self.burstiness,
                          self.seed, None, self.config_for(cand))
        recs = result.records
        good = sum(meets_slo(r, self.slo.as_dict()) for r in recs)
        ok = [r for r in recs if r.success]
        ttft = stats_ms([r.ttft for r in ok if r.ttft is not None], [90])["p90"]
        tpot = stats_ms([r.tpot for r in ok if r.tpot is not None], [90])["p90"]
        ev = Evaluation(rate, good / max(1, len(recs)), ttft, tpot)
        if self.progress is not None:
            self.progress(f"{cand.name:>16} @ {rate:8.3f} req/s: attainment {ev.attainment:.3f}")
        return ev

    def max_rate(self, cand: Candidate, start: float = 1.0) -> CandidateResult:
        """Double (or halve) from `start` until attainment flips, then bisect to rel_tol."""
        res = CandidateResult(cand, 0.0)

        def holds(rate: float) -> bool:
            ev = self.evaluate(cand, rate)
            res.evaluations.append(ev)
            return ev.attainment >= self.slo.attainment

        lo, hi = 0.0, start
        while holds(hi):
            lo, hi = hi, hi * 2
            if hi > 1e5:
                break
        if lo == 0.0:
            hi_fail = hi
            while hi_fail > start / 256:
                hi_fail /= 2
                if holds(hi_fail):
                    lo, hi = hi_fail, hi_fail * 2
                    break
            else:
                return res                               # not even a trickle holds
        while hi / lo > 1 + self.rel_tol:
            mid = (lo * hi) ** 0.5
            if holds(mid):
                lo = mid
            else:
                hi = mid
        res.max_rate = lo
        return res

    def attainment_curve(self, cand: Candidate, rates: list[float]) -> list[Evaluation]:
        return [self.evaluate(cand, r) for r in rates]


def candidates(max_gpus: int, colocated_instances: list[int], chunks: list[int],
               prefill_chunk: int, base: ClusterSpec) -> list[Candidate]:
    """Colocated N x chunk for N in colocated_instances (<= max_gpus), and every xPyD with
    x + y <= max_gpus."""
    out = [Candidate(replace(base, num_instances=n, num_prefill=0, num_decode=0), c)
           for n in colocated_instances if n <= max_gpus for c in chunks]
    out += [Candidate(replace(base, num_instances=1, num_prefill=p, num_decode=d), prefill_chunk)
            for p in range(1, max_gpus) for d in range(1, max_gpus - p + 1)]
    return out
