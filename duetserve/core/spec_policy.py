"""How many drafts each request verifies in a step (speculative decoding, scheduler side).

Pure Python. The scheduler asks `SpecPolicy.plan` once per step; the runner proposes and
verifies (spec_decode/). Fixed mode verifies every available draft up to k. Adaptive mode
picks per request from the step's position on the roofline and the request's measured
acceptance:

    step time      T(R) = max(mem_s, R * row_s)       R rows (tokens) in the step
                           weights read once | FLOPs of R rows      (ridge: R* = mem_s/row_s)
    tokens a step  E    = sum over requests of 1 + a_r + a_r^2 + ... + a_r^k_r
                          (draft j survives only if drafts 1..j are accepted; a_r is the
                          request's acceptance rate, geometric model)

A draft (r, j) is added, best gain a_r^j first, while it raises tokens per second:
(E + a_r^j) / T(R + 1) > E / T(R). Left of the ridge a row is free (T flat), so every
draft with a gain above `min_gain` fits until the step reaches the ridge; right of it a
row costs row_s and a draft pays only if a_r^j > E / R, which never holds for a step of
plain decodes (E / R = 1): a compute-bound step runs without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

from duetserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class RooflineStep:
    """Step time of R rows as the roofline predicts it (seconds)."""

    mem_seconds: float       # weights (and the step's fixed bytes) at the memory bandwidth
    row_seconds: float       # FLOPs of one row at the peak

    def seconds(self, rows: int) -> float:
        return max(self.mem_seconds, rows * self.row_seconds)

    @property
    def ridge_rows(self) -> float:
        return self.mem_seconds / self.row_seconds if self.row_seconds > 0 else float("inf")


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
    roofline: RooflineStep | None = None  # adaptive only; None: treat every row as free
    min_gain: float = 0.15               # skip drafts less likely than this to be kept

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
        out: dict[str, int] = {}
        rows, tokens = base_rows, float(base_tokens)
        for gain, req_id in options:      # gains of one request decrease: j is added in order
            if self.roofline is not None:
                t_now, t_next = self.roofline.seconds(rows), self.roofline.seconds(rows + 1)
                if (tokens + gain) * t_now <= tokens * t_next:
                    break                 # sorted by gain: no later draft pays either
            out[req_id] = out.get(req_id, 0) + 1
            rows += 1
            tokens += gain
        return out

    def has_room(self, base_rows: int) -> bool:
        """Whether a step of base_rows rows leaves room for drafts (left of the ridge);
        when it does not, no drafts are proposed for the next step either."""
        if not self.adaptive or self.roofline is None:
            return True
        return base_rows + 1 <= self.roofline.ridge_rows

    def num_to_propose(self, alpha: float) -> int:
        """Drafts to propose for a request's next step: k, or (adaptive) the drafts whose
        gain alpha^j stays above min_gain (at least one, so acceptance keeps being measured)."""
        k = self.num_speculative_tokens
        if not self.adaptive:
            return k
        n, gain = 1, alpha
        while n < k and gain * alpha >= self.min_gain:
            gain *= alpha
            n += 1
        return n
