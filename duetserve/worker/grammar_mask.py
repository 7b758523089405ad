"""GrammarMasker: a step's grammar masks applied to its logits.

    prefetch(states)   before the forward pass: llguidance fills the bitmasks
                       [R, ceil(V/32)] int32 on a helper thread (bit t % 32 of word t // 32
                       = token t allowed; rows in parallel on the compiler's thread pool;
                       the GIL is released), so the fill overlaps the model
    apply(logits, ...) after it: wait for the fill, unpack the bits (numpy), and set the
                       logits of disallowed tokens to -inf in place

Only rows with a grammar are touched; a step without one never gets here (StepSampler
checks), so unconstrained decoding costs one scan of the step's states. A step whose
states were not prefetched (e.g. the sampler used alone) fills synchronously.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from duetserve.structured import GrammarCompiler, GrammarState

NEG_INF = float("-inf")


class GrammarMasker:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros((0, self.num_words), dtype=torch.int32)
        self._pool: ThreadPoolExecutor | None = None      # created on first prefetch
        self._pending: tuple[list[GrammarState], Future] | None = None
        # Cumulative timings (benchmarks read them): apply() in total, and the part of it
        # spent waiting for a prefetched fill (the fill's cost left on the critical path).
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.num_masked_rows = 0

    def _fill(self, states: list[GrammarState]) -> torch.Tensor:
        """Fill the first len(states) rows of the bitmask buffer (grown as needed)."""
        num_rows = len(states)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.zeros((num_rows, self.num_words), dtype=torch.int32)
        bitmask = self._bitmask[:num_rows]
        self.compiler.fill_bitmasks(states, list(range(num_rows)), bitmask.data_ptr(),
                                    self.num_words * 4, num_rows)
        return bitmask

    def _settle(self) -> None:
        """Wait for a fill still running (its buffer is about to be reused)."""
        if self._pending is not None:
            self._pending[1].exception()
            self._pending = None

    def prefetch(self, states: list[GrammarState]) -> None:
        """Start filling the masks of `states` (in this order) on the helper thread. The
        states must not change until apply() has used them. Mutates the buffer (later)."""
        self._settle()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duet-grammar")
        self._pending = (list(states), self._pool.submit(self._fill, states))

    def allowed(self, states: list[GrammarState]) -> torch.Tensor:
        """[len(states), vocab_size] bool: the tokens each state allows next."""
        return ~self.disallowed(states)

    def disallowed(self, states: list[GrammarState]) -> torch.Tensor:
        """[len(states), vocab_size] bool: the tokens each state forbids next (from the
        prefetched masks when they were for exactly these states). Reads the states."""
        pending, self._pending = self._pending, None
        if pending is not None and len(pending[0]) == len(states) \
                and all(a is b for a, b in zip(pending[0], states)):
            t0 = time.perf_counter()
            bitmask = pending[1].result()
            self.wait_seconds += time.perf_counter() - t0
        else:
            if pending is not None:
                pending[1].exception()
            bitmask = self._fill(states)
        # NOTE: numpy's unpackbits on the inverted bytes (little-endian words: byte b of
        # word w holds tokens 32w + 8b .. +7) measured faster than torch shifts here.
        bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :self.vocab_size]).view(torch.bool)

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]
              ) -> None:
        """Set to -inf, in place, every logit of row rows[i] of `logits` [N, V] that
        states[i] does not allow. Mutates `logits` and the timing counters only."""
        t0 = time.perf_counter()
        disallowed = self.disallowed(states).to(logits.device)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(disallowed, NEG_INF)
        else:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill_(disallowed, NEG_INF)
        self.num_masked_rows += len(rows)
        self.seconds += time.perf_counter() - t0
