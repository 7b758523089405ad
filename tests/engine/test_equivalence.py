"""Greedy outputs are identical however the engine batches, chunks, caches or preempts,
and identical to transformers; on a tiny random model and on the default model."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.errors import RequestError
from duetserve.loader import load_model
from duetserve.models import attention
from duetserve.sampling_params import SamplingParams
from pinned import pinned_step_time

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of varied lengths; 8 share a 70-token prefix."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, vocab - 3, (n,), generator=g).tolist()  # noqa: E731
    prefix = rand(70)
    lengths = [3, 9, 17, 33, 50, 64, 81, 120]
    return [rand(n) for n in lengths] + [prefix + rand(n) for n in (1, 2, 5, 13, 16, 30, 47, 60)]


def _engine(loaded, **opts) -> LLM:
    cfg = EngineConfig(model=loaded.path, num_threads=2, step_time=pinned_step_time(),
                       check_integrity_when_idle=True, **opts)
    return LLM.from_engine(EngineCore(cfg, loaded=loaded))


def _run_all(llm: LLM, prompts, one_at_a_time: bool = False) -> list[list[int]]:
    if one_at_a_time:
        return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _check_all_modes(loaded, prompts, hf_model, small_blocks: int = 40) -> None:
    base = _run_all(_engine(loaded, max_num_batched_tokens=4096), prompts)
    assert all(len(t) == MAX_TOKENS for t in base)
    # (b) one prompt at a time
    assert _run_all(_engine(loaded), prompts, one_at_a_time=True) == base
    # (c) a tiny token budget forces chunked prefill (and mixed steps)
    chunked = _engine(loaded, max_num_batched_tokens=32)
    steps = []
    chunked.engine.add_step_observer(steps.append)
    assert _run_all(chunked, prompts) == base
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)   # mixed steps
    assert max(s.num_tokens for s in steps) <= 32
    assert any(s.num_tokens == 32 and s.num_prefill_tokens for s in steps)   # budget full
    # (c') the same with every chunk after a cached prefix on the two-part flash path
    with mock.patch.object(attention, "GROUPED_MAX_SCORES", 0):
        assert _run_all(_engine(loaded, max_num_batched_tokens=32), prompts) == base
    # (d) prefix caching off (on is the default, used above) — and on with hits
    assert _run_all(_engine(loaded, enable_prefix_caching=False), prompts) == base
    cached = _engine(loaded)
    _run_all(cached, prompts[8:9])                       # warm the shared prefix
    assert _run_all(cached, prompts) == base
    assert cached.engine.scheduler.make_stats().prefix_cache_hits > 0
    # (e) a KV cache so small that requests are preempted and recomputed
    small = _engine(loaded, num_gpu_blocks_override=small_blocks, block_size=8)  # 320 tokens
    assert _run_all(small, prompts) == base
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.scheduler.kv_cache_manager.num_used_blocks == 0
    # and transformers' greedy choice, up to its first eos (where its generate() stops)
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for p, ours in zip(prompts, base):
        n = next((i + 1 for i, t in enumerate(ours) if t in eos), len(ours))
        assert _hf_greedy(hf_model, p, ours[:n]) == ours[:n]


def _hf_greedy(hf_model, prompt: list[int], ours: list[int]) -> list[int]:
    """transformers' argmax after the prompt and after each prefix of `ours`, from one
    forward pass over prompt + ours: equal to `ours` exactly when transformers' greedy
    generate() from the prompt gives `ours` (each of its steps takes the argmax after the
    tokens before), at one pass per prompt instead of one per token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ours])).logits[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(ours)].argmax(-1).tolist()


def test_tiny_model_all_modes(tiny_checkpoints):
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoints["llama-gqa-untied"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = load_model(path)
    _check_all_modes(loaded, _prompts(loaded.config.vocab_size), hf)


def test_default_model_all_modes(default_model, hf_default_model):
    _check_all_modes(default_model, _prompts(default_model.config.vocab_size, seed=1),
                     hf_default_model)


def test_too_long_prompt_rejected_without_disturbing_others(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama-gqa-tied"])
    llm = _engine(loaded, max_model_len=64)
    eng = llm.engine
    eng.add_request("ok", list(range(5, 25)), GREEDY)
    with pytest.raises(RequestError, match="limit is 63.*max_model_len 64"):
        eng.add_request("long", list(range(3, 100)), GREEDY)
    small = _engine(loaded, num_gpu_blocks_override=4, block_size=4).engine   # 16 tokens
    with pytest.raises(RequestError, match="KV cache 16 tokens"):
        small.add_request("huge", list(range(3, 40)), GREEDY)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"]
    assert len(outs[-1].outputs[0].token_ids) == MAX_TOKENS
    assert eng.scheduler.kv_cache_manager.num_used_blocks == 0
