"""`--deterministic`: a request's tokens and log-probabilities are bit-identical however
the engine batches, chunks, caches, preempts or speculates (docs/deterministic.md). Tiny
random checkpoints on the low-bit path (int4, and int8 on Gemma 3's sliding window and
Qwen3-MoE's routed experts) and on float32; every mode's logprobs compared as floats,
exactly, against the one-prompt-at-a-time run."""
from __future__ import annotations

import pytest

from test_equivalence import _engine, _prompts
from tiny_families import make_family_checkpoint
from duetserve.config import UNBOUNDED_ROWS, ConfigError, EngineConfig
from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _run(llm, prompts, one_at_a_time: bool = False):
    """Per prompt: (token ids, [(token, logprob) of the top 2 at each position])."""
    outs = [llm.generate([p], SP)[0] for p in prompts] if one_at_a_time else \
        llm.generate(prompts, SP)
    return [(o.outputs[0].token_ids,
             [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("variant,quant", [("llama-gqa-untied", "int4"),
                                           ("llama-gqa-tied", "none"),
                                           ("gemma3", "int8"), ("qwen3_moe", "int8")])
def test_deterministic_outputs_whatever_the_batch(tiny_checkpoints, tmp_path, variant, quant):
    if variant in tiny_checkpoints:
        path = tiny_checkpoints[variant]
    else:
        path = make_family_checkpoint(str(tmp_path / variant), variant)
    loaded = load_model(path, quantization=quant, deterministic=True)
    if quant != "none":
        assert loaded.kernel_policy.lowbit_max_rows == UNBOUNDED_ROWS
    every = _prompts(loaded.config.vocab_size, seed=3)
    prompts = every[2:6] + every[8:12]       # 17-64 tokens, and four sharing 70 (71-83)

    def engine(**opts):      # one block size (the attention sums block by block)
        return _engine(loaded, deterministic=True, quantization=quant, block_size=8, **opts)
    base = _run(engine(), prompts, one_at_a_time=True)
    assert _run(engine(), prompts) == base                                   # batched
    chunked = engine(max_num_batched_tokens=16)
    steps = []
    chunked.engine.add_step_observer(steps.append)
    assert _run(chunked, prompts) == base                                    # chunked, mixed
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)
    cached = engine()
    _run(cached, [every[12]])                  # the shared prefix, cached
    assert _run(cached, prompts) == base                                     # prefix hits
    assert cached.engine.scheduler.make_stats().prefix_cache_hits > 0
    groups = len(loaded.config.kv_groups())
    short = [i for i, p in enumerate(prompts) if len(p) <= 64]     # 76 tokens at most
    small = engine(num_gpu_blocks_override=11 * groups)            # 88 tokens a group
    assert _run(small, [prompts[i] for i in short]) == [base[i] for i in short]   # preempted
    assert small.engine.scheduler.num_preemptions > 0
    spec = engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert _run(spec, prompts) == base                                       # speculative


def test_deterministic_lays_every_prompt_token_out_as_a_decode_row(tiny_checkpoints):
    """The runner's rows bound is lifted: a 300-token prompt is 300 decode rows."""
    from duetserve.worker.batch import build_step_batch, SeqWork
    path = tiny_checkpoints["llama-gqa-untied"]
    llm = _engine(load_model(path, quantization="int4", deterministic=True),
                  deterministic=True, quantization="int4")
    runner = llm.engine.runner
    assert runner.chunk_rows == UNBOUNDED_ROWS
    work = [SeqWork("a", list(range(3, 303)), 0, list(range(19)), True)]
    batch = build_step_batch(work, 16, "cpu", runner.paged_decode, runner.kv_windows,
                             runner.chunk_rows)
    assert not batch.meta.prefills and len(batch.meta.decode_context_lens) == 300
    assert batch.meta.decode_context_lens.tolist() == list(range(1, 301))


def test_deterministic_needs_the_native_kernels():
    with pytest.raises(ConfigError, match="deterministic needs the native kernels"):
        EngineConfig(deterministic=True, native_kernels=False)
