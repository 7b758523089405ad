"""Goodput-first scheduling: SLO targets and the slack of each request decide how much
prompt work a step carries (pure arithmetic, no torch, no clock: `now` is passed in).

Goodput is the rate of requests that meet both a TTFT and a TPOT target. TPOT is the
mean time per output token after the first: (end - first token) / (outputs - 1). A
stream that has produced k tokens since its first one at t1 meets its target after its
next token, due at now + x, while

    (now + x - t1) / k <= tpot      i.e.   x <= tpot + banked,
    banked = tpot x (k - 1) - (now - t1)

`banked` is the stream's slack: how far it runs ahead of a reader who reads one token
per `tpot` (0 for a stream whose first token just came; it grows by tpot - step with
every step shorter than tpot). A step may take what keeps every running stream within
its target. Spent all at once the slack would make one long gap; spread over the N steps
that a waiting prompt's prefill takes, each step may take

    T(N) = min over running decodes i of (tpot_i + banked_i / N)

and the prompt's prefill takes the least N with N x chunk(T(N)) >= its remaining tokens,
chunk(T) being the most prompt tokens beside the D decodes whose step the step-time
model prices within T (StepBudget.token_budget). The step's budget is the larger of that
and StepBudget's own (its target of STEP_FACTOR x the decode-only step, its floors): the
policy only ever widens steps, by the streams' slack, so under heavy load, where the
streams have none, the budget protects TPOT exactly as StepBudget does. No step is
planned longer than STEP_TTFT_SHARE of the TTFT target, since a request that arrives
during a step waits for its end. Every target is planned at SLO_MARGIN of its value,
a margin for the step-time model's error.

Admission: a waiting request is admitted beside running ones only while the decode-only
step of all of them (it included) stays within the server's TPOT target (planned at the
margin): past that every stream misses TPOT, so admitting more lowers goodput. Waiting
requests are ordered by TTFT deadline (arrival + target; with one target for all, that
is arrival order). Per-request targets (SamplingParams.slo_ttft_ms / slo_tpot_ms) may
only relax the server's (validated by the engine): a looser TPOT gives its slack to
others, a looser TTFT lets others go first; neither lets one request take the others'.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from duetserve.core.step_budget import StepBudget
from duetserve.request import Request

SLO_MARGIN = 0.9          # plan against this fraction of every target (model error)
STEP_TTFT_SHARE = 0.5     # no planned step longer than this share of the TTFT target
TARGET_QUANTUM_MS = 0.1   # step targets are rounded down to this before pricing
MAX_MEMO = 65536          # remembered (decodes, target) -> chunk answers


@dataclass(frozen=True)
class SloTargets:
    """The server's targets in seconds (EngineConfig.slo_ttft_ms / slo_tpot_ms)."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0, got ttft {self.ttft_s} s, tpot "
                             f"{self.tpot_s} s")


