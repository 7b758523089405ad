"""Speculative decoding end to end: greedy outputs identical to speculation off (n-gram
and draft model; one batch, one at a time, chunked, prefix-cached, preempted), the
sampled distribution unchanged (chi-square), bookkeeping, vocabulary check, config.

Kernel paths: on the tiny float32 models every step runs float32 kernels; on the default
(Q4_1) model both runs of a comparison pin `lowbit_max_rows` high, so every linear runs
the row-independent low-bit kernel whatever the step's row count (a verify step has k+1
rows per request; with the calibrated limit it could switch to the dense GEMM, whose
different rounding could flip a near-tie: a kernel-path difference, not speculation's).
Verify rows are laid out as decode rows, so attention runs the same paged kernel too.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from duetserve.config import ConfigError, EngineConfig, SpeculativeConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.errors import CheckpointError
from duetserve.loader import load_model
from duetserve.models.quant import QuantLinear
from duetserve.sampling_params import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from engine.test_equivalence import _prompts  # noqa: E402
from spec_decode.test_rejection import chi2_critical  # noqa: E402
from pinned import pinned_step_time

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "adaptive": False}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(tiny_checkpoints["llama-gqa-untied"])


@pytest.fixture(scope="module")
def draft_path(tiny_checkpoints, tmp_path_factory) -> str:
    """The tiny target with noise on its weights: same tokenizer, a different but related
    distribution (some drafts accepted, some rejected)."""
    from transformers import AutoModelForCausalLM
    src = tiny_checkpoints["llama-gqa-untied"]
    dst = str(tmp_path_factory.mktemp("draft"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.08)
    model.save_pretrained(dst)
    shutil.copy(os.path.join(src, "tokenizer.json"), dst)
    return dst


def _llm(loaded, spec=None, **opts) -> LLM:
    cfg = EngineConfig(model=loaded.path, num_threads=2, speculative_config=spec,
                       step_time=pinned_step_time(), check_integrity_when_idle=True, **opts)
    return LLM.from_engine(EngineCore(cfg, loaded=loaded))


def _run(llm: LLM, prompts, one_at_a_time: bool = False) -> list[list[int]]:
    if one_at_a_time:
        return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _check_clean(llm: LLM) -> None:
    """Every block free, pool and tables consistent, counters add up."""
    sched = llm.engine.scheduler
    sched.check_integrity()
    assert sched.kv_cache_manager.num_used_blocks == 0
    spec = sched.make_stats().spec
    assert spec.num_drafts > 0 and 0 <= spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-subset"])
def test_tiny_greedy_identical_in_every_mode(tiny, draft_path, method) -> None:
    """draft-subset: the draft proposes only ids < 150 of the tiny vocabulary's 300."""
    spec = NGRAM if method == "ngram" else {
        "method": "draft", "model": draft_path, "num_speculative_tokens": 3,
        "adaptive": False, "draft_vocab_size": 150 if method == "draft-subset" else None}
    prompts = _prompts(tiny.config.vocab_size)
    base = _run(_llm(tiny, max_num_batched_tokens=4096), prompts)
    one_batch = _llm(tiny, spec, max_num_batched_tokens=4096)
    assert _run(one_batch, prompts) == base
    _check_clean(one_batch)
    spec_stats = one_batch.engine.scheduler.make_stats().spec
    if method != "ngram":   # both outcomes of verification happen (n-gram drafts from a
        # random model's tokens are almost never right: accepted ones are tested on the
        # default model below)
        assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    assert _run(_llm(tiny, spec), prompts[:6], one_at_a_time=True) == base[:6]
    chunked = _llm(tiny, spec, max_num_batched_tokens=32)
    steps = []
    chunked.engine.add_step_observer(steps.append)
    assert _run(chunked, prompts) == base
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)   # mixed
    _check_clean(chunked)
    cached = _llm(tiny, spec)
    _run(cached, prompts[8:9])
    assert _run(cached, prompts) == base
    assert cached.engine.scheduler.make_stats().prefix_cache_hits > 0
    _check_clean(cached)
    small = _llm(tiny, spec, num_gpu_blocks_override=40, block_size=8)
    assert _run(small, prompts) == base
    assert small.engine.scheduler.num_preemptions > 0
    _check_clean(small)


