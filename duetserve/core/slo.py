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
every step shorter than tpot). Spread over the N steps of a prompt's prefill, the
streams allow each of those steps

    T(N) = min over running decodes i of (tpot_i + banked_i / N)

The prompt next in line (the oldest running prefill, else the first waiting request) is
planned over prefills of N steps of c = ceil(remaining / N) tokens (N = 1, 2, ... fewer
than StepBudget's chunks, its budget this step and the floor, need), each step priced by
the step-time model within T(N). Two plans are taken, and the larger chunk wins:

- Light load: steps of at most LIGHT_STEP_SHARE of the TPOT target: the largest chunk
  whose step fits, the prompt spread evenly over the steps it then needs. Beside one or
  two streams StepBudget's target (1.5x their decode step) gives a prompt a handful of
  tokens a step (SmolLM2 on 2 cores: 6 tokens in 5 ms steps, so a 200-token prompt waits
  30 steps); with TPOT far under target the prompt prefills in a few larger chunks
  instead. A stream's mean TPOT hardly moves (the prompt's rows cost the same time in
  any chunking, and fewer steps save their overhead); its longest gap grows to the step
  (a pinned `--max-step-ms` bounds the light steps too).
- Deadline: `left` = the prompt's TTFT target minus the time it has waited. If the
  floor's chunks end its prefill within `left`, none. Else the plan that meets the
  deadline with the most steps (the least slack spent), or, when none does (a prompt
  past its deadline included), the one that ends the prefill soonest (a late first token
  is still better early than later: an overloaded server that kept the slack for the
  streams let the queue's first tokens wait 1.5-2x longer, 1.5B at 1 req/s on 2 cores).

Spending slack beyond the light steps is not free: slower streams live longer, so more
of them run at once (Little's law), and every step of a larger batch costs more; with a
cliff in step time (the few-row kernels' limit) that lowers capacity and raises
everyone's TTFT; so longer steps are taken only for a deadline. The budget is widened to
D + c. Under heavy load the streams have no slack (and their decode step alone nears the
light steps), no plan fits, and the budget protects TPOT exactly as StepBudget does. No
step is planned longer than STEP_TTFT_SHARE of the TTFT target (a request that arrives
during a step waits for its end), and every target is planned at SLO_MARGIN of its
value, a margin for the step-time model's error.

Admission: a waiting request is admitted beside running ones only while the decode-only
step of all of them (it included) stays within the server's TPOT target (planned at the
margin): past that every stream misses TPOT, so admitting more lowers goodput. Once the
request first in line has waited LATE_SHARE of its TTFT target, TTFT is the target at
risk and the streams' TPOT is the slack to spend: admission then runs on while the
decode-only step stays within OVERLOAD_TPOT times the TPOT target (3 x 100 ms by default:
about 3 tokens/s, the slowest a reader follows). Without it an overloaded server keeps a
few fast streams and lets the queue's first tokens wait for whole conversations to end
(1.5B on 2 cores: 4 streams, TTFT p50 above llama-server's at 1 req/s); with no bound
(FCFS) TPOT grows with the queue. Waiting
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
STEP_COUNT_GROWTH = 1.25  # prefill plans tried: 1, 2, 3, ... steps, then x1.25 apart
LIGHT_STEP_SHARE = 0.3    # light load: a prompt's steps up to this share of the TPOT target
LATE_SHARE = 0.5          # a request first in line this far into its TTFT target is late
OVERLOAD_TPOT = 3.0       # admission for a late request: decode steps within this x TPOT


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
    docstring). Immutable after construction (the step-time model is frozen)."""

    __slots__ = ("budget", "targets", "margin", "ttft_share")

    def __init__(self, budget: StepBudget, targets: SloTargets, margin: float = SLO_MARGIN,
                 ttft_share: float = STEP_TTFT_SHARE) -> None:
        self.budget = budget
        self.targets = targets
        self.margin = margin
        self.ttft_share = ttft_share

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
        return self._allowance(self._slack(now, decodes), num_steps)

    def _slack(self, now: float, decodes: Sequence[Request]) -> list[tuple[float, float]]:
        """(planned TPOT, least banked slack) per distinct planned TPOT of `decodes`, in
        seconds: all T(N) needs (a + b / N is least at the least b for each a)."""
        least: dict[float, float] = {}
        for r in decodes:
            a, b = self.margin * self.tpot_s(r), self.banked_s(r, now)
            if b < least.get(a, math.inf):
                least[a] = b
        return list(least.items())

    def _allowance(self, slack: list[tuple[float, float]], num_steps: int) -> float:
        return min(1e3 * min(a + b / num_steps for a, b in slack), self.cap_ms())

    def light_ms(self) -> float:
        """The longest step a light-load plan takes (LIGHT_STEP_SHARE of the server's
        TPOT target at the margin; at most a pinned --max-step-ms), in ms."""
        light = 1e3 * LIGHT_STEP_SHARE * self.margin * self.targets.tpot_s
        pinned = self.budget.max_step_ms
        return light if pinned is None else min(light, pinned)

    def plan(self, now: float, decodes: Sequence[Request], prompt: Request, floor: int
             ) -> tuple[int, int]:
        """(N, chunk): the prefill plan of `prompt` (next in line) beside the running
        `decodes` (module docstring). `floor`: StepBudget's budget this step. Among the
        plans of N steps of ceil(remaining / N) tokens (N fewer than StepBudget's plan
        needs) whose step fits the streams' slack: the light plan (`_light_plan`, steps
        of at most light_ms()); and, only when StepBudget's chunks would miss the
        prompt's TTFT target, the deadline plan: the one that meets it with the
        most steps, or, when none does (or it has passed), the one that ends the prefill
        soonest. Returns the one of the two with the larger chunk; (0, 0) when neither
        beats StepBudget's chunks or the prompt has output already (preempted: no TTFT
        to meet). Mutates nothing."""
        d, start = len(decodes), prompt.num_computed_tokens
        num_left = prompt.num_tokens - start
        if prompt.num_output_tokens or num_left <= 1:
            return 0, 0
        left_ms = 1e3 * (self.margin * self.ttft_s(prompt) - (now - prompt.arrival_time))
        c0 = max(1, floor - d)
        n0 = -(-num_left // c0)
        floor_ms = n0 * self.budget.step_ms(d, min(c0, num_left), start)
        slack = self._slack(now, decodes)
        light = self._light_plan(d, start, num_left, slack, floor_ms)
        if floor_ms <= left_ms:
            return light
        meets, soonest = (0, 0), (math.inf, 0, 0)
        for n in _step_counts(n0 - 1):
            c = -(-num_left // n)
            t = self.budget.step_ms(d, c, start)
            if t > self._allowance(slack, n):
                continue                        # beyond what the streams' slack allows
            if n * t <= left_ms:
                meets = max(meets, (n, c))
            soonest = min(soonest, (n * t, n, c))
        deadline = meets if meets[0] else soonest[1:]
        return max(deadline, light, key=lambda plan: plan[1])

    def _light_plan(self, d: int, start: int, num_left: int,
                    slack: list[tuple[float, float]], floor_ms: float) -> tuple[int, int]:
        """(N, chunk) of the light plan (`plan`): the largest chunk whose step fits
        light_ms(), spread evenly over the N steps the prompt then needs; (0, 0) when
        that plan's step is beyond the streams' slack or it ends no sooner than
        StepBudget's chunks (`floor_ms` in all)."""
        most = self.budget.chunk_within(d, start, self.light_ms(), num_left)
        if not most:
            return 0, 0
        n = -(-num_left // most)
        c = -(-num_left // n)
        t = self.budget.step_ms(d, c, start)
        if t > self._allowance(slack, n) or n * t >= floor_ms:
            return 0, 0
        return n, c

    def token_budget(self, now: float, decodes: Sequence[Request], prompt: Request,
                     floor: int) -> int:
        """The step's token budget: StepBudget's `floor`, or wider by the plan (`plan`)
        of the prompt next in line: D + its chunk's charge (its rows, plus its attention
        over cached tokens in rows' worth, StepBudget.chunk_cost). Mutates nothing."""
        n, chunk = self.plan(now, decodes, prompt, floor)
        if not n:
            return floor
        rows = len(decodes) + chunk
        return max(floor, len(decodes) + self.budget.chunk_cost(
            chunk, prompt.num_computed_tokens, rows))

    # -- admission -----------------------------------------------------------------------
    def admits(self, num_running: int, head: Request | None = None,
               now: float | None = None) -> bool:
        """Whether one more request (`head`, first in line, when given with the time) may
        join `num_running` running ones: always beside none, else while the decode-only
        step of num_running + 1 streams is priced within the server's TPOT target at the
        margin, or within OVERLOAD_TPOT times that once `head` is late (module
        docstring)."""
        if num_running == 0:
            return True
        late = head is not None and now is not None and \
            now - head.arrival_time >= LATE_SHARE * self.ttft_s(head)
        return self.budget.decode_ms(num_running + 1) <= self._admission_ms(late)

    def _admission_ms(self, late: bool) -> float:
        """The longest decode-only step admission allows, in ms (`admits`)."""
        return 1e3 * self.margin * self.targets.tpot_s * (OVERLOAD_TPOT if late else 1.0)

    def _most_admitted(self, late: bool) -> int:
        most = 1
        while most < 1024 and self.budget.decode_ms(most + 1) <= self._admission_ms(late):
            most += 1
        return most

    def describe(self) -> str:
        """The policy as reported at start-up (and by the simulator)."""
        return (f"goodput-first (SLO TTFT {self.targets.ttft_s * 1e3:g} ms, TPOT "
                f"{self.targets.tpot_s * 1e3:g} ms, planned at {self.margin:g}): steps "
                f"widened within the streams' TPOT slack for the prompt next in line, to "
                f"{self.light_ms():.0f} ms while they have it (light load), up to "
                f"{self.cap_ms():.0f} ms when it would miss its TTFT target; admission stops at "
                f"{self._most_admitted(False)} running streams (their decode-only step "
                f"within TPOT), at {self._most_admitted(True)} while the request first in "
                f"line has waited {LATE_SHARE:g} of its TTFT target (within "
                f"{OVERLOAD_TPOT:g}x TPOT)")


def slo_policy_for(budget: StepBudget | None, scheduling_policy: str, slo_ttft_ms: float,
                   slo_tpot_ms: float) -> SloPolicy | None:
    """The engine's rule (EngineCore and the simulator's profiles both call it): an
    SloPolicy for scheduling_policy "slo" over a derived StepBudget, else None (a fixed
    budget has no step-time model to plan with)."""
    if scheduling_policy != "slo" or budget is None:
        return None
    return SloPolicy(budget, SloTargets(slo_ttft_ms / 1e3, slo_tpot_ms / 1e3))


def _step_counts(most: int) -> list[int]:
    """1, 2, ..., 8, then about STEP_COUNT_GROWTH apart, up to `most`: the prefill plans
    `SloPolicy.plan` prices (a few dozen whatever the prompt's length)."""
    counts, n = [], 1
    while n <= most:
        counts.append(n)
        n = n + 1 if n < 8 else max(n + 1, int(n * STEP_COUNT_GROWTH))
    return counts
