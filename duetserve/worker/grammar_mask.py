"""GrammarMasker: a step's grammar masks applied to its logits.

    states of the constrained rows ──llguidance──> bitmask [R, ceil(V/32)] int32
      (bit t % 32 of word t // 32 = token t allowed; computed in parallel for R > 1)
    bitmask ──unpack──> allowed [R, V] bool ──> logits[row, ~allowed] = -inf  (in place)

Only rows with a grammar are touched; a step without one never gets here (StepSampler
checks), so unconstrained decoding costs one scan of the step's states.
"""
from __future__ import annotations

import time

import torch

from duetserve.structured import GrammarCompiler, GrammarState

NEG_INF = float("-inf")


class GrammarMasker:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros((0, self.num_words), dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.seconds = 0.0              # cumulative time in apply() (benchmarks read it)
        self.num_masked_rows = 0        # cumulative

    def allowed(self, states: list[GrammarState]) -> torch.Tensor:
        """[len(states), vocab_size] bool: the tokens each state allows next. Reads the
        states; reuses (mutates) the masker's bitmask buffer."""
        num_rows = len(states)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.zeros((num_rows, self.num_words), dtype=torch.int32)
        bitmask = self._bitmask[:num_rows]
        self.compiler.fill_bitmasks(states, list(range(num_rows)), bitmask.data_ptr(),
                                    self.num_words * 4, num_rows)
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1          # [R, W, 32]
        return bits.view(num_rows, self.num_words * 32)[:, :self.vocab_size].bool()

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]
              ) -> None:
        """Set to -inf, in place, every logit of row rows[i] of `logits` [N, V] that
        states[i] does not allow. Mutates `logits` and the timing counters only."""
        t0 = time.perf_counter()
        allowed = self.allowed(states)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, NEG_INF)
        else:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill_(~allowed, NEG_INF)
        self.num_masked_rows += len(rows)
        self.seconds += time.perf_counter() - t0
