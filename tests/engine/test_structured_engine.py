"""Constrained decoding through the engine on a tiny random model (byte tokenizer):
outputs follow their schema whatever the sampling, batching or preemption, and requests
without a constraint are unaffected by constrained neighbours."""
from __future__ import annotations

import json

import jsonschema
import pytest
from structured_schemas import bounded_schemas, output_bound

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.errors import RequestError
from duetserve.loader import load_model
from duetserve.sampling_params import GuidedDecoding, SamplingParams

SCHEMAS = bounded_schemas(8, seed=2, max_bound=200)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen2-qkv-bias"])


def _llm(loaded, **opts) -> LLM:
    cfg = EngineConfig(model=loaded.path, num_threads=2, max_num_batched_tokens=512,
                       check_integrity_when_idle=True, **opts)
    return LLM.from_engine(EngineCore(cfg, loaded=loaded))


def _params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=output_bound(schema) + 1,
                          guided=GuidedDecoding("json", json.dumps(schema), "guided_json"),
                          **kw)


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(f"Object number {i}:") for i in range(len(SCHEMAS))]


def _check(outs, schemas) -> list[list[int]]:
    tokens = []
    for out, schema in zip(outs, schemas):
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text     # the grammar ended it
            jsonschema.validate(json.loads(o.text), schema)
            tokens.append(o.token_ids)
    return tokens


def test_outputs_follow_their_schema(tiny) -> None:
    llm = _llm(tiny)
    prompts = _prompts(llm)
    greedy = _check(llm.generate(prompts, [_params(s, temperature=0.0) for s in SCHEMAS]),
                    SCHEMAS)
    _check(llm.generate(prompts, [_params(s, temperature=1.0, seed=i, n=2)
                                  for i, s in enumerate(SCHEMAS)]), SCHEMAS)
    # one at a time: the same greedy tokens as in the batch
    assert _check(llm.generate(prompts[3:4], _params(SCHEMAS[3], temperature=0.0)),
                  SCHEMAS[3:4]) == greedy[3:4]
    assert llm.engine.runner.sampler.masker.num_masked_rows > 0


def test_preempted_requests_resume_their_grammar(tiny) -> None:
    prompts = _prompts(_llm(tiny))
    params = [_params(s, temperature=0.0) for s in SCHEMAS]
    base = _check(_llm(tiny).generate(prompts, params), SCHEMAS)
    small = _llm(tiny, num_gpu_blocks_override=40, block_size=4)
    assert _check(small.generate(prompts, params), SCHEMAS) == base
    assert small.engine.scheduler.make_stats().num_preemptions > 0


def test_unconstrained_requests_unchanged_beside_constrained(tiny) -> None:
    llm = _llm(tiny)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(llm)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], free)]
    mixed = llm.generate(prompts[:3] + prompts[3:6],
                         [free] * 3 + [_params(s, temperature=0.0) for s in SCHEMAS[3:6]])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    _check(mixed[3:], SCHEMAS[3:6])


def test_invalid_constraint_refused_at_admission(tiny) -> None:
    llm = _llm(tiny)
    bad = SamplingParams(guided=GuidedDecoding("regex", "(unclosed", "guided_regex"))
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("r", [1, 2, 3], bad)
    assert e.value.param == "guided_regex"
    assert not llm.engine.has_unfinished_requests()
