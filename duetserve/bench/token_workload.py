"""The datasets of `duet bench serve` at token level, for engines driven in-process.

`duet simulate` and the in-process replay of the real engine (bench/replay.py) must see the
same requests: the same conversations (datasets.make_dataset), the same arrival times
(datasets.arrival_intervals) and the same token counts and sharing. This module is that one
conversion. Each dataset word becomes one token id (the datasets count prompt length in
words, which most tokenizers encode as about one token each), so:

  - a prompt of N words is N tokens;
  - the prefix dataset's shared words give identical leading ids (prefix caching hits);
  - a chat turn's prompt is the previous turn's prompt, the previous reply's tokens and the
    new user message, the structure `duet bench serve --dataset chat` resends (the chat
    template's few tokens per message are not modelled).

Ids lie in [id_lo, id_hi): a real model needs ordinary (non-special) ids, a tiny test model
a small range. Pure numpy; imports only the other bench data modules.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from duetserve.bench.datasets import VOCAB, Conversation, arrival_intervals

# SmolLM2 / Llama-family tokenizers keep their special tokens far below 1000.
DEFAULT_ID_RANGE = (1000, 40000)
_WORD_INDEX = {w: i for i, w in enumerate(VOCAB)}


@dataclass(frozen=True, slots=True)
class TokenTurn:
    """One turn: the new tokens this turn adds to the conversation, and max_tokens."""

    new_token_ids: tuple[int, ...]
    output_len: int


TokenConversation = list[TokenTurn]


def word_token_id(word: str, id_range: tuple[int, int] = DEFAULT_ID_RANGE) -> int:
    """The id of one dataset word: its VOCAB index (spread over the range), else a stable
    hash (JSONL prompts). Deterministic across processes (no Python hash seed)."""
    lo, hi = id_range
    index = _WORD_INDEX.get(word)
    raw = index * 7919 if index is not None else zlib.crc32(word.encode()) + len(VOCAB)
    return lo + raw % (hi - lo)


def token_conversations(convs: list[Conversation],
                        id_range: tuple[int, int] = DEFAULT_ID_RANGE) -> list[TokenConversation]:
    """Turn every dataset conversation into token turns (one id per word, at least one)."""
    out = []
    for conv in convs:
        turns = []
        for turn in conv:
            ids = tuple(word_token_id(w, id_range) for w in turn.prompt.split()) or (id_range[0],)
            turns.append(TokenTurn(ids, turn.output_len))
        out.append(turns)
    return out


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds from the start of the run at which conversation i is sent (the cumulative
    sum of `duet bench serve`'s inter-arrival gaps, same seed -> same schedule)."""
    return arrival_intervals(n, rate, burstiness, seed).cumsum()


def output_token_ids(first_id: int, n: int, id_range: tuple[int, int] = DEFAULT_ID_RANGE
                     ) -> list[int]:
    """Synthetic reply tokens for engines that generate none (the simulator): `n` ids from a
    running counter, so replies of different requests never share prefix-cache blocks."""
    lo, hi = id_range
    return [lo + (first_id + i) % (hi - lo) for i in range(n)]


def id_range_for_vocab(vocab_size: int) -> tuple[int, int]:
    """Ordinary ids of a vocabulary: DEFAULT_ID_RANGE for real tokenizers; for tiny test
    vocabularies the middle 80% (their special ids sit at the ends)."""
    if vocab_size > DEFAULT_ID_RANGE[1]:
        return DEFAULT_ID_RANGE
    return vocab_size // 10, vocab_size * 9 // 10
