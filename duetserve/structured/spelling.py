"""What a vocabulary can spell, and the mask rows llguidance gets wrong where it cannot.

llguidance assumes every byte has a token of its own. Some vocabularies lack some:
SmolLM2's has no token holding byte 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xf1 or 0xf2 (no
text its tokenizer was trained on had them; 0xf2 leads the UTF-8 of U+80000..U+BFFFF).
Where a grammar forces bytes, llguidance allows the first token of the tokenizer's
encoding of them, and the tokenizer drops the bytes it has no token for: with 0xf2 0x88
0xa4 0xae forced (U+8892E), the mask allowed the token of 0x88, which the parser then
rejected (issue 63). So, for such a vocabulary (`Spelling.complete` False):

    compile time  a choice that no sequence of tokens spells, or start bytes the grammar
                  forces with a byte no token holds, is refused (RequestError, HTTP 400)
    each step     a mask row whose forced bytes hold a byte without a one-byte token is
                  rebuilt from what the parser accepts (`repair`): the tokens llguidance
                  allowed that the parser validates, and the tokens spelling a prefix of
                  the forced bytes (never EOS: llguidance allows it where it finds no
                  token, and the output would end short of the grammar). A row left
                  empty means no token can go on: the request fails alone, with a
                  ConstraintError naming the bytes and its field. The forced bytes are
                  read before llguidance fills the row: where it finds no token, it
                  puts its matcher in an error state (then it forces nothing).

A complete vocabulary (every byte of UTF-8 text has a one-byte token: Llama 3, Qwen) skips
all of this.
"""
from __future__ import annotations

import ctypes

import llguidance as llg

# The bytes UTF-8 text can hold (0xc0, 0xc1 and 0xf5..0xff never occur in it).
UTF8_BYTES = frozenset(range(0xc0)) | frozenset(range(0xc2, 0xf5))


class Spelling:
    """The byte strings of a vocabulary's tokens (special tokens left out). Read-only
    after construction; shared by threads."""

    def __init__(self, tokenizer: llg.LLTokenizer, vocab_size: int) -> None:
        token_of: dict[bytes, int] = {}
        for t in range(min(vocab_size, tokenizer.vocab_size)):
            if not tokenizer.is_special_token(t):
                data = tokenizer.decode_bytes([t])
                if data:
                    token_of.setdefault(data, t)
        self.token_of = token_of                              # bytes -> a token id
        self.held = frozenset(b for data in token_of for b in data)
        self.single = frozenset(data[0] for data in token_of if len(data) == 1)
        self.max_len = max(map(len, token_of), default=1)
        self.complete = UTF8_BYTES <= self.single

    def spells(self, data: bytes) -> bool:
        """True when some sequence of tokens spells exactly `data`."""
        if all(b in self.single for b in data):
            return True
        if any(b not in self.held for b in data):
            return False
        reach = [True] + [False] * len(data)       # reach[i]: data[:i] is spelled
        for i in range(len(data)):
            if reach[i]:
                for k in range(1, min(self.max_len, len(data) - i) + 1):
                    if data[i:i + k] in self.token_of:
                        reach[i + k] = True
        return reach[-1]

    def unheld(self, data: bytes) -> int | None:
        """The first byte of `data` no token holds (None: every byte is in some)."""
        return next((b for b in data if b not in self.held), None)

    def needs_repair(self, forced: bytes) -> bool:
        return any(b not in self.single for b in forced)

    def repair(self, matcher: llg.LLMatcher, forced: bytes, address: int,
               row_bytes: int, eos_token_ids: tuple[int, ...]) -> int:
        """Rewrite the mask row of `matcher` at `address` (`row_bytes` bytes, bit t =
        token t) so that it allows exactly the tokens the parser accepts among those it
        allowed and those spelling a prefix of `forced` (the bytes the grammar forces
        next), never EOS (llguidance allows it, and its parser accepts it, where no token
        spells the forced bytes: the output would end short of the grammar). Returns the
        number of tokens allowed. Reads the matcher only."""
        words = (ctypes.c_uint32 * (row_bytes // 4)).from_address(address)
        allowed = {32 * w + bit for w, word in enumerate(words) if word
                   for bit in range(32) if word >> bit & 1}
        for k in range(1, min(len(forced), self.max_len) + 1):
            t = self.token_of.get(forced[:k])
            if t is not None:
                allowed.add(t)
        allowed = {t for t in allowed.difference(eos_token_ids)
                   if matcher.validate_tokens([t]) == 1}
        ctypes.memset(address, 0, row_bytes)
        for t in allowed:
            words[t // 32] |= 1 << (t % 32)
        return len(allowed)