def test_tiny_adaptive_identical(tiny) -> None:
    prompts = _prompts(tiny.config.vocab_size)[:8]
    base = _run(_llm(tiny, max_num_batched_tokens=4096), prompts)
    llm = _llm(tiny, {**NGRAM, "adaptive": True}, max_num_batched_tokens=4096)
    assert _run(llm, prompts) == base
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def _lowbit_policies(model) -> dict:
    return {id(m.policy): m.policy for m in model.modules() if isinstance(m, QuantLinear)}


@pytest.fixture
def pinned_lowbit(default_model):
    """Every low-bit linear of the default model takes the low-bit kernel at any row
    count for the test's duration (restored after: the model is shared)."""
    policies = _lowbit_policies(default_model.model)
    saved = {k: p.lowbit_max_rows for k, p in policies.items()}
    for p in policies.values():
        p.lowbit_max_rows = 1 << 20
    yield default_model
    for k, p in policies.items():
        p.lowbit_max_rows = saved[k]


def _own_draft(loaded, path: str) -> LLM:
    """The default checkpoint drafting for itself, packed as the file is ("auto": the
    default int4 would requantize its 8-bit embedding/head, a different model), its
    low-bit linears pinned to the low-bit kernel at any row count: which steps would
    otherwise run them as dense bf16 GEMMs is measured per machine at load, and the
    draft's numbers (so the drafts kept) would change with it."""
    llm = _llm(loaded, {"method": "draft", "model": path, "num_speculative_tokens": 3,
                        "adaptive": False, "quantization": "auto"},
               max_num_batched_tokens=4096)
    for p in _lowbit_policies(llm.engine.runner.speculator.draft.model).values():
        p.lowbit_max_rows = 1 << 20
    return llm


def test_default_model_greedy_identical(pinned_lowbit, default_model_path) -> None:
    loaded = pinned_lowbit
    tok = loaded.tokenizer
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "The capital of France is",
             "1, 2, 3, 4, 5,", "Write a haiku about the sea.", "Hello, my name is",
             "for i in range(10):\n", "Repeat after me: the quick brown fox. The quick",
             "Q: What is 2+2?\nA:"] * 2
    prompts = [tok.encode(t) for t in texts]
    prompts = [p + p[-3:] if i >= 8 else p for i, p in enumerate(prompts)]   # 16 distinct
    base = _run(_llm(loaded, max_num_batched_tokens=4096), prompts)
    ngram = _llm(loaded, {**NGRAM, "prompt_lookup_min": 2}, max_num_batched_tokens=4096)
    assert _run(ngram, prompts) == base
    _check_clean(ngram)
    assert ngram.engine.scheduler.make_stats().spec.num_accepted_tokens > 0
    draft = _own_draft(loaded, default_model_path)
    assert _run(draft, prompts) == base
    _check_clean(draft)
    spec = draft.engine.scheduler.make_stats().spec
    # its own draft: most drafts kept (0.91-0.92 on the EPYC, 0.77 on a Xeon with AMX,
    # before and after the AMX kernels; the draft runs int8 activations against the
    # float32 target, so not all)
    assert spec.num_accepted_tokens > 0.7 * spec.num_draft_tokens


def _joint_counts(llm: LLM, prompt: list[int], seeds: list) -> dict[tuple, int]:
    """seeds: one per sample (None: unseeded, the global RNG)."""
    params = [SamplingParams(temperature=1.3, top_k=4, top_p=0.9, max_tokens=4,
                             ignore_eos=True, seed=s) for s in seeds]
    counts: dict[tuple, int] = {}
    for out in llm.generate([prompt] * len(params), params):
        t = out.outputs[0].token_ids
        counts[(t[0], t[1])] = counts.get((t[0], t[1]), 0) + 1
        counts[("2-3", t[1], t[2])] = counts.get(("2-3", t[1], t[2]), 0) + 1
    return counts


