"""Colocated replicas (`duet serve --role both`): a request goes whole to one replica and
its answer comes back unchanged (n, echo, logprobs: whatever the replica supports).

Failures, before anything reached the client: a replica that cannot be reached or
breaks the connection is taken out and the request goes to another; a 503 (draining,
or its waiting queue is full) also tries another, without taking it out. Up to
MAX_ATTEMPTS replicas. A stream that breaks after its first line reached the client ends
with an error event and [DONE]. Other answers (200, 4xx, 500) are passed through.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from duetserve.entrypoints.router.flow import (MAX_ATTEMPTS, UpstreamError, answer_json,
                                               error_body)
from duetserve.entrypoints.router.policy import NoInstanceError, Policy
from duetserve.entrypoints.router.pool import Instance, InstancePool


class Proxy:
    def __init__(self, client: httpx.AsyncClient, pool: InstancePool, policy: Policy) -> None:
        self.client, self.pool, self.policy = client, pool, policy

    def _attempts(self) -> int:
        return max(MAX_ATTEMPTS, len(self.pool.replica))

    def _pick(self, tried: set[str], last: str) -> Instance:
        try:
            inst = self.policy.pick(self.pool.replica, "", tried)
        except NoInstanceError as e:
            raise UpstreamError(503, error_body(f"{e}; last error: {last}",
                                                "ServiceUnavailableError", 503)) from None
        tried.add(inst.url)
        return inst

    async def complete(self, path: str, body: dict) -> tuple[int, dict]:
        """A non-streamed request: (status, answer). Raises UpstreamError(503) when no
        replica could answer."""
        tried: set[str] = set()
        last = "no attempt"
        for _ in range(self._attempts()):
            inst = self._pick(tried, last)
            inst.begin()
            try:
                r = await self.client.post(inst.url + path, json=body, timeout=None)
            except httpx.HTTPError as e:
                inst.mark_down(f"{type(e).__name__}: {e}")
                last = f"{inst.name}: {type(e).__name__}: {e}"
                continue
            finally:
                inst.end()
            data = answer_json(r)
            if r.status_code == 503:
                last = f"{inst.name} answered 503: {data.get('error', {}).get('message')}"
                continue
            return r.status_code, data
        raise UpstreamError(503, error_body(f"every replica attempt failed; last: {last}",
                                            "ServiceUnavailableError", 503))

    async def open_stream(self, path: str, body: dict, tried: set[str] | None = None
                          ) -> tuple[Instance, httpx.Response]:
        """A replica's streamed answer with status 200, its body not read yet (the
        caller relays it, then closes it and calls inst.end()). Raises UpstreamError with
        the replica's status and body for a 4xx/500, or 503 when none could answer."""
        tried = set() if tried is None else tried
        last = "no attempt"
        for _ in range(self._attempts()):
            inst = self._pick(tried, last)
            inst.begin()
            try:
                r = await self.client.send(self.client.build_request(
                    "POST", inst.url + path, json=body), stream=True)
            except httpx.HTTPError as e:
                inst.end()
                inst.mark_down(f"{type(e).__name__}: {e}")
                last = f"{inst.name}: {type(e).__name__}: {e}"
                continue
            if r.status_code == 200:
                return inst, r
            try:
                data = answer_json(await r.aread())
            except httpx.HTTPError as e:
                data = error_body(f"{type(e).__name__}: {e}", "InternalServerError", 502)
            finally:
                await r.aclose()
                inst.end()
            if r.status_code == 503:
                last = f"{inst.name} answered 503: {data.get('error', {}).get('message')}"
                continue
            raise UpstreamError(r.status_code, data)
        raise UpstreamError(503, error_body(f"every replica attempt failed; last: {last}",
                                            "ServiceUnavailableError", 503))

    async def relay(self, path: str, body: dict, inst: Instance, r: httpx.Response
                    ) -> AsyncIterator[str]:
        """The SSE lines of `r` (from open_stream). A replica failing before its first
        line is replaced by another one; after it, an error event and [DONE] end the
        stream. Closes every response it opened and ends each instance's count."""
        tried = {inst.url}
        sent = False
        while True:
            try:
                async for line in r.aiter_lines():
                    sent = True
                    yield line + "\n"
                return
            except httpx.HTTPError as e:
                inst.mark_down(f"{type(e).__name__}: {e}")
                why = f"replica {inst.name} failed mid-stream: {type(e).__name__}: {e}"
            finally:
                await r.aclose()
                inst.end()
            if sent:
                yield _error_event(why, 502)
                return
            try:                  # nothing reached the client: another replica
                inst, r = await self.open_stream(path, body, tried)
            except UpstreamError as e:
                yield f"data: {json.dumps(e.body)}\n\ndata: [DONE]\n\n"
                return


def _error_event(message: str, status: int) -> str:
    body = error_body(message, "InternalServerError", status)
    return f"\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n"
