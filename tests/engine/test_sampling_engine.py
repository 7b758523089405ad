"""Sampling as OpenAI clients expect, end to end on the default model."""
from __future__ import annotations

import pytest
import torch

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.sampling_params import SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    # an explicit budget: the tests below count what one step schedules
    cfg = EngineConfig(model=default_model.path, num_threads=2, kv_cache_memory=0.5,
                       max_num_batched_tokens=2048, check_integrity_when_idle=True)
    return LLM.from_engine(EngineCore(cfg, loaded=default_model))


def test_seed_same_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=1.2, top_k=20, max_tokens=20),
              SamplingParams(temperature=0.7, min_p=0.1, seed=7, max_tokens=9),
              SamplingParams(temperature=1.0, presence_penalty=1.0, max_tokens=16),
              SamplingParams(temperature=0.5, frequency_penalty=0.5, seed=3, max_tokens=5),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, max_tokens=16),
              SamplingParams(temperature=0.8, top_p=0.5, logprobs=3, max_tokens=16),
              SamplingParams(temperature=0.0, logit_bias={28: 5.0}, max_tokens=16)]
    prompts = ["Once upon a time", "def main():", PROMPT, "1, 2, 3,", "Hello", "The sky",
               "In 1492", "Cats are"]
    outs = llm.generate(prompts[:4] + [PROMPT] + prompts[4:], others[:4] + [seeded] + others[4:])
    assert outs[4].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16,
                                ignore_eos=True)
    assert llm.generate([PROMPT], other_seed)[0].outputs[0].token_ids != alone


def test_greedy_logprobs_match_transformers(llm, hf_default_model):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, logprobs=5, max_tokens=12,
                                                ignore_eos=True))[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    lps = out.outputs[0].logprobs
    assert len(lps) == 12
    for i, (tok, entry) in enumerate(zip(out.outputs[0].token_ids, lps)):
        row = ref[n_prompt - 1 + i]
        assert entry[tok].rank == 1
        assert abs(entry[tok].logprob - float(row[tok])) < 1e-4
        top = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert len(entry) == 5      # the chosen token is also the most likely one
        for lp in top:
            assert lp.logprob <= entry[tok].logprob + 1e-6


def test_stop_string_spanning_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    full = llm.generate([PROMPT], greedy)[0].outputs[0]
    assert full.text.startswith(" Paris.")        # tokens " Paris" + "."
    cut = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16,
                                                stop=["s."]))[0].outputs[0]
    assert cut.text == " Pari" and cut.finish_reason == "stop" and cut.stop_reason == "s."
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop=["s."],
                                                 include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == " Paris."
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_min_tokens_suppresses_eos_and_stop_ids(llm):
    eos = llm.engine.eos_token_ids
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 40   # eos comes early
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48,
                                                 min_tokens=40))[0].outputs[0]
    assert len(held.token_ids) >= 40
    assert not any(t in eos for t in held.token_ids[:39])
    first = plain.token_ids[1]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16,
                                                    stop_token_ids=[first]))[0].outputs[0]
    assert stopped.stop_reason == first and len(stopped.token_ids) == 2
    later = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, min_tokens=5,
                                                  stop_token_ids=[first]))[0].outputs[0]
    assert len(later.token_ids) >= 5


def test_n4_shares_prompt_blocks_and_samples_differ(llm):
    eng = llm.engine
    prompt = llm.tokenizer.encode("word " * 500)[:500]
    assert len(prompt) == 500
    eng.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=5,
                                                 ignore_eos=True))
    eng.step()
    bs = eng.config.block_size
    full, tail = divmod(500, bs)                       # 31 full blocks + a 4-token tail
    assert eng.last_step.num_prefill_tokens == 500 + 3 * (500 - full * bs)
    # the prompt's full blocks once, plus one tail block per sample
    assert eng.scheduler.kv_cache_manager.num_used_blocks == full + 4
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    samples = [c.token_ids for c in outs[-1].outputs]
    assert len(samples) == 4 and all(len(s) == 8 for s in samples)
    assert len({tuple(s) for s in samples}) == 4
    assert eng.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("budget", [2048, 4])   # whole prompt, and 4-token chunks
def test_prompt_logprobs_match_transformers(default_model, hf_default_model, budget):
    cfg = EngineConfig(model=default_model.path, num_threads=2, kv_cache_memory=0.2,
                       max_num_batched_tokens=budget, check_integrity_when_idle=True)
    llm = LLM.from_engine(EngineCore(cfg, loaded=default_model))
    llm.generate([PROMPT + " Paris"], SamplingParams(temperature=0, max_tokens=1))  # cache it
    out = llm.generate([PROMPT + " Paris"], SamplingParams(temperature=0, max_tokens=2,
                                                           prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    assert out.num_cached_tokens == 0     # no prefix hits when prompt logprobs are asked
    with torch.no_grad():
        ref = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert abs(entry[ids[p]].logprob - float(ref[p - 1, ids[p]])) < 1e-4
        assert len([t for t in entry if t != ids[p]]) <= 3