CHI_N = 1500                       # seeded samples per run
CHI_OPTS = dict(max_num_batched_tokens=4096, max_num_seqs=256, max_waiting_requests=0)


@pytest.fixture(scope="module")
def off_counts(tiny):
    return _joint_counts(_llm(tiny, **CHI_OPTS), [117], list(range(CHI_N)))


@pytest.mark.parametrize("subset", [False, True])
def test_sampled_distribution_unchanged_chi_square(tiny, draft_path, off_counts,
                                                   subset) -> None:
    """Two-sample chi-square (homogeneity) on the joint distribution of generated tokens
    (1, 2) and, separately, (2, 3), with and without a draft model whose distribution
    differs from the target's; 1500 samples each (seeded without speculation, unseeded
    with it: rejection sampling; seeded ones are coupled, tested exactly by
    test_seeded_tokens_same_with_and_without_speculation), p = 0.001 per table. A one-token
    prompt keeps every step a batch of single-token rows (fast). subset: the draft
    proposes only ids below the median id of the common first tokens (q = 0 for the
    others), and the target's tokens above it still come out as often as without
    speculation."""
    n, off = CHI_N, off_counts
    draft_vocab_size = None
    if subset:
        common = sorted({k[0] for k, c in off.items() if k[0] != "2-3" and c >= 0.02 * n})
        assert len(common) >= 2, common
        draft_vocab_size = common[len(common) // 2]
    spec_llm = _llm(tiny, {"method": "draft", "model": draft_path,
                           "num_speculative_tokens": 2, "adaptive": False,
                           "draft_vocab_size": draft_vocab_size}, **CHI_OPTS)
    on = _joint_counts(spec_llm, [117], [None] * n)     # unseeded: rejection sampling
    spec = spec_llm.engine.scheduler.make_stats().spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens     # q != p really bites
    if subset:
        assert spec_llm.engine.runner.speculator.draft.num_ids == draft_vocab_size
        # the subset bites: first tokens outside it are common in the target's samples
        outside = sum(c for k, c in off.items() if k[0] != "2-3" and k[0] >= draft_vocab_size)
        assert outside > 0.1 * n, (draft_vocab_size, outside)
    for table in ("12", "23"):
        keys = [k for k in set(off) | set(on) if (k[0] == "2-3") == (table == "23")]
        # pool cells rare in both samples (expected count < 5 per sample)
        big = [k for k in keys if off.get(k, 0) + on.get(k, 0) >= 10]
        rows = [[off.get(k, 0) for k in big], [on.get(k, 0) for k in big]]
        rows[0].append(n - sum(rows[0]))
        rows[1].append(n - sum(rows[1]))
        stat = 0.0
        for j in range(len(rows[0])):
            col = rows[0][j] + rows[1][j]
            if col == 0:
                continue
            for i in range(2):
                e = col / 2          # equal sample sizes
                stat += (rows[i][j] - e) ** 2 / e
        df = len(rows[0]) - 1
        assert df >= 3 and stat < chi2_critical(df), (table, stat, df)


def _seeded(llm: LLM, prompts, temperature: float = 1.0) -> list[list[int]]:
    params = [SamplingParams(temperature=temperature, top_p=0.95, max_tokens=16,
                             ignore_eos=True, seed=s) for s in range(len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_seeded_tokens_same_with_and_without_speculation(tiny, draft_path) -> None:
    """Seeded sampled requests are verified by coupling (rejection.py): their tokens equal
    the plain run's, whatever number of drafts the adaptive policy (measured step times:
    not reproducible) verified, and whatever the batch or a preemption did."""
    prompts = _prompts(tiny.config.vocab_size)[:8]
    base = _seeded(_llm(tiny), prompts)
    assert _seeded(_llm(tiny), prompts[:1]) == base[:1]             # alone = in a batch
    spec = {"method": "draft", "model": draft_path, "num_speculative_tokens": 3}
    adaptive = _llm(tiny, spec)
    assert _seeded(adaptive, prompts) == base
    fixed = _llm(tiny, {**spec, "adaptive": False}, num_gpu_blocks_override=40, block_size=8)
    assert _seeded(fixed, prompts) == base
    assert fixed.engine.scheduler.num_preemptions > 0
    stats = fixed.engine.scheduler.make_stats().spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens   # both outcomes happen
    _check_clean(fixed)


def test_default_model_seeded_identical(pinned_lowbit, default_model_path) -> None:
    """The coupled verifier on a real model: n-gram and (its own checkpoint as) draft
    model, many drafts accepted, seeded tokens equal to the plain run's."""
    loaded = pinned_lowbit
    tok = loaded.tokenizer
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "1, 2, 3, 4, 5,",
             "Repeat after me: the quick brown fox. The quick", "for i in range(10):\n"]
    prompts = [tok.encode(t) for t in texts]
    base = _seeded(_llm(loaded, max_num_batched_tokens=4096), prompts, temperature=0.7)
    ngram = _llm(loaded, {**NGRAM, "prompt_lookup_min": 2},
                 max_num_batched_tokens=4096)
    assert _seeded(ngram, prompts, temperature=0.7) == base
    assert ngram.engine.scheduler.make_stats().spec.num_accepted_tokens > 0
    draft = _own_draft(loaded, default_model_path)
    assert _seeded(draft, prompts, temperature=0.7) == base
    spec = draft.engine.scheduler.make_stats().spec
    # its own draft: most drafts kept (0.91-0.92 on the EPYC, 0.77 on a Xeon with AMX,
    # before and after the AMX kernels; the draft runs int8 activations against the
    # float32 target, so not all)
    assert spec.num_accepted_tokens > 0.7 * spec.num_draft_tokens


def test_draft_with_another_vocabulary_is_refused(tiny, draft_path, tmp_path) -> None:
    bad = str(tmp_path / "bad")
    shutil.copytree(draft_path, bad)
    path = os.path.join(bad, "tokenizer.json")
    with open(path) as f:
        data = json.load(f)
    vocab = data["model"]["vocab"]
    name = next(k for k, v in vocab.items() if v == 270)
    vocab["<renamed>"] = vocab.pop(name)
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(CheckpointError, match="does not share the target's tokenizer"):
        _llm(tiny, {"method": "draft", "model": bad})


def test_speculative_config_parsing() -> None:
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert cfg.speculative_config == SpeculativeConfig("ngram", 2)
    old_key = SpeculativeConfig.parse({"method": "draft", "model": "m",
                                       "draft_quantization": "int8"})
    assert old_key.quantization == "int8"
    assert SpeculativeConfig("draft", model="m").quantization == "int4"
    with pytest.raises(ConfigError, match="speculative quantization"):
        SpeculativeConfig("draft", model="m", quantization="int3")
    assert SpeculativeConfig("draft", model="m").draft_vocab_size == 65536
    assert SpeculativeConfig.parse({"method": "draft", "model": "m",
                                    "draft_vocab_size": None}).draft_vocab_size is None
    with pytest.raises(ConfigError, match="draft_vocab_size must be a positive integer"):
        SpeculativeConfig("draft", model="m", draft_vocab_size=0)
    with pytest.raises(ConfigError, match="unknown speculative config key"):
        EngineConfig(speculative_config={"method": "ngram", "k": 2})
    with pytest.raises(ConfigError, match="needs \"model\""):
        SpeculativeConfig("draft")
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    from duetserve.entrypoints.engine_args import (add_engine_arguments,
                                                   engine_config_from_args)
    import argparse
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "adaptive": false}'])
    assert engine_config_from_args(args).speculative_config.adaptive is False
