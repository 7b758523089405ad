"""Constraints on a vocabulary that lacks some bytes (issue 63: SmolLM2 has no token with
byte 0xf2, and a guided_choice holding U+8892E made the mask allow a token the parser
then rejected). A byte tokenizer without the tokens of 0x04 and 0xf2 but with one token
for 0xf2 0x88: what it cannot write is refused at compile time, every token a mask
allows is one the parser accepts, and a grammar no token can continue fails with an
error naming its field. No model, no torch."""
from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from duetserve.errors import RequestError
from duetserve.sampling_params import GuidedDecoding
from duetserve.structured import GrammarCompiler, ConstraintError

VOCAB = 300
EOS = 299
MISSING = (0x04, 0xf2)
F2_88 = "\U0008892e".encode()[:2]          # b"\xf2\x88": one token of its own


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character map (byte-level BPE vocabularies are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return out


def holey_tokenizer():
    """One token per byte except 0x04 and 0xf2; one token for 0xf2 0x88; filler, then
    <s> and </s> (the last two ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    chars = _byte_chars()
    vocab = {chars[b]: i for i, b in enumerate(b for b in range(256) if b not in MISSING)}
    vocab["".join(chars[b] for b in F2_88)] = len(vocab)
    for i in range(len(vocab), VOCAB - 2):
        vocab[f"<x{i}>"] = i
    vocab["<s>"], vocab["</s>"] = VOCAB - 2, VOCAB - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(holey_tokenizer().to_str, VOCAB, (EOS,))


def allowed(compiler: GrammarCompiler, state) -> list[int]:
    """The tokens the compiler's mask (fill_bitmasks, as the runner fills it) allows."""
    row_bytes = (VOCAB + 31) // 32 * 4
    buf = (ctypes.c_uint8 * row_bytes)()
    compiler.fill_bitmasks([state], [0], ctypes.addressof(buf), row_bytes, 1)
    bits = np.unpackbits(np.frombuffer(bytes(buf), dtype=np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[:VOCAB])]


def choice(*texts: str) -> GuidedDecoding:
    return GuidedDecoding("choice", json.dumps(list(texts), ensure_ascii=False),
                          "guided_choice")


def test_the_vocabulary_is_read_as_it_is(compiler) -> None:
    sp = compiler.spelling
    assert not sp.complete
    assert sp.single.isdisjoint(MISSING) and 0xf2 in sp.held and 0x04 not in sp.held
    assert sp.spells("\U0008892e".encode()) and sp.spells(b"abc")
    assert not sp.spells(b"\xf2\xa4") and not sp.spells(b"a\x04")


@pytest.mark.parametrize("guided,words", [
    (choice("ok", "a\x04b"), ["choice 1", "'a\\x04b'", "byte 0x04"]),
    (choice("\U000b0000"), ["choice 0", "no sequence of its tokens"]),      # f2 b0 80 80
    (GuidedDecoding("regex", "x\x04y|x\x04z", "guided_regex"), ["starts with", "0x04"]),
    (GuidedDecoding("json", json.dumps({"const": "\x04"}), "guided_json"), []),
])
def test_what_the_tokens_cannot_write_is_refused(compiler, guided, words) -> None:
    if not words:      # JSON writes 0x04 as an escape: nothing to refuse
        compiler.compile(guided)
        return
    with pytest.raises(RequestError) as e:
        compiler.compile(guided)
    assert e.value.param == guided.param
    assert all(w in e.value.message for w in words), e.value.message


@pytest.mark.parametrize("guided", [
    choice("a\U0008892e!", "b\U0008892e\U0008892e", "\U0008892e"),
    choice("\f}\u00dbq\n\U0008892e\x1b"),         # issue 63's choice, writable here
    GuidedDecoding("regex", "(\U0008892e|[a-c]){1,6}", "guided_regex"),
    GuidedDecoding("json", json.dumps({"enum": ["\U0008892e", "x\U0008892e"]}), "guided_json"),
])
def test_every_token_a_mask_allows_is_accepted(compiler, guided) -> None:
    """Random walks through the masks: every allowed token (all of them, at each step)
    is one the parser accepts, and each walk ends with EOS."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        state = compiler.new_state(guided)
        for _ in range(64):
            tokens = allowed(compiler, state)
            assert tokens, "an empty mask on a writable grammar"
            assert all(state.matcher.deep_copy().consume_token(t) for t in tokens)
            token = int(rng.choice(tokens))
            state.accept(token)
            if token == EOS:
                break
        assert token == EOS


def test_a_grammar_no_token_can_continue_fails_naming_its_field(compiler) -> None:
    guided = GuidedDecoding("regex", "a\x04|b\x04", "guided_regex")
    compiler.compile(guided)                 # a and b can start it
    state = compiler.new_state(guided)
    state.accept(allowed(compiler, state)[0])
    with pytest.raises(ConstraintError) as e:
        allowed(compiler, state)
    assert e.value.param == "guided_regex"
    assert "byte 0x04" in e.value.message and "after 1 tokens" in e.value.message
