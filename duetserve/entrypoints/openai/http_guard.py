"""Connection and request hygiene around the app: bounded bodies, timely headers, arrival
stamps, and a graceful drain on SIGTERM/SIGINT.

    RequestGuard (ASGI middleware)   stamps scope["state"]["arrival_time"]; for generation
                                     paths: 503 while draining, counts in-flight requests;
                                     reads a POST body up to max_request_bytes (413 past
                                     it, before any JSON parsing; a body that stalls for
                                     read_timeout gets 408), then replays it to the app
    header_timeout_protocol(...)     uvicorn's h11 protocol plus a timer from connection
                                     start (and from each response) to complete request
                                     headers: idle and slowloris connections get 408
    DrainingServer                   uvicorn.Server whose first SIGTERM/SIGINT drains
                                     (stop admitting, let in-flight requests finish up to
                                     shutdown_timeout, then end the rest with an error
                                     event and [DONE]) before exiting 0; a second signal
                                     exits at once
    QuietExitServer                  its base: exits 0 after a signal-driven shutdown
                                     (`duet cluster`'s router uses it as is)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable

import h11
import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from duetserve.entrypoints.openai.protocol import error_body
from duetserve.entrypoints.openai.context import ServerContext

log = logging.getLogger("duetserve.serve")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _error(status: int, type_: str, message: str, headers: dict | None = None
           ) -> JSONResponse:
    return JSONResponse(error_body(message, type_, None, status), status,
                        headers={"Connection": "close", **(headers or {})})


class RequestGuard:
    """Pure ASGI middleware (streaming bodies pass through untouched)."""

    def __init__(self, app, ctx: ServerContext, max_request_bytes: int,
                 read_timeout: float) -> None:
        self.app, self.ctx = app, ctx
        self.max_bytes, self.read_timeout = max_request_bytes, read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival_time"] = time.time()
        generation = scope["path"] in GENERATION_PATHS
        if generation and self.ctx.draining:
            await _error(503, "ServiceUnavailableError", "the server is shutting down and "
                         "admits no new requests", {"Retry-After": "1"})(scope, receive, send)
            return
        if generation:
            self.ctx.in_flight.enter()
        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._bounded_body(scope, receive, send)
                if receive is None:
                    return
            await self.app(scope, receive, send)
        finally:
            if generation:
                self.ctx.in_flight.leave()

    async def _bounded_body(self, scope, receive, send):
        """Read the whole body (at most max_bytes); None when an error was answered."""
        length = dict(scope["headers"]).get(b"content-length")
        too_large = _error(413, "RequestTooLargeError",
                           f"the request body is larger than {self.max_bytes} bytes "
                           "(--max-request-bytes)")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large(scope, receive, send)
            return None
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                await _error(408, "RequestTimeoutError", "the request body stalled for "
                             f"{self.read_timeout:g} s")(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()     # then the real channel: http.disconnect
        return replay


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for complete request headers, armed when
    the connection opens and after every response: an idle or slow-header connection
    is answered 408 and closed."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:    # headers complete
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._header_expired)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_expired(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n"
                                         b"content-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    return HeaderTimeoutProtocol


class QuietExitServer(uvicorn.Server):
    """uvicorn.Server that does not re-raise SIGTERM/SIGINT after its shutdown: the
    process exits 0 (not -15, nor the exit code a handler installed before, such as
    Ray's, makes of the signal) once the `finally` blocks around run() have run."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class DrainingServer(QuietExitServer):
    """uvicorn.Server with a graceful drain (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def submit(self, coro) -> "concurrent.futures.Future":
        """Run `coro` on the server's event loop from another thread (after start-up)."""
        if self._loop is None:
            raise RuntimeError("the server has not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining or self._loop is None:
            self.force_exit = self._draining    # second signal: no more waiting
            self.should_exit = True
            return
        self._draining = True
        log.info("signal %d: draining (no new requests; in-flight ones may finish)", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:  # noqa: BLE001
            log.exception("drain failed")
        self.should_exit = True



async def drain(ctx: ServerContext, timeout: float, flush_timeout: float = 5.0) -> None:
    """Stop admitting; wait up to `timeout` s for in-flight generation requests; then end
    the rest (error event + [DONE] for streams, 503 for the others) and wait (bounded)
    for their last bytes."""
    ctx.draining = True
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(ctx.in_flight.idle.wait(), timeout)
        log.info("drained in %.1f s", time.monotonic() - t0)
        return
    except asyncio.TimeoutError:
        pass
    log.warning("shutdown timeout (%.0f s): ending %d in-flight request(s) with an error",
                timeout, ctx.in_flight.count)
    ctx.engine.fail_all("the server is shutting down (--shutdown-timeout reached)")
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(ctx.in_flight.idle.wait(), flush_timeout)
