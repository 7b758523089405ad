"""A request whose processing raises inside a step fails alone: the step is retried
without it, every other request's output is exactly what it would have been, and no KV
block or prefix-cache entry is left behind (tiny random model)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from duetserve.config import EngineConfig
from duetserve.engine.async_engine import AsyncEngine, RequestFailedError
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.isolation import IsolatedExecutor
from duetserve.errors import RequestError
from duetserve.loader import load_model
from duetserve.outputs import OutputAccumulator
from duetserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
POISON = "poison"


class FaultyRunner:
    """Wraps the real runner; raises while request POISON is scheduled and has computed
    at least `after` tokens (so it fails mid-stream, in a batch with the others)."""

    def __init__(self, engine: EngineCore, after: int) -> None:
        self.engine, self.after = engine, after
        self.runner = engine.runner
        self.num_raised = 0
        self.error: Exception = RuntimeError("injected failure in the poison request")

    def execute_model(self, so):
        req = self.engine.scheduler.requests.get(POISON)
        if POISON in so.num_scheduled_tokens and req.num_computed_tokens >= self.after:
            self.num_raised += 1
            raise self.error
        return self.runner.execute_model(so)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["llama-gqa-untied"])


def _engine(loaded, faulty_after: int | None = None) -> tuple[EngineCore, FaultyRunner | None]:
    engine = EngineCore(EngineConfig(model=loaded.path, num_threads=2, block_size=4,
                                     max_num_batched_tokens=64, num_gpu_blocks_override=128,
                                     check_integrity_when_idle=True),
                        loaded=loaded)
    faulty = None
    if faulty_after is not None:
        faulty = FaultyRunner(engine, faulty_after)
        engine.executor = IsolatedExecutor(faulty.execute_model, engine.scheduler)
    return engine, faulty


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab - 3, (n,), generator=g).tolist()
            for n in (5, 9, 14, 20, 26, 31, 40, 47)]


def _params(i: int) -> SamplingParams:
    return SEEDED if i % 3 == 0 else GREEDY


def _reference(loaded, prompts, params=None) -> list[list[int]]:
    engine, _ = _engine(loaded)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params or _params(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def test_only_the_failing_request_fails_and_its_blocks_are_not_cached(loaded) -> None:
    prompts = _prompts(loaded.config.vocab_size)
    expected = _reference(loaded, prompts)
    shared = [p + 1 for p in prompts[6]]          # a prompt no other request has
    expected_shared = _reference(loaded, [shared], GREEDY)[0]
    engine, faulty = _engine(loaded, faulty_after=0)
    # The poison and "twin" share a 40-token prompt and are admitted in the same (first)
    # step: twin hits 36 tokens of blocks the poison registered before computing them.
    engine.add_request(POISON, shared, GREEDY)
    engine.add_request("twin", shared, GREEDY)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _params(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_integrity()
    assert faulty.num_raised >= 1
    assert done[POISON].error and "injected failure" in done[POISON].error
    assert done[POISON].outputs[0].finish_reason == "error"
    assert [done[str(i)].outputs[0].token_ids for i in range(8)] == expected
    assert all(done[str(i)].error is None for i in range(8))
    twin = done["twin"]      # its KV was the poison's to write: it fails with it
    assert twin.error is not None and "shares KV blocks" in twin.error
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0
    # A later request with the same prompt must not hit blocks the poison never wrote.
    engine.add_request("again", shared, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["again"].outputs[0].token_ids == expected_shared


def test_eight_streams_complete_while_one_request_fails(loaded) -> None:
    prompts = _prompts(loaded.config.vocab_size)
    expected = _reference(loaded, prompts)
    engine, faulty = _engine(loaded, faulty_after=len(prompts[2]) + 3)   # mid-stream
    aeng = AsyncEngine(engine)
    aeng.start()

    async def consume(req_id: str, ids: list[int], params) -> list[int] | BaseException:
        stream = await aeng.add_request(req_id, ids, params)
        last, acc = None, OutputAccumulator()
        try:
            async for delta in stream:
                last = acc.add(delta)        # the stream carries deltas
        except RequestFailedError as e:
            return e
        return last.outputs[0].token_ids

    async def run_all():
        jobs = [consume(str(i), p, _params(i)) for i, p in enumerate(prompts)]
        jobs.append(consume(POISON, prompts[2], GREEDY))
        return await asyncio.gather(*jobs)

    try:
        results = asyncio.run(run_all())
    finally:
        aeng.shutdown()
    assert faulty.num_raised >= 1
    assert results[:8] == expected
    assert isinstance(results[8], RequestFailedError) and "injected" in str(results[8])
    assert aeng.num_step_errors == 0
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0
    engine.scheduler.check_integrity()


def test_a_request_error_keeps_the_field_it_names(loaded) -> None:
    """A request failing with a RequestError (its constraint cannot go on) ends with the
    field in error_param (the server answers 400 naming it); the others have none."""
    prompts = _prompts(loaded.config.vocab_size)
    engine, faulty = _engine(loaded, faulty_after=0)
    faulty.error = RequestError("guided_regex: no token can continue", "guided_regex")
    engine.add_request(POISON, prompts[0], GREEDY)
    engine.add_request("0", prompts[1], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[POISON].error_param == "guided_regex"
    assert "guided_regex: no token can continue" in done[POISON].error
    assert done["0"].error is None and done["0"].error_param is None


def test_the_isolation_warning_says_where_the_step_raised() -> None:
    """The warning names the innermost frame in duetserve's code (a kernel's "shape
    mismatch" alone does not say which caller passed what), or says it was elsewhere."""
    from duetserve.engine.isolation import _where
    with pytest.raises(Exception) as info:
        EngineConfig(model=None, kv_cache_memory=-1)
    where = _where(info.value)
    assert where.startswith("raised in ") and "config.py:" in where
    with pytest.raises(RuntimeError) as info:
        raise RuntimeError("not ours")
    assert _where(info.value) == "raised outside duetserve"
