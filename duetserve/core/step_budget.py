"""Token budget per step from a target step time (pure arithmetic, no torch).

Running streams get one token per step, so the step time IS their inter-token gap. A long
prompt admitted with a large budget makes one step (one gap) as long as its whole chunk;
a budget derived from a target step time cuts the prompt into chunks that keep every gap
near that target. The step time is modelled from steps measured at start-up
(engine/step_cost.py), as `StepCost`, a function of the step's rows T (tokens) and of the
(query, cached key) pairs P of its prefill chunks (a chunk of c tokens after s cached
tokens attends over them: c * s pairs):

    decode-only step of D <= R streams   decode_fixed_ms + decode_per_seq_ms * D
    other steps of T <= R rows           lowbit_fixed_ms + lowbit_per_token_ms * T + per_pair_ms * P
    any step of T > R rows               fixed_ms + per_token_ms * T + per_pair_ms * P

R is the model's `lowbit_rows`: steps of up to R rows run the low-bit GEMV kernels, larger
ones dense GEMMs (models/quant.py), a cliff in step time (8 decodes + 16 prompt tokens take
twice 8 + 8 on a 2-core CPU). Decode-only steps of up to R rows run the native decoder
stack, cheaper again than the modules. Chunks deep in a long context pay for their
attention over it. (R = 0: one line for every step with prefill work.)

`StepBudget` re-derives the budget every step from the number D of running decodes:

- D = 0: IDLE_BUDGET (nobody's gap to protect: prompts prefill in big, efficient chunks);
- else the step must fit `target = STEP_FACTOR x decode_ms(D)` (or the fixed
  `--max-step-ms`): the largest T with step_ms(T) <= target, but at least D + MIN_CHUNK
  x P for the P requests with prompt tokens to compute, so every prompt makes progress at
  least as fast as a stream (a burst of new requests is not starved by a small target),
  and at least D + `efficient_chunk(D)`: a step that carries prompt tokens beside D decodes
  may cost an overhead F over their decode-only step (where the chunk leaves the native
  decode stack for the per-layer modules: ~3-5 ms beside a 4 ms decode step on a 2-core
  CPU, before short chunks ran as decode rows, worker/batch.py), and a chunk too small
  to amortize F makes prefill so slow that the queue, not the gap, sets everyone's
  latency (the default model at 0.8 chat conversations/s then: 1-2 token chunks, TTFT
  p50 1.4 s and TPOT p50 14 ms, where a fixed 512-token budget gave 112 ms and 8 ms).
  The efficient chunk is the smallest whose own tokens take CHUNK_EFFICIENCY of the step
  time it adds (1 where F <= 0), but never one whose step is modelled above
  MAX_GAP_FACTOR x the decode-only step (the bound on a stream's gap this budget exists
  for). A stream's gap while a prompt is prefilled is then at most STEP_FACTOR x its
  decode-only gap unless that target cannot carry such a chunk, and at most
  MAX_GAP_FACTOR x unless even D + MIN_CHUNK rows cost more.
- A prefill chunk after s cached tokens is charged `c * (1 + s * per_pair / per_token)`
  budget tokens (per_token: the slope of the piece the step's budget lies in), so deep in
  a long context it gets fewer tokens (`max_chunk`), never fewer than MIN_CHUNK.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MIN_CHUNK = 1             # least prefill tokens a step with decodes gives a prompt (progress)
CHUNK_EFFICIENCY = 0.8    # a chunk beside decodes: its tokens' share of the time it adds
MAX_BUDGET = 8192         # cannot fit in one step
STEP_FACTOR = 1.5         # default target: this many times the decode-only step of the D
DECODE_REF_TOKENS = 16    # streams running; reported at start-up for this many streams
MAX_GAP_FACTOR = 2.0      # the efficient-chunk floor's step: at most this x decode-only
IDLE_BUDGET = 2048        # budget of a step with no running decode (nobody's gap to protect)
FALLBACK_TOKEN_BUDGET = 512   # fixed budget when the measured cost is implausible (noise)
ROUND_FROM = 64           # budgets of at least this many tokens are rounded down to 16s


@dataclass(frozen=True)
class StepCost:
    """Measured step-time model (see the module docstring). `decode_fixed_ms` None: no
    decode line (decode-only steps follow the other lines); `lowbit_rows` 0: no low-bit
    piece."""

    fixed_ms: float
    per_token_ms: float
    per_pair_ms: float = 0.0
    decode_fixed_ms: float | None = None
    decode_per_seq_ms: float = 0.0
    lowbit_rows: int = 0
    lowbit_fixed_ms: float = 0.0
    lowbit_per_token_ms: float = 0.0

    def per_token_at(self, num_tokens: int) -> float:
        """The slope of the piece a step of `num_tokens` rows lies in."""
        return self.lowbit_per_token_ms if 0 < num_tokens <= self.lowbit_rows \
            else self.per_token_ms

    def step_ms(self, num_tokens: int, num_pairs: int = 0) -> float:
        """A step with prefill work: `num_tokens` rows, `num_pairs` cached-context pairs."""
        if 0 < num_tokens <= self.lowbit_rows:
            rows_ms = self.lowbit_fixed_ms + self.lowbit_per_token_ms * num_tokens
        else:
            rows_ms = self.fixed_ms + self.per_token_ms * num_tokens
        return rows_ms + self.per_pair_ms * num_pairs

    def decode_ms(self, num_decodes: int) -> float:
        """A decode-only step of `num_decodes` streams."""
        if self.decode_fixed_ms is None or (self.lowbit_rows and
                                            num_decodes > self.lowbit_rows):
            return self.step_ms(num_decodes)
        return self.decode_fixed_ms + self.decode_per_seq_ms * num_decodes

    @staticmethod
    def line(n1: int, ms1: float, n2: int, ms2: float) -> tuple[float, float]:
        """(intercept, slope) through two measured steps (n1 < n2). The slope is kept
        positive and the intercept non-negative, so noise cannot give a nonsense model."""
        slope = max((ms2 - ms1) / (n2 - n1), 1e-6)
        return max(ms1 - slope * n1, 0.0), slope

    @classmethod
    def fit(cls, n1: int, ms1: float, n2: int, ms2: float) -> "StepCost":
        """The general line alone (no context term, no decode line, no low-bit piece)."""
        return cls(*cls.line(n1, ms1, n2, ms2))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "StepCost":
        """Raises KeyError/TypeError/ValueError on a malformed dict."""
        if not isinstance(d, dict):
            raise TypeError(f"a step cost is a dict, got {type(d).__name__}")
        dec = d.get("decode_fixed_ms")
        return cls(float(d["fixed_ms"]), float(d["per_token_ms"]),
                   float(d.get("per_pair_ms", 0.0)), None if dec is None else float(dec),
                   float(d.get("decode_per_seq_ms", 0.0)), int(d.get("lowbit_rows", 0)),
                   float(d.get("lowbit_fixed_ms", 0.0)),
                   float(d.get("lowbit_per_token_ms", 0.0)))


def is_plausible(cost: StepCost) -> bool:
    """A larger step must cost more: a flat or inverted fit means the machine was too
    noisy while measuring (such a fit is neither used as is nor cached)."""
    return cost.per_token_ms > 1e-4


def default_max_step_ms(cost: StepCost, num_decodes: int = DECODE_REF_TOKENS) -> float:
    """The default step-time target with `num_decodes` streams running."""
    return STEP_FACTOR * cost.decode_ms(num_decodes)


def token_budget(cost: StepCost, max_step_ms: float, lo: int = MIN_CHUNK,
                 hi: int = MAX_BUDGET) -> int:
    """Most tokens whose modelled step time fits max_step_ms (rounded down to a multiple
    of 16 from ROUND_FROM up), clamped to [lo, hi] (lo wins when the target is below what
    `lo` tokens cost). Over the low-bit piece and the dense line, the larger fit wins."""
    dense = int(max((max_step_ms - cost.fixed_ms) / cost.per_token_ms, 0.0))
    if dense >= ROUND_FROM:
        dense = dense // 16 * 16
    budget = dense
    if cost.lowbit_rows and dense <= cost.lowbit_rows:     # the dense line: no fit above R
        budget = 0
        if cost.lowbit_per_token_ms > 0:
            low = (max_step_ms - cost.lowbit_fixed_ms) / cost.lowbit_per_token_ms
            budget = min(cost.lowbit_rows, int(max(low, 0.0)))
    return max(lo, min(hi, budget))


def efficient_chunk(cost: StepCost, num_decodes: int, efficiency: float = CHUNK_EFFICIENCY,
                    hi: int = MAX_BUDGET) -> int:
    """Fewest prompt tokens c (1..hi) whose modelled cost takes at least `efficiency` of
    the time a chunk of c adds to a decode-only step of `num_decodes` streams:
    slope x c >= efficiency x (step_ms(D + c) - decode_ms(D)). On a piece with intercept
    f and slope s the added time is F + s x c with F = f + s x D - decode_ms(D), so
    c >= efficiency x F / ((1 - efficiency) x s). With D below the low-bit rows R, on the
    low-bit piece and at most R - D (past R the dense line's fixed cost would make the
    chunk jump to hundreds of tokens; the step target's own budget may still go there);
    with D >= R (or no low-bit piece), on the dense line."""
    d = num_decodes
    dec = cost.decode_ms(d)

    def need(fixed: float, slope: float) -> int:
        overhead = fixed + slope * d - dec
        if overhead <= 0:
            return 1
        return max(1, math.ceil(efficiency * overhead / ((1.0 - efficiency) * slope) - 1e-9))
    if cost.lowbit_per_token_ms > 0 and d < cost.lowbit_rows:
        c = need(cost.lowbit_fixed_ms, cost.lowbit_per_token_ms)
        return min(c, cost.lowbit_rows - d, hi)
    return min(need(cost.fixed_ms, cost.per_token_ms), hi)


@dataclass(frozen=True)
class StepBudget:
    """The per-step token budget from the measured cost (see the module docstring).
    `max_step_ms` None: the target follows the decode count; else it is fixed."""

    cost: StepCost
    max_step_ms: float | None = None
    min_chunk: int = MIN_CHUNK
    idle: int = IDLE_BUDGET
    efficiency: float = CHUNK_EFFICIENCY

    def target_ms(self, num_decodes: int) -> float:
        return self.max_step_ms if self.max_step_ms is not None else \
            default_max_step_ms(self.cost, num_decodes)

    def for_step(self, num_decodes: int, num_prefills: int = 0) -> int:
        """Token budget of a step whose running requests include `num_decodes` decodes,
        with `num_prefills` requests (running or admissible) that have prompt tokens to
        compute: at least one token for each of them (min_chunk x max(1, num_prefills)),
        as for each decode, so a burst of new prompts is admitted at the pace of the
        streams, not starved by a small target; and at least an efficient chunk
        (`efficient_chunk`) beside the decodes."""
        if num_decodes == 0:
            return self.idle
        lo = num_decodes + max(self.min_chunk * max(1, num_prefills),
                               self.efficient_chunk(num_decodes))
        return token_budget(self.cost, self.target_ms(num_decodes), lo=lo,
                            hi=max(self.idle, lo))

    def efficient_chunk(self, num_decodes: int) -> int:
        """The least chunk a step beside `num_decodes` decodes carries: efficient_chunk
        with this policy's efficiency, cut to the largest whose step is modelled within
        MAX_GAP_FACTOR x the decode-only step (0 when not even one token is); 0 with
        efficiency 0."""
        if self.efficiency <= 0:
            return 0
        c = efficient_chunk(self.cost, num_decodes, self.efficiency, self.idle)
        gap = MAX_GAP_FACTOR * self.cost.decode_ms(num_decodes)
        fits = token_budget(self.cost, gap, lo=0, hi=num_decodes + c) - num_decodes
        return max(0, min(c, fits))

    def describe(self) -> str:
        """The budget as reported at start-up."""
        c = self.cost
        per = ", ".join(f"{d}: {self.for_step(d)} ({self.target_ms(d):.0f} ms)"
                        for d in (1, 8, 64))
        dec = ("as the other steps" if c.decode_fixed_ms is None else
               f"{c.decode_fixed_ms:.1f} ms + {c.decode_per_seq_ms:.2f} ms/stream")
        low = ("" if not c.lowbit_rows else
               f"{c.lowbit_fixed_ms:.1f} ms + {c.lowbit_per_token_ms:.3f} ms/token up to "
               f"{c.lowbit_rows} rows, ")
        return (f"{self.idle} tokens with no decode running; with D decodes, tokens "
                f"(target step) for D = {per}; a chunk beside 1 / 8 decodes at least "
                f"{self.efficient_chunk(1)} / {self.efficient_chunk(8)} tokens (worth its "
                f"step overhead); a chunk token after 1,000 cached tokens "
                f"costs {self._per_token(1000, self.for_step(8)):.2f} with 8 decodes; "
                f"measured: decode-only steps {dec}, other steps {low}{c.fixed_ms:.1f} ms + "
                f"{c.per_token_ms:.3f} ms/token above, + {c.per_pair_ms * 1e6:.0f} ns per "
                f"cached-context pair")

    def _per_token(self, start: int, step_budget: int) -> float:
        """Budget tokens one chunk token after `start` cached tokens is charged in a step
        whose budget is `step_budget`."""
        return 1.0 + start * self.cost.per_pair_ms / self.cost.per_token_at(step_budget)

    def chunk_cost(self, num_new: int, start: int, step_budget: int) -> int:
        """Budget tokens charged for a chunk of `num_new` tokens after `start` cached ones
        (>= num_new; rounded up)."""
        return max(num_new, math.ceil(num_new * self._per_token(start, step_budget) - 1e-9))

    def max_chunk(self, budget_left: int, start: int, num_new: int, step_budget: int
                  ) -> int:
        """Tokens of a prompt's next chunk after `start` cached tokens when `budget_left`
        of the step's `step_budget` tokens remain: as many as `chunk_cost` lets fit, at
        least min(num_new, min_chunk, budget_left), at most min(num_new, budget_left)."""
        cap = min(num_new, budget_left)
        fits = int(budget_left / self._per_token(start, step_budget))
        return max(min(cap, self.min_chunk), min(cap, fits))


def derive_step_budget(cost: StepCost, max_step_ms: float | None, max_num_seqs: int
                       ) -> tuple[int, "StepBudget | None"]:
    """What an engine without an explicit --max-num-batched-tokens schedules with, given
    its measured step cost: (largest budget any step gets, the per-step StepBudget).
    An implausible cost gives the fixed FALLBACK_TOKEN_BUDGET and no StepBudget.
    EngineCore and the simulator's profiles (sim/profile.py) both call this, so a
    simulated instance budgets its steps exactly as the engine it models."""
    if not is_plausible(cost):
        return FALLBACK_TOKEN_BUDGET, None
    policy = StepBudget(cost, max_step_ms)
    return max(policy.idle, max_num_seqs + policy.min_chunk), policy
