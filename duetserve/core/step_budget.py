"""Token budget per step from a target step time (pure arithmetic, no torch).

A step's time is modelled as `fixed_ms + per_token_ms * num_tokens`, fitted from two
measured prefill steps at start-up (engine/step_cost.py). Running streams get one token
per step, so the step time IS their inter-token gap. A long prompt admitted with a large
budget makes one step (one gap) as long as its whole chunk; a budget derived from a
target step time cuts the prompt into chunks that keep every gap near that target:

    budget = floor((max_step_ms - fixed_ms) / per_token_ms), rounded down to a multiple
             of 16 and clamped to [MIN_BUDGET, MAX_BUDGET]

The default target is STEP_FACTOR x the time of a small decode-only step
(fixed + DECODE_REF_TOKENS tokens): a step that also carries a prefill chunk then takes
at most that factor times a plain decode step, so a stream's gaps stay within about
that factor of their median while a long prompt is prefilled. The price is TTFT: the
long prompt needs more (shorter) steps.

The gap only matters to streams that are decoding, and a decode step of D streams costs
more than one of 16, so `StepBudget` re-derives the budget every step from the number D
of running decodes: no decodes -> IDLE_BUDGET (prompts prefill in big, efficient chunks);
otherwise the budget whose step fits STEP_FACTOR x a decode step of max(D, 16) streams
(or the fixed `--max-step-ms` target when one was given). At saturation (many decodes)
the budget therefore grows with D, so admitting new prompts is not starved, while each
stream's gap stays within the factor of its decode-only step.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_BUDGET = 64           # below this, step overhead dominates and decodes of many streams
MAX_BUDGET = 8192         # cannot fit in one step
STEP_FACTOR = 1.5         # default target: this many times a small decode step
DECODE_REF_TOKENS = 16    # "a small decode step": this many running streams
IDLE_BUDGET = 2048        # budget of a step with no running decode (nobody's gap to protect)
FALLBACK_TOKEN_BUDGET = 512   # fixed budget when the measured cost is implausible (noise)


@dataclass(frozen=True)
class StepCost:
    """Measured step-time model: t(num_tokens) = fixed_ms + per_token_ms * num_tokens."""

    fixed_ms: float
    per_token_ms: float

    def step_ms(self, num_tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * num_tokens

    @classmethod
    def fit(cls, n1: int, ms1: float, n2: int, ms2: float) -> "StepCost":
        """Line through two measured steps (n1 < n2 tokens). The slope is kept positive
        and the intercept non-negative, so noise cannot produce a nonsense model."""
        per_token = max((ms2 - ms1) / (n2 - n1), 1e-6)
        fixed = max(ms1 - per_token * n1, 0.0)
        return cls(fixed, per_token)


def is_plausible(cost: StepCost) -> bool:
    """A larger step must cost more: a flat or inverted fit means the machine was too
    noisy while measuring (such a fit is neither used as is nor cached)."""
    return cost.per_token_ms > 1e-4


def default_max_step_ms(cost: StepCost) -> float:
    """The default step-time target: STEP_FACTOR x a decode step of DECODE_REF_TOKENS."""
    return STEP_FACTOR * cost.step_ms(DECODE_REF_TOKENS)


def token_budget(cost: StepCost, max_step_ms: float, lo: int = MIN_BUDGET,
                 hi: int = MAX_BUDGET) -> int:
    """Largest multiple of 16 tokens whose modelled step time fits max_step_ms, clamped
    to [lo, hi] (lo wins when the target is below what `lo` tokens cost)."""
    room = (max_step_ms - cost.fixed_ms) / cost.per_token_ms
    budget = int(room) // 16 * 16
    return max(lo, min(hi, budget))


@dataclass(frozen=True)
class StepBudget:
    """The per-step token budget from the measured cost (see the module docstring).
    `max_step_ms` None: the target follows the decode count; else it is fixed."""

    cost: StepCost
    max_step_ms: float | None = None
    lo: int = MIN_BUDGET
    idle: int = IDLE_BUDGET

    def for_step(self, num_decodes: int) -> int:
        """Token budget of a step whose running requests include `num_decodes` decodes."""
        if num_decodes == 0:
            return self.idle
        target = self.max_step_ms if self.max_step_ms is not None else \
            STEP_FACTOR * self.cost.step_ms(max(num_decodes, DECODE_REF_TOKENS))
        return token_budget(self.cost, target, lo=self.lo, hi=self.idle)


def derive_step_budget(cost: StepCost, max_step_ms: float | None, max_num_seqs: int
                       ) -> tuple[int, "StepBudget | None"]:
    """What an engine without an explicit --max-num-batched-tokens schedules with, given
    its measured step cost: (largest budget any step gets, the per-step StepBudget).
    An implausible cost gives the fixed FALLBACK_TOKEN_BUDGET and no StepBudget.
    EngineCore and the simulator's profiles (sim/profile.py) both call this, so a
    simulated instance budgets its steps exactly as the engine it models."""
    if not is_plausible(cost):
        return FALLBACK_TOKEN_BUDGET, None
    policy = StepBudget(cost, max_step_ms, lo=min(MIN_BUDGET, max_num_seqs))
    return policy.idle, policy
