"""GrammarMasker and the sampler with grammar rows, on bare tensors (byte tokenizer)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import byte_tokenizer

from duetserve.sampling_params import GuidedDecoding, SamplingParams
from duetserve.structured import GrammarCompiler
from duetserve.worker.grammar_mask import GrammarMasker
from duetserve.worker.model_runner import RunnerRequestState
from duetserve.worker.sampling import StepSampler

VOCAB, EOS = 300, 299
TOK = byte_tokenizer(VOCAB)
DIGITS = GuidedDecoding("regex", "[0-9]{2}", "guided_regex")
ENUM = GuidedDecoding("json", json.dumps({"enum": ["cat", "dog"]}), "guided_json")


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOK.to_str, VOCAB, (EOS,), num_threads=2)


def reference_allowed(state) -> torch.Tensor:
    """llguidance's own bitmask, unpacked with numpy."""
    words = np.frombuffer(state.matcher.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(words, bitorder="little")[:VOCAB].astype(bool))


def test_allowed_matches_llguidance(compiler) -> None:
    masker = GrammarMasker(compiler, VOCAB)
    states = [compiler.new_state(g) for g in (DIGITS, ENUM, DIGITS)]
    states[2].accept_all(TOK.encode("12").ids)          # complete: only EOS
    allowed = masker.allowed(states)
    assert allowed.shape == (3, VOCAB)
    for row, st in enumerate(states):
        assert torch.equal(allowed[row], reference_allowed(st))
    assert allowed[0].sum() == 10 and allowed[2].nonzero().flatten().tolist() == [EOS]
    assert set(allowed[1].nonzero().flatten().tolist()) == {TOK.encode('"').ids[0]}


def test_apply_masks_only_constrained_rows(compiler) -> None:
    masker = GrammarMasker(compiler, VOCAB)
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    state = compiler.new_state(DIGITS)
    masker.apply(logits, [2], [state])
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]])
    allowed = reference_allowed(state)
    assert torch.equal(logits[2][allowed], before[2][allowed])
    assert torch.isneginf(logits[2][~allowed]).all()
    assert masker.num_masked_rows == 1


def _state(req_id: str, params: SamplingParams, grammar) -> RunnerRequestState:
    return RunnerRequestState(req_id, [1, 2, 3], 3, params, [], 0, grammar=grammar)


def test_sampler_picks_only_allowed_tokens(compiler) -> None:
    masker = GrammarMasker(compiler, VOCAB)
    sampler = StepSampler(VOCAB, (EOS,), "cpu", masker)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    hot = SamplingParams(temperature=5.0, max_tokens=8, seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        digits = [compiler.new_state(DIGITS), compiler.new_state(DIGITS)]
        states = [_state("a", greedy, digits[0]), _state("b", greedy, None),
                  _state("c", hot, digits[1])]
        logits = torch.randn(3, VOCAB, generator=g)
        free_argmax = int(logits[1].argmax())
        allowed = reference_allowed(digits[0])
        best_allowed = int(torch.where(allowed, logits[0], -torch.inf).argmax())
        tokens, _ = sampler.sample(logits, states)
        assert tokens[0] == best_allowed              # greedy: the best allowed token
        assert tokens[1] == free_argmax               # unconstrained row untouched
        assert TOK.decode([tokens[2]]).isdigit()      # hot, seeded: still a digit


def test_sampler_without_grammar_rows_never_masks(compiler) -> None:
    masker = GrammarMasker(compiler, VOCAB)
    sampler = StepSampler(VOCAB, (EOS,), "cpu", masker)
    logits = torch.randn(2, VOCAB)
    states = [_state("a", SamplingParams(temperature=0.0), None)] * 2
    assert sampler.sample(logits, states)[0] == logits.argmax(dim=-1).tolist()
    assert masker.num_masked_rows == 0


def test_prefetched_masks_equal_synchronous_ones(compiler) -> None:
    masker = GrammarMasker(compiler, VOCAB)
    states = [compiler.new_state(g) for g in (DIGITS, ENUM)]
    sync = masker.allowed(states)
    masker.prefetch(states)
    assert torch.equal(masker.allowed(states), sync)
    other = [compiler.new_state(ENUM)]
    masker.prefetch(states)                 # prefetched for other states: filled again
    assert torch.equal(masker.allowed(other), sync[1:])
