"""How many drafts each request verifies in a step (speculative decoding, scheduler side).

Pure Python. The scheduler asks `SpecPolicy.plan` once per step; the runner proposes and
verifies (spec_decode/). Fixed mode verifies every available draft up to k. Adaptive mode
picks per request from the step's time and the request's measured acceptance:

    step time      T(B, R)  B requests, R rows (their decodes plus the drafts verified):
                            a step of decode rows priced by the engine's step-time model
                            (core/step_time.py: the same model the step budget uses; a
                            verify slice is k+1 decode rows of one request)
    tokens a step  E    = sum over requests of 1 + a_r + a_r^2 + ... + a_r^k_r
                          (draft j survives only if drafts 1..j are accepted; a_r is the
                          request's acceptance rate, geometric model)

Drafts (r, j) are taken best gain a_r^j first, and the step takes the number of them
that gives the most tokens per second, E / T. Where a row is nearly free (few rows: the
weights are read once for all of them) every draft with a gain above `min_gain` fits;
where a row costs what a step's rows cost on average (many rows, compute-bound) a draft
pays only if a_r^j > E / R, which never holds for a step of plain decodes (E / R = 1): a
compute-bound step runs without speculation. The model's cliff where the few-row kernels
end makes T non-convex, so the best count can lie past one that does not pay by itself.

a_r: with `condition_on_streak` (n-gram) the request's acceptance is measured apart on
verify steps right after one that kept all its drafts and on the others
(core/spec_schedule.acceptance_of): a prompt-lookup copy that has been right goes on from
the same occurrence and stays right (an edited file's unchanged lines), a fresh match is
often wrong (new text), and one estimate for both would take too few drafts in the first
case and too many in the second.

Proposing is not free for a draft model: each draft is one forward of the draft model
(`draft_seconds`, measured at start-up). A request proposes the n that maximises its
expected tokens per second over the next step, proposals included:
    (B + a + ... + a^n) / (T(B, B + n) + n * draft_seconds)
with B = the running requests (the next step's decodes). Free proposers (n-gram)
propose every draft whose gain stays above min_gain and leave the choice to `plan`.
"""
from __future__ import annotations

from dataclasses import dataclass

from duetserve.core.step_budget import TYPICAL_CONTEXT
from duetserve.core.step_time import StepPricer, StepShape
from duetserve.sampling_params import SamplingParams


def is_spec_eligible(params: SamplingParams) -> bool:
    """Requests that speculate: not guided (drafts would bypass the grammar), no sampled
    logprobs (only the kept tokens' rows would have them)."""
    return params.guided is None and params.logprobs is None


def acceptance_estimate(num_accepted: int, num_rejections: int) -> float:
    """Per-draft acceptance rate from a request's history (geometric model: a verify step
    stops at its first rejection), with a Laplace prior so a new request starts at 1/2."""
    return (num_accepted + 1) / (num_accepted + num_rejections + 2)


@dataclass(frozen=True)
class SpecPolicy:
    num_speculative_tokens: int          # k: the most drafts per request per step
    needs_lookahead: bool                # the proposer writes KV for its drafts (draft model)
    adaptive: bool = True
    step_time: StepPricer | None = None  # adaptive only; None: treat every row as free
    min_gain: float = 0.15               # skip drafts less likely than this to be kept
    draft_seconds: float = 0.0           # one draft token's proposal (0: free, n-gram)
    # acceptance estimated apart after a fully kept verify and otherwise (n-gram:
    # core/spec_schedule.acceptance_of); False: one estimate per request
    condition_on_streak: bool = False

    def step_seconds(self, num_reqs: int, num_rows: int) -> float:
        """T(B, R): a step of `num_rows` decode rows of `num_reqs` requests, each row
        after TYPICAL_CONTEXT cached tokens (adaptive mode only)."""
        assert self.step_time is not None
        return self.step_time.seconds(StepShape.decode_rows(
            self.step_time.layout, max(1, min(num_reqs, num_rows)), num_rows,
            TYPICAL_CONTEXT))

    def plan(self, candidates: list[tuple[str, int, float]], base_rows: int,
             base_tokens: int) -> dict[str, int]:
        """Drafts per request for one step. candidates: (req_id, drafts available,
        acceptance estimate) of the decodes that have drafts; base_rows: rows the step
        computes without any draft; base_tokens: tokens it yields without any draft.
        Returns {req_id: k_r} (requests with 0 left out). Pure."""
        k = self.num_speculative_tokens
        if not self.adaptive:
            return {r: min(k, n) for r, n, _ in candidates if n > 0}
        options = []                      # (gain, req_id) of draft j of request r
        for req_id, num, alpha in candidates:
            gain = 1.0
            for _ in range(min(k, num)):
                gain *= alpha
                if gain < self.min_gain:
                    break
                options.append((gain, req_id))
        options.sort(key=lambda o: -o[0])
        # gains of one request decrease, so every prefix of `options` takes each request's
        # drafts in order: choose the prefix with the most tokens per second. Not the first
        # prefix after which one more draft stops paying: the measured T(R) is not convex
        # (the cliff where the few-row kernels end), and a row past it can pay where the
        # first one alone does not.
        best, rows, tokens = 0, base_rows, float(base_tokens)
        if self.step_time is not None:
            best_rate = tokens / self.step_seconds(base_tokens, rows) if rows > 0 else 0.0
            for n, (gain, _) in enumerate(options, 1):
                rows += 1
                tokens += gain
                rate = tokens / self.step_seconds(base_tokens, rows)
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = n, rate
        else:
            best = len(options)           # every row free
        out: dict[str, int] = {}
        for _, req_id in options[:best]:
            out[req_id] = out.get(req_id, 0) + 1
        return out

    def has_room(self, base_rows: int) -> bool:
        """Whether a step of base_rows rows leaves room for drafts: one more row holding a
        sure draft (gain 1) would raise the step's tokens per second. When it does not,
        no drafts are proposed for the next step either."""
        if not self.adaptive or self.step_time is None or base_rows <= 0:
            return True
        t_now = self.step_seconds(base_rows, base_rows)
        t_next = self.step_seconds(base_rows, base_rows + 1)
        return t_next * base_rows < t_now * (base_rows + 1) * (1 - 1e-9)

    def num_to_propose(self, alpha: float, next_rows: int = 1, probe: bool = False) -> int:
        """Drafts to propose for a request's next step (next_rows: that step's rows and
        tokens without drafts). Fixed: k. Adaptive: at most the drafts whose gain alpha^j
        stays above min_gain; free proposers take all of them (at least one, so
        acceptance keeps being measured), a draft model the n (possibly 0) that
        maximises tokens per second with its proposals' cost counted (module docstring).
        probe: a draft model proposes at least one draft, so that a request whose
        estimate fell (often: the first tokens of an answer are the hardest to guess)
        is measured again instead of never speculating again."""
        k = self.num_speculative_tokens
        if not self.adaptive:
            return k
        n, gain = 1, alpha
        while n < k and gain * alpha >= self.min_gain:
            gain *= alpha
            n += 1
        if self.draft_seconds <= 0 or self.step_time is None:
            return n
        best, best_rate = 0, next_rows / self.step_seconds(next_rows, next_rows)
        tokens, gain = float(next_rows), 1.0
        for j in range(1, n + 1):
            gain *= alpha
            tokens += gain
            rate = tokens / (self.step_seconds(next_rows, next_rows + j)
                             + j * self.draft_seconds)
            if rate > best_rate:
                best, best_rate = j, rate
        return max(best, 1) if probe else best
