"""SamplingMetadata: one step's sampling parameters as batched tensors.

Built once per step from per-row SamplingParams and token histories. Each optional
tensor is None when no row needs it, so an all-greedy batch without penalties, bias or
min_tokens is a plain argmax (see `Sampler`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from duetserve.sampling_params import SamplingParams
from duetserve.worker.seeded import seeded_uniform


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor            # [B] bool: rows that take the argmax
    greedy_rows: list[bool]              # the same on the host (no device sync to read)
    temperature: torch.Tensor            # [B] float32; greedy rows hold 1.0 (never divided)
    top_k: torch.Tensor | None           # [B] long in [1, V] (V = off); None: no row uses it
    max_top_k: int                       # max of top_k (V when top_k is None)
    top_p: torch.Tensor | None           # [B] float32 (1.0 = off); None: no row uses it
    min_p: torch.Tensor | None           # [B] float32 (0.0 = off); None: no row uses it
    # Penalties as sparse (row, token) entries; None when no row has that penalty.
    # repetition: the row's penalty r at every token seen in its prompt or output.
    repetition_index: tuple[torch.Tensor, torch.Tensor] | None
    repetition_values: torch.Tensor | None   # [nnz] r
    # additive: presence + frequency * count at every token of the row's output.
    additive_index: tuple[torch.Tensor, torch.Tensor] | None
    additive_values: torch.Tensor | None     # [nnz], subtracted from the logits
    # logit_bias and min_tokens suppression as sparse (row, token) entries; None when empty.
    bias_index: tuple[torch.Tensor, torch.Tensor] | None
    bias_values: torch.Tensor | None
    suppress_index: tuple[torch.Tensor, torch.Tensor] | None  # min_tokens: set to -inf
    # per row: the uniform u of a seeded random row (seeded_uniform(seed, its output
    # position)); None for greedy and unseeded rows (the global RNG draws theirs)
    seeded_u: list[float | None]
    num_logprobs: list[int | None]          # per row: None = no logprobs
    max_num_logprobs: int | None            # max over rows; None: no row asked

    @property
    def no_penalties(self) -> bool:
        return self.repetition_index is None and self.additive_index is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def needs_logprobs(self) -> bool:
        return self.max_num_logprobs is not None

    @property
    def needs_logit_edits(self) -> bool:
        """True when bias, min_tokens or penalties change the logits before temperature."""
        return (self.bias_index is not None or self.suppress_index is not None
                or not self.no_penalties)

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], positions: list[int],
              eos_token_ids: tuple[int, ...], vocab_size: int,
              device: torch.device | str = "cpu") -> "SamplingMetadata":
        """Batch the rows' parameters. Row i uses params[i], its prompt and output so far
        (the tokens already generated, NOT including the one about to be sampled) and
        positions[i], the output index of the token about to be sampled (what a seeded
        row's uniform is keyed by, worker/seeded.py). Reads its inputs; mutates nothing.
        Token ids outside [0, vocab_size) are ignored (validate_for_vocab rejects them at
        add-request time)."""
        num_rows = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(positions) == num_rows
        greedy = [p.is_greedy for p in params]

        def vec(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)
        top_k, max_top_k, top_p, min_p = _truncation(params, vocab_size, vec)
        bias, repetition, additive = _edits(params, prompt_token_ids, output_token_ids,
                                            vocab_size)
        suppress = _suppressed(params, output_token_ids, eos_token_ids, vocab_size)
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            num_rows=num_rows, vocab_size=vocab_size,
            all_greedy=all(greedy), all_random=not any(greedy),
            greedy_mask=vec(greedy, torch.bool), greedy_rows=greedy,
            temperature=vec([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                            torch.float32),
            top_k=top_k, max_top_k=max_top_k, top_p=top_p, min_p=min_p,
            bias_index=bias.index(device), bias_values=bias.values(device),
            repetition_index=repetition.index(device),
            repetition_values=repetition.values(device),
            additive_index=additive.index(device), additive_values=additive.values(device),
            suppress_index=suppress.index(device),
            seeded_u=[None if p.is_greedy or p.seed is None else seeded_uniform(p.seed, pos)
                      for p, pos in zip(params, positions)],
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
        )


def _truncation(params: list[SamplingParams], vocab_size: int, vec):
    """(top_k, max_top_k, top_p, min_p): each None when no random row uses it."""
    random_params = [p for p in params if not p.is_greedy]
    top_k = top_p = min_p = None
    max_top_k = vocab_size
    if any(p.top_k_enabled for p in random_params):
        top_k_list = [min(p.top_k, vocab_size) if p.top_k_enabled and not p.is_greedy
                      else vocab_size for p in params]
        top_k, max_top_k = vec(top_k_list, torch.long), max(top_k_list)
    if any(p.top_p < 1.0 for p in random_params):
        top_p = vec([1.0 if p.is_greedy else p.top_p for p in params], torch.float32)
    if any(p.min_p > 0.0 for p in random_params):
        min_p = vec([0.0 if p.is_greedy else p.min_p for p in params], torch.float32)
    return top_k, max_top_k, top_p, min_p


def _edits(params: list[SamplingParams], prompt_token_ids: list[list[int]],
           output_token_ids: list[list[int]], vocab_size: int
           ) -> tuple["_SparseBuilder", "_SparseBuilder", "_SparseBuilder"]:
    """The logit bias, the repetition penalty at every token seen in a row's prompt or
    output, and presence + frequency x count at every token of its output."""
    bias = _SparseBuilder(vocab_size)
    repetition = _SparseBuilder(vocab_size)
    additive = _SparseBuilder(vocab_size)
    for row, p in enumerate(params):
        for token_id, value in (p.logit_bias or {}).items():
            bias.add(row, token_id, value)
        if p.repetition_penalty != 1.0:
            seen = set(prompt_token_ids[row])
            seen.update(output_token_ids[row])
            for token_id in sorted(seen):
                repetition.add(row, token_id, p.repetition_penalty)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            for token_id, count in sorted(Counter(output_token_ids[row]).items()):
                additive.add(row, token_id, p.presence_penalty + p.frequency_penalty * count)
    return bias, repetition, additive


def _suppressed(params: list[SamplingParams], output_token_ids: list[list[int]],
                eos_token_ids: tuple[int, ...], vocab_size: int) -> "_SparseBuilder":
    """The stop and eos ids of rows that have not reached min_tokens (set to -inf)."""
    suppress = _SparseBuilder(vocab_size)
    for row, p in enumerate(params):
        if len(output_token_ids[row]) < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            for token_id in sorted(ids):
                suppress.add(row, token_id, float("-inf"))
    return suppress


class _SparseBuilder:
    """Collects (row, token_id, value) entries; ids outside [0, vocab_size) are dropped."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []

    def add(self, row: int, token_id: int, value: float) -> None:
        if 0 <= token_id < self.vocab_size:
            self.rows.append(row)
            self.cols.append(token_id)
            self.vals.append(value)

    def index(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.rows:
            return None
        return (torch.tensor(self.rows, dtype=torch.long, device=device),
                torch.tensor(self.cols, dtype=torch.long, device=device))

    def values(self, device: torch.device | str) -> torch.Tensor | None:
        if not self.rows:
            return None
        return torch.tensor(self.vals, dtype=torch.float32, device=device)
