"""Incremental detokenizer: token ids in, printable text deltas out, with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens)
and for SentencePiece-style decoders (a leading space depends on the previous token).
So each step decodes a short window of tokens twice and prints the difference:

    token_ids:  ... p p p | o o o o | n n
                          ^prefix   ^read
    prefix_text = decode(ids[prefix:read])     (already printed)
    full_text   = decode(ids[prefix:])         (with the new tokens)
    delta       = full_text[len(prefix_text):] unless it ends in U+FFFD (incomplete UTF-8:
                  wait for more tokens; the offsets stay so the bytes are decoded again)

Stop strings are searched in the decoded text, so they are found across token
boundaries. Text that could still be the start of a stop string is held back
(at most len(longest stop) - 1 characters) until it is known not to be; `flush()`
releases it when the request ends for another reason.

NOTE: the state is bounded, whatever the output length: the token window starts at
`prefix`, and only decoded text not yet emitted is kept (a stop string cannot start in
emitted text). The caller keeps the deltas it needs.
"""
from __future__ import annotations

from tokenizers import Tokenizer

# How many prompt tokens before the first output token give decoding its context.
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-sequence state. Not thread-safe; one per (request, sample)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._token_ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._pending = ""         # decoded text (complete characters) not yet returned
        self.stop_reason: str | None = None   # the stop string that matched
        self.finished = False

    def add_tokens(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens. Returns the newly printable text (None when nothing new
        is printable yet). Mutates: the decoding window, the pending text, and on a stop-string
        match `finished` and `stop_reason` (text is then cut before the stop string, or
        after it with include_stop_str_in_output). After `finished`, returns None."""
        if self.finished or not new_token_ids:
            return None
        self._token_ids.extend(new_token_ids)
        self._decode_window(force=False)
        return self._emit(final=False)

    def flush(self) -> str | None:
        """The request ended for another reason (eos, stop token, length, abort): decode
        any held-back bytes, release held-back text (still cutting at a stop string should
        one complete). Returns the last delta or None; sets `finished`."""
        if self.finished:
            return None
        self._decode_window(force=True)
        delta = self._emit(final=True)
        self.finished = True
        return delta

    # -- internals ----------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, force: bool) -> None:
        """Move newly complete characters into the pending text; slide the window."""
        if self._read_offset == len(self._token_ids):
            return
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return        # e.g. a skipped special token: nothing printable yet
        if full_text.endswith(_REPLACEMENT_CHAR) and not force:
            return        # incomplete UTF-8 sequence: wait for its remaining bytes
        self._pending += full_text[len(prefix_text):]
        # Slide the window: tokens before the new prefix are never decoded again.
        del self._token_ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._token_ids)

    def _emit(self, final: bool) -> str | None:
        """Search stop strings in the not-yet-emitted text, then return what is safe."""
        if self.stop:
            # A match cannot start in emitted text (that text was no stop-string prefix).
            match = _find_first_stop(self._pending, self.stop, 0)
            if match is not None:
                pos, stop_str = match
                end = pos + len(stop_str) if self.include_stop_str_in_output else pos
                self.finished, self.stop_reason = True, stop_str
                return self._release(end)
        end = len(self._pending)
        if not final:
            end -= _stop_prefix_overlap(self._pending, self.stop, self._max_stop_len)
        return self._release(end)

    def _release(self, end: int) -> str | None:
        """Return the first `end` pending characters (None when end is 0); keep the rest
        (dropped once finished)."""
        if end <= 0:
            return None
        delta, self._pending = self._pending[:end], self._pending[end:]
        if self.finished:
            self._pending = ""
        return delta


def _find_first_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The stop string that completes first in `text[start:]`: the match with the earliest
    end (the one a character-by-character stream would see first), then the earliest
    start. Returns (position, stop) or None. Independent of how tokens were chunked."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos >= 0:
            key = (pos + len(stop), pos, stop)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


def _stop_prefix_overlap(text: str, stops: tuple[str, ...], max_stop_len: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string
    (0..max_stop_len-1): the characters that must be held back."""
    for k in range(min(len(text), max_stop_len - 1), 0, -1):
        tail = text[-k:]
        if any(stop.startswith(tail) for stop in stops):
            return k
    return 0
