"""GrammarCompiler (grammars compiled once per spec, cached) and GrammarState (one
request's position in its grammar).

    server thread / engine:  compiler.compile(guided)   build + validate + LLMatcher,
                                                         cached by (kind, spec)
    runner (engine thread):  state = compiler.new_state(guided)   a copy of the cached
                                                                   matcher at the start
       each step:  state.write_mask(...)  (or fill_bitmasks for many) -> mask the logits
                   state.accept(token)    the sampled token advances the state
       speculation: state.num_valid_prefix(drafts), state.rollback(n)

The llguidance tokenizer (a trie over the vocabulary, about 0.3 s for 49k tokens, 1 s for
152k) is built on first use, so an engine that never sees a constraint never pays it; so
is the vocabulary's Spelling (spelling.py: refuses what the model cannot write, repairs
the mask rows llguidance gets wrong for a vocabulary that lacks some bytes).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import llguidance as llg

from duetserve.errors import RequestError
from duetserve.sampling_params import GuidedDecoding
from duetserve.structured.grammars import build_grammar
from duetserve.structured.spelling import Spelling

MAX_CACHED_GRAMMARS = 256
MAX_ERROR_CHARS = 600


class GrammarError(RuntimeError):
    """A token the grammar does not accept reached a GrammarState (a bug or a mask that
    was not applied); the request fails alone (engine isolation)."""


class ConstraintError(RequestError):
    """A request's constraint cannot go on: no token of the model can continue it (its
    grammar forces bytes the vocabulary cannot write, spelling.py), or llguidance gave
    up on it (a parser limit). The request fails alone (engine isolation) with HTTP 400
    naming the constraint's field."""


