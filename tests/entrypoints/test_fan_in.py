"""fan_in: the one fan-in loop of the server (prompts) and the router (samples)."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from duetserve.entrypoints.fan_in import fan_in


async def _items(values, log: list, name: str, gate: asyncio.Event | None = None,
                 closed: asyncio.Event | None = None):
    """Yields `values` (each after `gate`), logging how it ended; sets `closed` last."""
    try:
        for v in values:
            if gate is not None:
                await gate.wait()
            yield v
        log.append((name, "end"))
    except asyncio.CancelledError:
        log.append((name, "cancelled"))
        raise
    finally:
        log.append((name, "closed"))
        if closed is not None:
            closed.set()


def _run(coro):
    return asyncio.run(coro)


def test_every_item_tagged_with_its_stream_in_stream_order():
    async def main():
        log: list = []
        streams = [("a", _items([1, 2, 3], log, "a")), ("b", _items([10, 20], log, "b")),
                   ("c", _items([], log, "c"))]
        return [x async for x in fan_in(streams)], log
    got, log = _run(main())
    assert sorted(got) == [("a", 1), ("a", 2), ("a", 3), ("b", 10), ("b", 20)]
    assert [v for k, v in got if k == "a"] == [1, 2, 3]
    assert [v for k, v in got if k == "b"] == [10, 20]
    assert {e for e in log if e[1] == "end"} == {("a", "end"), ("b", "end"), ("c", "end")}


def test_a_stream_error_is_raised_and_the_other_readers_are_cancelled():
    async def failing():
        yield 1
        raise ValueError("boom")

    async def main():
        log: list = []
        never, closed = asyncio.Event(), asyncio.Event()
        streams = [(0, failing()), (1, _items([5], log, "slow", never, closed))]
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for x in fan_in(streams):
                got.append(x)
        await asyncio.wait_for(closed.wait(), 10)   # the cancelled reader's cleanup
        return got, log
    got, log = _run(main())
    assert got == [(0, 1)]
    assert log == [("slow", "cancelled"), ("slow", "closed")]


def test_closing_early_cancels_readers_and_closes_a_single_stream():
    async def main():
        log: list = []
        never, closed = asyncio.Event(), asyncio.Event()
        many = [(0, _items([1, 2], log, "x")), (1, _items([7], log, "y", never, closed))]
        async with aclosing(fan_in(many)) as merged:
            async for _ in merged:
                break
        await asyncio.wait_for(closed.wait(), 10)
        single_log: list = []
        async with aclosing(fan_in([(0, _items([1, 2, 3], single_log, "s"))])) as merged:
            async for first in merged:
                break
        return log, first, single_log
    log, first, single_log = _run(main())
    assert ("y", "cancelled") in log and ("y", "end") not in log
    assert first == (0, 1)
    # closed at once (not left to the garbage collector), without reaching its end
    assert single_log == [("s", "closed")]
