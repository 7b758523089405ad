"""Colocated replicas (`duet serve --role both`): a request goes whole to one replica and
its answer comes back unchanged (n, echo, logprobs: whatever the replica supports).

Failures, before anything reached the client: a replica that cannot be reached or
breaks the connection is taken out and the request goes to another; a 503 (draining,
or its waiting queue is full) also tries another, without taking it out (upstream.py's
failover, at most max(MAX_ATTEMPTS, replicas) tries). A replica that does not answer
within the read timeout is taken out and the request ends with a 504. A stream that
breaks after its first line reached the client ends with an error event and [DONE].
Other answers (200, 4xx, 500) are passed through.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from duetserve.entrypoints.router.policy import Policy
from duetserve.entrypoints.router.pool import Instance
from duetserve.entrypoints.router.upstream import (Opened, Retry, Upstream, UpstreamError,
                                                   answer_json, error_message)


class Proxy:
    def __init__(self, upstream: Upstream, policy: Policy) -> None:
        self.upstream, self.policy = upstream, policy

    async def complete(self, path: str, body: dict) -> tuple[int, dict]:
        """A non-streamed request: (status, answer). Raises UpstreamError when no replica
        answered."""
        async def attempt(inst: Instance) -> tuple[int, dict]:
            r = await self.upstream.post(inst, path, body)
            data = answer_json(r)
            if r.status_code == 503:
                raise Retry(f"answered 503: {error_message(data)}")
            return r.status_code, data
        return await self.upstream.failover("replica", self.policy, attempt)

    async def open_stream(self, path: str, body: dict, tried: set[str] | None = None
                          ) -> Opened:
        """A replica's streamed answer with status 200, its body not read yet (the caller
        relays it, then closes it). Raises UpstreamError with the replica's status and
        body for a 4xx/500, or as the failover does."""
        async def attempt(inst: Instance) -> Opened:
            opened = await self.upstream.open(inst, path, body)
            data = await self.upstream.refused(opened)
            if data is None:
                return opened
            if opened.response.status_code == 503:
                raise Retry(f"answered 503: {error_message(data)}")
            raise UpstreamError(opened.response.status_code, data)
        return await self.upstream.failover("replica", self.policy, attempt, tried=tried)

    async def relay(self, path: str, body: dict, opened: Opened) -> AsyncIterator[str]:
        """The SSE lines of `opened` (from open_stream). A replica failing before its
        first line is replaced by another one (not after a read timeout); otherwise an
        error event and [DONE] end the stream. Closes every answer it opened."""
        tried = {opened.inst.url}
        sent = False
        while True:
            try:
                async for line in opened.response.aiter_lines():
                    sent = True
                    yield line + "\n"
                return
            except httpx.HTTPError as e:
                err = self.upstream.transport_error(opened.inst, e, " mid-stream")
            finally:
                await opened.close()
            if sent or err.status == 504:
                yield "\n" + _event(err.body)
                return
            try:                  # nothing reached the client: another replica
                opened = await self.open_stream(path, body, tried)
            except UpstreamError as e:
                yield _event(e.body)
                return


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
