"""Fake instances for router tests: tiny HTTP servers on loopback (asyncio, in the test's
event loop) that answer from a script, and the router app run in the same loop over
httpx's ASGI transport (its lifespan entered, so its client and health loop run)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx

from duetserve.entrypoints.router.app import build_app
from duetserve.entrypoints.router.pool import Instance, InstancePool
from duetserve.entrypoints.router.upstream import Timeouts

# (method, path, JSON body) -> (status, body): a dict is sent as JSON, a list of dicts as
# SSE events then [DONE]; None: never answer (the connection stays open).
Script = Callable[[str, str, dict], "tuple[int, dict | list] | None"]


class FakeInstance:
    """Answers GET /health (200) and /load ({}) until it stops answering; every other
    request goes to `script`. Once a request gets no answer (`script` returned None),
    nothing is answered any more (a vanished machine whose sockets stay open)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.silent = False
        self.requests: list[tuple[str, str, dict]] = []
        self.server: asyncio.Server | None = None
        self.url = ""
        self.writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> FakeInstance:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for w in list(self.writers):
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        self.writers.add(writer)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path = head.split(" ", 2)[:2]
            length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                           if line.lower().startswith("content-length:")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            answer = self._answer(method, path, body)
            if answer is None:
                self.silent = True
                await reader.read()          # until the router closes the connection
                return
            writer.write(_http(*answer))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    def _answer(self, method: str, path: str, body: dict):
        if self.silent:
            return None
        if method == "GET" and path == "/health":
            return 200, {}
        if method == "GET" and path == "/load":
            return 200, {"num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
        self.requests.append((method, path, body))
        return self.script(method, path, body)


def _http(status: int, body: dict | list) -> bytes:
    if isinstance(body, list):
        payload = "".join(f"data: {json.dumps(e)}\n\n" for e in body) + "data: [DONE]\n\n"
        ctype = "text/event-stream"
    else:
        payload, ctype = json.dumps(body), "application/json"
    data = payload.encode()
    return (f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}"
            f"\r\nConnection: close\r\n\r\n").encode() + data


@asynccontextmanager
async def router(instances: list[Instance], timeouts: Timeouts | None = None
                 ) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the router app over `instances` (colocated when they are replicas),
    its lifespan running. Its health loop is stopped: within a test only the start-up
    check runs (the instances' health is what the test makes it)."""
    colocated = instances[0].kind == "replica"
    pool = InstancePool(instances, colocated, interval_s=3600.0, timeout_s=5.0)
    app = build_app(pool, timeouts=timeouts)
    async with app.router.lifespan_context(app):
        await pool.stop()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router", timeout=60.0) as client:
            yield client
