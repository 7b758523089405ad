"""AsyncEngine against a fake EngineCore (no model): streaming, add errors, abort, a step
that raises (affected requests fail, the loop keeps serving), and an idle loop that does
not step."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from duetserve.engine.async_engine import AsyncEngine, EngineStepError, RequestAbortedError
from duetserve.errors import RequestError
from duetserve.outputs import CompletionOutput, RequestOutput
from duetserve.sampling_params import SamplingParams


class FakeCore:
    """Each step gives every request token 7 (text "a") as a delta; finishes at
    max_tokens. `freed = True` makes the next step one that runs no tokens (as a step
    that only applies KV releases)."""

    def __init__(self) -> None:
        self.tokenizer = object()
        self.max_model_len = 64
        self.reqs: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.num_steps = 0
        self.fail_next_step = False
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.shut_down = False
        self.kv_roles = None
        self.freed = False
        self.last_step = SimpleNamespace(items=[])

    def make_stats(self):
        return SimpleNamespace(num_running=len(self.reqs), num_waiting=0, kv_usage=0.0,
                               num_used_blocks=len(self.reqs), num_preemptions=0,
                               prefix_cache_queries=0, prefix_cache_hits=0, num_tokens=0,
                               step_seconds=0.0)

    def shutdown(self) -> None:
        self.shut_down = True

    def add_request(self, req_id, token_ids, params, prompt=None) -> None:
        self.thread_ids.add(threading.get_ident())
        if not token_ids:
            raise RequestError("the prompt is empty")
        self.reqs[req_id] = (token_ids, params, [])

    def abort_request(self, req_id) -> None:
        self.thread_ids.add(threading.get_ident())
        self.aborted.append(req_id)
        self.reqs.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def has_work_now(self) -> bool:
        return bool(self.reqs) or self.freed

    def seconds_to_next_deadline(self) -> None:
        return None

    def step_deltas(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        self.freed = False
        self.last_step = SimpleNamespace(items=list(self.reqs))
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for req_id, (ids, params, generated) in list(self.reqs.items()):
            generated.append(7)
            out = CompletionOutput(0, "a", [7])
            if len(generated) >= params.max_tokens:
                out.finish_reason = "length"
                del self.reqs[req_id]
            outs.append(RequestOutput(req_id, None, ids, [out], out.finished))
        return outs


@pytest.fixture
def engine():
    core = FakeCore()
    eng = AsyncEngine(core)
    eng.start()
    yield eng
    eng.shutdown()


def test_stream_add_error_abort_and_step_error(engine) -> None:
    core = engine.engine
    finished: list[str] = []
    engine.finish_observers.append(lambda out, reason: finished.append(reason))

    async def main() -> None:
        stream = await engine.add_request("a", [1, 2], SamplingParams(max_tokens=3))
        outs = [o async for o in stream]
        assert [o.outputs[0].token_ids for o in outs] == [[7], [7], [7]]   # deltas
        assert [o.finished for o in outs] == [False, False, True]
        assert "".join(o.outputs[0].text for o in outs) == "aaa"
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("b", [], SamplingParams())
        long = await engine.add_request("c", [1], SamplingParams(max_tokens=10_000))
        first = await long.__aiter__().__anext__()
        assert not first.finished
        engine.abort("c")
        with pytest.raises(RequestAbortedError):
            async for _ in long:
                pass
        core.fail_next_step = True
        failing = await engine.add_request("d", [1], SamplingParams(max_tokens=5))
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in failing:
                pass
        again = await engine.add_request("e", [1], SamplingParams(max_tokens=2))
        assert (await _last(again)).finished      # the loop survived the failed step

    asyncio.run(main())
    assert "c" in core.aborted and "d" in core.aborted
    assert finished == ["length", "abort", "error", "length"]
    assert len(core.thread_ids) == 1 and threading.get_ident() not in core.thread_ids


def test_idle_loop_does_not_step(engine) -> None:
    """Once its requests are done the loop goes to its blocking wait (no deadline: nothing
    but a command or a wake-up ends it) without stepping. The fake core's deadline query,
    made right before that wait, marks the moment; no time is measured."""
    core = engine.engine
    waiting = threading.Event()
    core.seconds_to_next_deadline = lambda: waiting.set()      # returns None: wait forever

    async def main() -> None:
        await _last(await engine.add_request("x", [1], SamplingParams(max_tokens=2)))

    waiting.clear()
    asyncio.run(main())
    steps = core.num_steps
    waiting.clear()
    with engine._cv:                  # the loop holds no command and has no work ...
        assert not engine._commands and not core.has_work_now()
    engine._wake()                    # ... so a wake-up only brings it back to the wait
    assert waiting.wait(timeout=60)
    assert core.num_steps == steps and engine.is_running


def test_a_step_that_runs_no_tokens_refreshes_the_stats() -> None:
    """A step that only applied KV releases (a prefill instance frees held blocks so)
    is not a token step, but what it freed must reach the gauges: the idle stats
    observers get a snapshot after it (issue 63)."""
    core = FakeCore()
    core.kv_roles = SimpleNamespace(connector=SimpleNamespace(wake=None))
    eng = AsyncEngine(core)
    published = threading.Event()
    eng.idle_stats_observers.append(lambda stats: published.set())
    eng.start()
    try:
        core.freed = True
        core.kv_roles.connector.wake()         # as a release arriving on another thread
        assert published.wait(60)
        assert core.num_steps == 1
    finally:
        eng.shutdown()


async def _last(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_build_constructs_and_steps_on_one_thread() -> None:
    """AsyncEngine.build runs the factory on the engine thread, which then steps it (one
    OpenMP pool for loading and stepping: see the async_engine docstring)."""
    built_on: list[int] = []

    def factory() -> FakeCore:
        built_on.append(threading.get_ident())
        return FakeCore()

    eng = AsyncEngine.build(factory)
    try:
        assert eng.is_running

        async def main() -> None:
            await _last(await eng.add_request("x", [1], SamplingParams(max_tokens=2)))

        asyncio.run(main())
        assert built_on != [threading.get_ident()]
        assert eng.engine.thread_ids == set(built_on)
    finally:
        eng.shutdown()
    assert eng.engine.shut_down and not eng.is_running


def test_build_reraises_the_factory_error() -> None:
    def factory() -> FakeCore:
        raise RequestError("no such checkpoint")

    threads = threading.active_count()
    with pytest.raises(RequestError, match="no such checkpoint"):
        AsyncEngine.build(factory)
    assert threading.active_count() == threads     # the engine thread has ended