class GrammarState:
    """One request's matcher. Owned and mutated only by the runner (engine thread)."""

    __slots__ = ("matcher", "num_tokens", "param")

    def __init__(self, matcher: llg.LLMatcher, param: str = "guided") -> None:
        self.matcher = matcher
        self.num_tokens = 0            # tokens accepted so far
        self.param = param             # the request field of the constraint (messages)

    def write_mask(self, address: int, num_bytes: int) -> None:
        """Write the allowed-next-token bitmask (bit t of 32-bit word t // 32 set = token t
        allowed) to `num_bytes` bytes at `address`. Reads the state; mutates nothing
        else. The GIL is released while it runs."""
        self.matcher.unsafe_compute_mask_ptr(address, num_bytes)

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`. Raises GrammarError when the grammar rejects it (the
        state is then unusable)."""
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"{self.param}: the grammar rejected token {token_id}: "
                               f"{self.matcher.get_error()[:MAX_ERROR_CHARS]}")
        self.num_tokens += 1

    def accept_all(self, token_ids: list[int]) -> None:
        """Advance past each of `token_ids` in order (replaying a resumed request)."""
        for token_id in token_ids:
            self.accept(token_id)

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept from here (for
        speculative drafts). Mutates nothing."""
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise GrammarError(f"rollback failed: {self.matcher.get_error()}")
        self.num_tokens -= num_tokens

    @property
    def is_finished(self) -> bool:
        """True when only EOS can follow (the output is complete)."""
        return self.matcher.is_stopped()


@dataclass(frozen=True)
class _Compiled:
    matcher: llg.LLMatcher          # at the start state; only ever deep-copied


class GrammarCompiler:
    """Compiles GuidedDecoding constraints for one tokenizer and caches them (LRU, by kind
    and spec). Thread-safe: the server compiles on worker threads, the engine thread
    makes states."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: tuple[int, ...], num_threads: int = 1) -> None:
        """`tokenizer_json()` returns the `tokenizers` JSON of the model's tokenizer; it is
        called once, on first use. `vocab_size` is the logits' width."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_threads = max(1, num_threads)
        self._tokenizer: llg.LLTokenizer | None = None
        self._spelling: Spelling | None = None
        self._executor: llg.LLExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], _Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0            # cache misses, for tests and metrics

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        """The llguidance tokenizer, built on first use (under the lock)."""
        with self._lock:
            if self._tokenizer is None:
                if not self.eos_token_ids:
                    raise RequestError("this model has no EOS token; constrained "
                                       "decoding needs one to end the output", "guided")
                tokenizer = llg.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                            eos_token=list(self.eos_token_ids))
                self._spelling = Spelling(tokenizer, self.vocab_size)
                self._tokenizer = tokenizer
            return self._tokenizer

    @property
    def spelling(self) -> Spelling:
        """The vocabulary's Spelling (built with the tokenizer)."""
        self.tokenizer
        return self._spelling

    def compile(self, guided: GuidedDecoding) -> None:
        """Compile and cache `guided` (no-op when cached). Raises RequestError naming
        guided.param when the constraint is invalid or unsupported."""
        self._compiled(guided)

    def new_state(self, guided: GuidedDecoding) -> GrammarState:
        """A fresh state at the start of `guided`'s grammar (compiled if not cached)."""
        return GrammarState(self._compiled(guided).matcher.deep_copy(), guided.param)

    def fill_bitmasks(self, states: list[GrammarState], rows: list[int], address: int,
                      row_bytes: int, num_rows: int) -> None:
        """Write the mask of states[i] into row rows[i] of a [num_rows, row_bytes] buffer
        at `address`, in parallel on `num_threads` threads for several states; then
        repair the rows llguidance got wrong (spelling.py). Raises ConstraintError when
        a state cannot go on (its row left empty, or its matcher failed)."""
        spelling = self.spelling
        forced = [b""] * len(states) if spelling.complete else \
            [st.matcher.compute_ff_bytes() for st in states]   # before the mask: see repair
        if len(states) == 1:
            states[0].write_mask(address + rows[0] * row_bytes, row_bytes)
        else:
            if self._executor is None:
                self._executor = llg.LLExecutor(num_threads=self.num_threads)
            self._executor.unsafe_compute_mask_ptr(
                [(st.matcher, row) for st, row in zip(states, rows)], address, row_bytes,
                num_rows)
        for st, row, ff in zip(states, rows, forced):
            if spelling.needs_repair(ff) and not spelling.repair(
                    st.matcher, ff, address + row * row_bytes, row_bytes,
                    self.eos_token_ids):
                raise ConstraintError(
                    f"{st.param}: no token of this model can continue the constraint after "
                    f"{st.num_tokens} tokens: it requires the bytes {ff[:16]!r} next and "
                    f"{_unheld_text(spelling, ff)}", st.param)
            if st.matcher.is_error():
                raise ConstraintError(
                    f"{st.param}: the constraint cannot go on after {st.num_tokens} tokens: "
                    f"{st.matcher.get_error()[:MAX_ERROR_CHARS]}", st.param)

    def _compiled(self, guided: GuidedDecoding) -> _Compiled:
        key = (guided.kind, guided.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        tokenizer = self.tokenizer
        try:
            grammar = build_grammar(guided, tokenizer)
        except (ValueError, TypeError, KeyError) as e:
            if isinstance(e, RequestError):
                raise
            raise RequestError(f"{guided.param}: cannot compile the constraint: "
                               f"{str(e)[:MAX_ERROR_CHARS]}", guided.param) from None
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{guided.param}: {matcher.get_error()[:MAX_ERROR_CHARS]}",
                               guided.param)
        self._check_writable(guided, matcher)
        compiled = _Compiled(matcher)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            self.num_compiled += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _check_writable(self, guided: GuidedDecoding, matcher: llg.LLMatcher) -> None:
        """Raise RequestError when the model's tokens cannot write a choice of `guided`,
        or the bytes its grammar forces at the start (spelling.py)."""
        spelling = self.spelling
        if spelling.complete:
            return
        if guided.kind == "choice":
            for i, choice in enumerate(json.loads(guided.spec)):
                data = choice.encode()
                if not spelling.spells(data):
                    raise RequestError(
                        f"{guided.param}: choice {i} ({choice[:40]!r}) cannot be written "
                        f"with this model's tokens: {_unheld_text(spelling, data)}",
                        guided.param)
        forced = matcher.deep_copy().compute_ff_bytes()
        if spelling.unheld(forced) is not None:
            raise RequestError(
                f"{guided.param}: the constraint starts with the bytes {forced[:40]!r}, "
                f"which this model's tokens cannot write: {_unheld_text(spelling, forced)}",
                guided.param)


def _unheld_text(spelling: Spelling, data: bytes) -> str:
    b = spelling.unheld(data)
    if b is None:
        return "no sequence of its tokens spells them"
    return f"no token holds byte 0x{b:02x}"
