"""Many async streams read as one, for the server (the prompts of one request) and the
router (the samples of one request): items in the order they arrive, each tagged with
the key of its stream."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import TypeVar

K = TypeVar("K")
T = TypeVar("T")

_END = object()


async def fan_in(streams: Sequence[tuple[K, AsyncIterable[T]]]
                 ) -> AsyncIterator[tuple[K, T]]:
    """(key, item) from every stream as items come, until all have ended. What a stream
    raises (any BaseException) is raised here, once, and ends the fan-in. One stream is
    read directly (and closed with this generator); several are each read by a task,
    cancelled when this generator ends or is closed (close it promptly: `async with
    contextlib.aclosing(fan_in(...))`).
    Mutates nothing but the streams it reads."""
    if len(streams) == 1:
        key, stream = streams[0]
        items = aiter(stream)
        try:
            async for item in items:
                yield key, item
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:      # an async generator: its cleanup runs now
                await aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(key: K, stream: AsyncIterable[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((key, item, None))
            queue.put_nowait((key, _END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((key, None, e))

    tasks = [asyncio.create_task(pump(key, stream)) for key, stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            key, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
            else:
                yield key, item
    finally:
        for t in tasks:
            t.cancel()