class SloPolicy:
    """The goodput-first step budget, admission check and waiting order (module
    docstring). Mutates only its memo of chunk sizes (the step-time model is frozen)."""

    __slots__ = ("budget", "targets", "margin", "ttft_share", "_chunks")

    def __init__(self, budget: StepBudget, targets: SloTargets, margin: float = SLO_MARGIN,
                 ttft_share: float = STEP_TTFT_SHARE) -> None:
        self.budget = budget
        self.targets = targets
        self.margin = margin
        self.ttft_share = ttft_share
        self._chunks: dict[tuple[int, int], int] = {}

    def _key(self) -> tuple:
        return (self.budget, self.targets, self.margin, self.ttft_share)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SloPolicy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"SloPolicy(ttft {self.targets.ttft_s * 1e3:g} ms, tpot "
                f"{self.targets.tpot_s * 1e3:g} ms, margin {self.margin})")

    # -- a request's targets ------------------------------------------------------------
    def tpot_s(self, request: Request) -> float:
        """The request's TPOT target in seconds (its own, else the server's)."""
        own = request.sampling_params.slo_tpot_ms
        return self.targets.tpot_s if own is None else own / 1e3

    def ttft_s(self, request: Request) -> float:
        """The request's TTFT target in seconds (its own, else the server's)."""
        own = request.sampling_params.slo_ttft_ms
        return self.targets.ttft_s if own is None else own / 1e3

    def deadline(self, request: Request) -> float:
        """When the request's first token is due (its waiting order)."""
        return request.arrival_time + self.ttft_s(request)

    def banked_s(self, request: Request, now: float) -> float:
        """Seconds the stream runs ahead of its planned TPOT before its next token (module
        docstring; 0 before its TPOT clock started)."""
        if request.slo_anchor_time is None:
            return 0.0
        gaps = request.num_output_tokens - request.slo_anchor_tokens
        return self.margin * self.tpot_s(request) * gaps - (now - request.slo_anchor_time)

    # -- the step ------------------------------------------------------------------------
    def cap_ms(self) -> float:
        """The longest step planned (STEP_TTFT_SHARE of the server's TTFT target)."""
        return 1e3 * self.ttft_share * self.targets.ttft_s

    def step_ms(self, now: float, decodes: Sequence[Request], num_steps: int) -> float:
        """T(N) of the module docstring for N = `num_steps`, in ms, at most cap_ms()."""
        t = min(self.margin * self.tpot_s(r) + self.banked_s(r, now) / num_steps
                for r in decodes)
        return min(1e3 * t, self.cap_ms())

    def chunk_tokens(self, num_decodes: int, target_ms: float) -> int:
        """Most prompt tokens beside `num_decodes` decodes in a step priced within
        `target_ms` (rounded down to TARGET_QUANTUM_MS); 0 when none fit. Remembered."""
        q = math.floor(target_ms / TARGET_QUANTUM_MS + 1e-9)
        if q <= 0:
            return 0
        key = (num_decodes, q)
        value = self._chunks.get(key)
        if value is None:
            if len(self._chunks) >= MAX_MEMO:
                self._chunks.clear()
            value = self._chunks[key] = self.budget.token_budget(
                num_decodes, q * TARGET_QUANTUM_MS) - num_decodes
        return value

    def plan(self, now: float, decodes: Sequence[Request], num_prompt_tokens: int
             ) -> tuple[int, float]:
        """(N, T(N) in ms): the fewest steps N (at most num_prompt_tokens) whose steps of
        T(N) carry `num_prompt_tokens` prompt tokens beside `decodes` (binary search:
        N x chunk(T(N)) grows with N), or N = num_prompt_tokens when none do."""
        d = len(decodes)

        def enough(n: int) -> bool:
            return n * self.chunk_tokens(d, self.step_ms(now, decodes, n)) \
                >= num_prompt_tokens
        lo, hi = 1, max(1, num_prompt_tokens)
        if not enough(hi):
            return hi, self.step_ms(now, decodes, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if enough(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo, self.step_ms(now, decodes, lo)

    def token_budget(self, now: float, decodes: Sequence[Request], num_prompt_tokens: int
                     ) -> int:
        """The step's token budget by slack: D + chunk(T(N)) for the plan of the prompt
        next in line (`num_prompt_tokens` left to compute) beside the running `decodes`
        (D >= 1); D when no prompt token fits. The scheduler takes the larger of this
        and StepBudget.for_step. Mutates only the memo."""
        _, target_ms = self.plan(now, decodes, num_prompt_tokens)
        return len(decodes) + self.chunk_tokens(len(decodes), target_ms)

    # -- admission -----------------------------------------------------------------------
    def admits(self, num_running: int) -> bool:
        """Whether one more request may join `num_running` running ones: always beside
        none, else while the decode-only step of num_running + 1 streams is priced within
        the server's TPOT target at the margin."""
        if num_running == 0:
            return True
        return self.budget.decode_ms(num_running + 1) <= \
            1e3 * self.margin * self.targets.tpot_s

    def describe(self) -> str:
        """The policy as reported at start-up (and by the simulator)."""
        most = 1
        while most < 1024 and self.admits(most):
            most += 1
        return (f"goodput-first (SLO TTFT {self.targets.ttft_s * 1e3:g} ms, TPOT "
                f"{self.targets.tpot_s * 1e3:g} ms, planned at {self.margin:g}): steps "
                f"widened by the streams' TPOT slack up to {self.cap_ms():.0f} ms; a fresh "
                f"stream allows {self.chunk_tokens(1, 1e3 * self.margin * self.targets.tpot_s)}"
                f" prompt tokens a step beside it; admission stops at {most} running "
                "streams (their decode-only step within TPOT)")


def slo_policy_for(budget: StepBudget | None, scheduling_policy: str, slo_ttft_ms: float,
                   slo_tpot_ms: float) -> SloPolicy | None:
    """The engine's rule (EngineCore and the simulator's profiles both call it): an
    SloPolicy for scheduling_policy "slo" over a derived StepBudget, else None (a fixed
    budget has no step-time model to plan with)."""
    if scheduling_policy != "slo" or budget is None:
        return None
    return SloPolicy(budget, SloTargets(slo_ttft_ms / 1e3, slo_tpot_ms / 1e3))
