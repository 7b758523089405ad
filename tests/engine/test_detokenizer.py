"""IncrementalDetokenizer on a small byte-level BPE trained here (no model files).
Token-level stops (eos, stop ids, max_tokens) live in the scheduler: tests/core."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from duetserve.engine.detokenizer import IncrementalDetokenizer
from duetserve.sampling_params import SamplingParams

SENTENCES = ["héllo 世界 🙂 hello world", "the quick brown fox jumps over the lazy dog",
             "hello hello world, stop here. STOP now!", "naïve café déjà vu 😀 😀",
             "world peace and hello again"] * 3
TEXT = "héllo 世界 🙂, hello world! STOP here"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(SENTENCES, trainer)
    return tokenizer


def stream(tok: Tokenizer, ids: list[int], chunk: int = 1, prompt: str = PROMPT,
           **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` `chunk` at a time; flush if no stop string ended it. Returns deltas."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt).ids, **kwargs)
    deltas = []
    for i in range(0, len(ids), chunk):
        delta = detok.add_tokens(ids[i:i + chunk])
        if delta is not None:
            deltas.append(delta)
        if detok.finished:
            break
    if not detok.finished:
        last = detok.flush()
        if last is not None:
            deltas.append(last)
    return detok, deltas


def test_tokenizer_splits_multibyte_characters(tok: Tokenizer) -> None:
    # Precondition of the tests below: some tokens hold only part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in tok.encode(TEXT).ids)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_never_printed_half(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(TEXT).ids
    detok, deltas = stream(tok, ids, chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert detok.stop_reason is None


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("hello world").ids + [tok.token_to_id("<eos>")]
    assert "".join(stream(tok, ids)[1]) == "hello world"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[1]) == "hello world<eos>"


def test_stop_string_spanning_tokens_removed(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT).ids
    pieces = [tok.decode([i]) for i in ids]
    assert "STOP" not in pieces                       # the stop spans a token boundary
    detok, deltas = stream(tok, ids, stop=("STOP",))
    want = TEXT[:TEXT.index("STOP")]
    assert detok.finished and detok.stop_reason == "STOP"
    assert "".join(deltas) == want
    assert detok.add_tokens(ids[:1]) is None and detok.flush() is None   # stays finished


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT).ids
    detok, deltas = stream(tok, ids, stop=("zzz", "STOP"), include_stop_str_in_output=True)
    assert "".join(deltas) == TEXT[:TEXT.index("STOP") + 4]
    assert detok.stop_reason == "STOP"


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    detok, deltas = stream(tok, tok.encode(TEXT).ids, stop=("界 🙂",))
    assert "".join(deltas) == "héllo 世" and detok.stop_reason == "界 🙂"


def test_no_stop_text_leaks_while_streaming(tok: Tokenizer) -> None:
    """At every step the emitted text is a prefix of the final text and never ends with
    a proper prefix of a stop string (that part is held back until resolved)."""
    stops = ("here!", "world?", "世界 🙂!")             # prefixes occur, full strings never
    ids = tok.encode(TEXT).ids
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    emitted = ""
    for token_id in ids:
        emitted += detok.add_tokens([token_id]) or ""
        assert TEXT.startswith(emitted)
        for s in stops:
            assert not any(emitted.endswith(s[:k]) for k in range(1, len(s)))
    assert not detok.finished and emitted == TEXT[:-4]   # "here" held back...
    emitted += detok.flush() or ""
    assert emitted == TEXT and detok.finished        # ...until the end


def test_stop_emitted_text_is_cut_exactly(tok: Tokenizer) -> None:
    text = "hello world, stop here. STOP now!"
    ids = tok.encode(text).ids
    for stop in ("stop", "o w", ". S", "now!", "h"):
        detok, deltas = stream(tok, ids, stop=(stop,))
        assert "".join(deltas) == text[:text.index(stop)], stop
        assert detok.stop_reason == stop


def test_prompt_context_does_not_leak_into_output(tok: Tokenizer) -> None:
    ids = tok.encode(" jumps over").ids
    detok, deltas = stream(tok, ids, prompt="the quick brown fox")
    assert "".join(deltas) == " jumps over"


def test_first_completed_stop_wins_whatever_the_chunking(tok: Tokenizer) -> None:
    text = "hello world, stop here. STOP now!"
    ids = tok.encode(text).ids
    for chunk in (1, 4, len(ids)):
        detok, deltas = stream(tok, ids, chunk, stop=("stop here", "stop h", "world, st"))
        assert detok.stop_reason == "world, st" and "".join(deltas) == "hello "
        detok, deltas = stream(tok, ids, chunk, stop=("stop here", "stop h"))
        assert detok.stop_reason == "stop h" and "".join(deltas) == "hello world, "


def test_state_stays_bounded_over_a_long_output(tok: Tokenizer) -> None:
    """Two thousand tokens later the detokenizer holds a window of a few tokens and no
    emitted text: its work per token does not grow with the output."""
    ids = tok.encode(TEXT).ids * 100
    assert len(ids) >= 2000
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, stop=("STOP!",))
    sizes, deltas = [], []
    for token_id in ids:
        deltas.append(detok.add_tokens([token_id]) or "")
        sizes.append((len(detok._token_ids), len(detok._pending)))
    assert max(n for n, _ in sizes) <= 8 and max(c for _, c in sizes) <= 8
    assert "".join(deltas) + (detok.flush() or "") == TEXT * 100
