"""Token budget per step from a target step time (pure arithmetic, no torch).

Running streams get one token per step, so the step time IS their inter-token gap. A long
prompt admitted with a large budget makes one step (one gap) as long as its whole chunk;
a budget derived from a target step time cuts the prompt into chunks that keep every gap
near that target. Steps are priced by the one step-time model (core/step_time.StepTime,
measured at start-up by engine/step_probe.py): a step of D decodes (each after
TYPICAL_CONTEXT cached tokens) and one prompt chunk of c tokens is `step_ms(D, c)`.
Steps of up to the model's few_rows rows run the few-row kernels, larger ones dense GEMMs:
a cliff in step time (8 decodes + 16 prompt tokens can take twice 8 + 8 on a 2-core CPU).

`StepBudget` re-derives the budget every step from the number D of running decodes:

- D = 0: the idle chunk (nobody's gap to protect: prompts prefill in the chunks the model
  prices fastest per token, `idle_chunk`: one big step where its kernels are efficient,
  chunk_rows-sized chunks on the native decode stack where those are, as on a 2-core
  Zen 5 whose 2,048-token steps ran 0.66x the speed of 64-token chunks; never past the
  largest fresh prefill the start-up probes measured, IDLE_PROBE);
- else the step must fit `target = STEP_FACTOR x decode_ms(D)` (or the fixed
  `--max-step-ms`): the most rows D + c with step_ms(D, c) <= target (over the few-row
  and the many-row kernels, the larger fit wins), but at least D + MIN_CHUNK x P for the
  P requests with prompt tokens to compute, so every prompt makes progress at least as
  fast as a stream (a burst of new requests is not starved by a small target), and at
  least D + `efficient_chunk(D)`: a step that carries prompt tokens beside D decodes may
  cost an overhead F over their decode-only step (a prefill slice leaves the native
  decode stack for the per-layer modules), and a chunk too small to amortize F makes
  prefill so slow that the queue, not the gap, sets everyone's latency. The efficient
  chunk is the smallest whose own rows take CHUNK_EFFICIENCY of the step time it adds
  (1 where F <= 0), but never one whose step is modelled above MAX_GAP_FACTOR x the
  decode-only step (the bound on a stream's gap this budget exists for).
- In a step with decodes, a prefill chunk after s cached tokens is charged its rows plus
  its attention over them in rows' worth of time (`chunk_cost`), so deep in a long context
  it gets fewer tokens (`max_chunk`), never fewer than MIN_CHUNK. A step without decodes
  charges a chunk its length (the scheduler's `_chunk`): nobody's gap to protect, and the
  idle chunk was priced with its attention (`prompt_seconds`), so a lone prompt runs in
  whole idle chunks instead of shrinking ones and a short tail step.

The answers that depend only on the decode count D are computed once and remembered (at
most max_num_seqs of each): the scheduler pays a dict lookup per step for them, and a few
pricings per chunk after cached context.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from duetserve.core.step_time import StepShape, StepTime

MIN_CHUNK = 1             # least prefill tokens a step with decodes gives a prompt (progress)
CHUNK_EFFICIENCY = 0.8    # a chunk beside decodes: its rows' share of the time it adds
MAX_BUDGET = 8192         # cannot fit in one step
STEP_FACTOR = 1.5         # default target: this many times the decode-only step of the D
DECODE_REF_TOKENS = 16    # streams running; reported at start-up for this many streams
MAX_GAP_FACTOR = 2.0      # the efficient-chunk floor's step: at most this x decode-only
IDLE_BUDGET = 2048        # largest step budget the model derives (nobody's gap to protect)
IDLE_PROBE = 512          # largest fresh prefill the start-up probes time (step_probe.py):
                          # the idle chunk is chosen among sizes up to this, never priced
                          # by extrapolating the linear model past what was measured
IDLE_PROMPT = 2048        # the prompt the idle chunk is chosen for (a long one)
IDLE_TIE = 0.02           # chunks within this of the fastest: the largest is taken (fewer steps)
FALLBACK_TOKEN_BUDGET = 512   # fixed budget when the measured model is implausible (noise)
ROUND_FROM = 64           # budgets of at least this many tokens are rounded down to 16s
# The scheduler knows how many requests decode, not how long their contexts are: a decode
# is priced as one reading this many cached tokens (the probes' decode context).
TYPICAL_CONTEXT = 128


def _largest_fit(lo: int, hi: int, ok: Callable[[int], bool], cuts: tuple[int, ...]) -> int:
    """The largest x in [lo, hi] with ok(x), for ok monotone (true, then false) within
    each of the pieces [lo, hi] is cut into after each x in `cuts` (where the layout of a
    chunk changes: one token is a decode row, up to chunk_rows tokens are decode rows);
    lo - 1 when none is ok."""
    ends = sorted({c for c in cuts if lo <= c < hi} | {hi})
    starts = [lo] + [e + 1 for e in ends[:-1]]
    for start, end in reversed(list(zip(starts, ends))):
        x = _largest(start, end, ok)
        if x >= start:
            return x
    return lo - 1


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest x in [lo, hi] with ok(x), for ok true up to some point and false after
    it; lo - 1 when ok(lo) is false."""
    if hi < lo or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class StepBudget:
    """The per-step token budget from the measured step time (module docstring).
    `max_step_ms` None: the target follows the decode count; else it is fixed. Its
    answers per decode count are remembered (the model is frozen); nothing else is
    mutated."""

    __slots__ = ("step_time", "max_step_ms", "min_chunk", "idle", "efficiency", "idle_chunk",
                 "_memo")

    def __init__(self, step_time: StepTime, max_step_ms: float | None = None,
                 min_chunk: int = MIN_CHUNK, idle: int = IDLE_BUDGET,
                 efficiency: float = CHUNK_EFFICIENCY) -> None:
        self.step_time = step_time
        self.max_step_ms = max_step_ms
        self.min_chunk = min_chunk
        self.idle = idle
        self.efficiency = efficiency
        self.idle_chunk = idle_chunk(step_time, idle)
        self._memo: dict[tuple, int | float] = {}

    def _key(self) -> tuple:
        return (self.step_time, self.max_step_ms, self.min_chunk, self.idle, self.efficiency)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepBudget) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"StepBudget({self.step_time!r}, max_step_ms={self.max_step_ms}, "
                f"min_chunk={self.min_chunk}, idle={self.idle}, "
                f"efficiency={self.efficiency})")

    def _remember(self, key: tuple, compute: Callable[[], int | float]) -> int | float:
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = compute()
        return value

    # -- the priced steps ------------------------------------------------------------
    def decode_ms(self, num_decodes: int) -> float:
        """A decode-only step of `num_decodes` streams, in ms."""
        return self._remember(("decode", num_decodes), lambda: 1e3 * self.step_time.seconds(
            StepShape.decode_rows(self.step_time.layout, num_decodes, num_decodes,
                                  TYPICAL_CONTEXT)))

    def step_ms(self, num_decodes: int, num_chunk: int, start: int = 0) -> float:
        """A step of `num_decodes` decodes beside one prompt chunk of `num_chunk` tokens
        after `start` cached ones (its last row sampled), in ms."""
        shape = StepShape.decode_rows(self.step_time.layout, num_decodes, num_decodes,
                                      TYPICAL_CONTEXT)
        shape.add(num_chunk, start, 1)
        return 1e3 * self.step_time.seconds(shape)

    def target_ms(self, num_decodes: int) -> float:
        return self.max_step_ms if self.max_step_ms is not None else \
            STEP_FACTOR * self.decode_ms(num_decodes)

    # -- budgets ---------------------------------------------------------------------
    def token_budget(self, num_decodes: int, target_ms: float, hi: int = MAX_BUDGET) -> int:
        """Most rows D + c (c >= 1 chunk tokens beside D decodes) whose step fits
        `target_ms`, at most `hi` (rounded down to 16s from ROUND_FROM up); D when not even
        one chunk token fits. Over the few-row and the many-row kernels the larger fit
        wins."""
        d, lay = num_decodes, self.step_time.layout

        def ok(c: int) -> bool:
            return self.step_ms(d, c) <= target_ms
        cuts = (1, lay.chunk_rows)
        lo_many = max(1, lay.few_rows + 1 - d)
        many = _largest_fit(lo_many, hi - d, ok, cuts)
        if many >= lo_many:
            rows = d + many
            return max(d, rows // 16 * 16) if rows >= ROUND_FROM else rows
        return d + max(0, _largest_fit(1, min(lay.few_rows - d, hi - d), ok, cuts))

    def chunk_within(self, num_decodes: int, start: int, target_ms: float, most: int
                     ) -> int:
        """The largest chunk of at most `most` tokens after `start` cached ones whose step
        beside `num_decodes` decodes fits `target_ms` (0 when not even one token does)."""
        return max(0, _largest_fit(
            1, most, lambda c: self.step_ms(num_decodes, c, start) <= target_ms,
            (1, self.step_time.layout.chunk_rows)))

    def efficient_chunk(self, num_decodes: int) -> int:
        """The least chunk a step beside `num_decodes` decodes carries (module
        docstring): the fewest c with c x row >= efficiency x (step_ms(D, c) -
        decode_ms(D)), on the few-row kernels (at most few_rows - D) when D is below
        few_rows, else on the many-row ones; cut to the largest whose step is modelled
        within MAX_GAP_FACTOR x the decode-only step (0 when not even one token is); 0
        with efficiency 0."""
        if self.efficiency <= 0:
            return 0
        return int(self._remember(("efficient", num_decodes),
                                  lambda: self._efficient_chunk(num_decodes)))

    def _efficient_chunk(self, d: int) -> int:
        few, eff = self.step_time.layout.few_rows, self.efficiency
        hi = few - d if d < few else self.idle
        # the overhead as a chunk of two tokens pays it (one token would run as a decode
        # row, which no chunk of the sizes the budget hands out does without chunk rows)
        c0 = 2 if hi >= 2 else 1
        probe = StepShape.decode_rows(self.step_time.layout, d, d, TYPICAL_CONTEXT)
        probe.add(c0, 0, 1)
        row_ms = 1e3 * self.step_time.row_seconds(probe.path)
        overhead = self.step_ms(d, c0) - c0 * row_ms - self.decode_ms(d)
        if overhead <= 0 or row_ms <= 0:
            c = 1
        else:
            c = max(1, math.ceil(eff * overhead / ((1.0 - eff) * row_ms) - 1e-9))
        c = min(c, hi)
        gap = MAX_GAP_FACTOR * self.decode_ms(d)
        fits = self.token_budget(d, gap, hi=d + c) - d
        return max(0, min(c, fits))

    def for_step(self, num_decodes: int, num_prefills: int = 0) -> int:
        """Token budget of a step whose running requests include `num_decodes` decodes,
        with `num_prefills` requests (running or admissible) that have prompt tokens to
        compute: at least one token for each of them (min_chunk x max(1, num_prefills)),
        as for each decode, so a burst of new prompts is admitted at the pace of the
        streams, not starved by a small target; and at least an efficient chunk
        (`efficient_chunk`) beside the decodes."""
        if num_decodes == 0:
            return max(self.idle_chunk, self.min_chunk * num_prefills)
        lo = num_decodes + max(self.min_chunk * max(1, num_prefills),
                               self.efficient_chunk(num_decodes))
        fits = int(self._remember(("budget", num_decodes), lambda: self.token_budget(
            num_decodes, self.target_ms(num_decodes))))
        return max(lo, min(max(self.idle, lo), fits))

    # -- chunks after cached context -------------------------------------------------
    def chunk_cost(self, num_new: int, start: int, step_budget: int) -> int:
        """Budget tokens charged for a chunk of `num_new` tokens after `start` cached ones:
        its rows plus its attention over the cached tokens, counted in rows of the
        kernels a step of `step_budget` rows runs (>= num_new; rounded up)."""
        if start <= 0:
            return num_new
        st = self.step_time
        after = StepShape(st.layout)
        after.add(num_new, start, 0)
        fresh = StepShape(st.layout)
        fresh.add(num_new, 0, 0)
        path = "many" if step_budget > st.layout.few_rows else fresh.path
        row = st.row_seconds(path)
        if row <= 0:
            return num_new
        extra = max(0.0, st.seconds(after) - st.seconds(fresh))
        return max(num_new, math.ceil(num_new + extra / row - 1e-9))

    def max_chunk(self, budget_left: int, start: int, num_new: int, step_budget: int
                  ) -> int:
        """Tokens of a prompt's next chunk after `start` cached tokens when `budget_left`
        of the step's `step_budget` tokens remain: as many as `chunk_cost` lets fit, at
        least min(num_new, min_chunk, budget_left), at most min(num_new, budget_left)."""
        cap = min(num_new, budget_left)
        fits = _largest_fit(1, cap, lambda n: self.chunk_cost(n, start, step_budget)
                            <= budget_left, (1, self.step_time.layout.chunk_rows))
        return max(min(cap, self.min_chunk), fits)

    def describe(self) -> str:
        """The budget as reported at start-up."""
        per = ", ".join(f"{d}: {self.for_step(d)} ({self.target_ms(d):.0f} ms)"
                        for d in (1, 8, 64))
        return (f"{self.idle_chunk} tokens with no decode running (the chunk priced "
                f"fastest for a {IDLE_PROMPT}-token prompt); with D decodes, tokens "
                f"(target step) for D = {per}; a chunk beside 1 / 8 decodes at least "
                f"{self.efficient_chunk(1)} / {self.efficient_chunk(8)} tokens (worth its "
                f"step overhead); 64 chunk tokens after 1,000 cached tokens are charged "
                f"{self.chunk_cost(64, 1000, self.for_step(8))} with 8 decodes; "
                f"decode-only step of 1 / 16 streams {self.decode_ms(1):.1f} / "
                f"{self.decode_ms(16):.1f} ms")


def prompt_seconds(step_time: StepTime, prompt: int, chunk: int) -> float:
    """Modelled time to prefill a fresh prompt of `prompt` tokens alone, in chunks of
    `chunk` (each after the tokens before it; the last one's row sampled)."""
    total, done = 0.0, 0
    while done < prompt:
        n = min(chunk, prompt - done)
        shape = StepShape(step_time.layout)
        shape.add(n, done, 1 if done + n == prompt else 0)
        total += step_time.seconds(shape)
        done += n
    return total


def idle_chunk(step_time: StepTime, most: int = IDLE_BUDGET) -> int:
    """The budget of a step with no decode running: of the chunk sizes up to
    min(most, IDLE_PROBE) (powers of two from 16, and the layout's chunk_rows, whose
    chunks run as decode rows on the native decode stack), the one that prefills an
    IDLE_PROMPT-token prompt fastest by the model; the largest of those within IDLE_TIE
    of the fastest. So no lone prompt runs in steps slower per token than the smaller
    chunks the same model prices (issue 67)."""
    top = min(most, IDLE_PROBE)
    sizes = {c for c in (16, 32, 64, 128, 256) if c <= top}
    if 2 <= step_time.layout.chunk_rows <= top:
        sizes.add(step_time.layout.chunk_rows)
    sizes.add(top)
    cost = {c: prompt_seconds(step_time, IDLE_PROMPT, c) for c in sorted(sizes)}
    best = min(cost.values())
    return max(c for c, t in cost.items() if t <= best * (1.0 + IDLE_TIE))


def default_max_step_ms(step_time: StepTime, num_decodes: int = DECODE_REF_TOKENS) -> float:
    """The default step-time target with `num_decodes` streams running."""
    return StepBudget(step_time).target_ms(num_decodes)


def derive_step_budget(step_time: StepTime, max_step_ms: float | None, max_num_seqs: int
                       ) -> tuple[int, StepBudget | None]:
    """What an engine without an explicit --max-num-batched-tokens schedules with, given
    its step-time model: (largest budget any step gets, the per-step StepBudget). An
    implausible model gives the fixed FALLBACK_TOKEN_BUDGET and no StepBudget.
    EngineCore and the simulator's profiles (sim/profile.py) both call this, so a
    simulated instance budgets its steps exactly as the engine it models."""
    if not step_time.is_plausible():
        return FALLBACK_TOKEN_BUDGET, None
    policy = StepBudget(step_time, max_step_ms)
    return max(policy.idle, max_num_seqs + policy.min_chunk), policy
