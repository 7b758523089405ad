"""The router's calls to its instances, written once: the failover loop ("try instances
until one answers"), the timeouts of every call, and the error bodies.

    Upstream.failover(kind, policy, attempt)   pick, try, mark down, next; the 503
    Upstream.post / Upstream.open              one call: the whole answer / streamed
    Upstream.transport_error(inst, e)          a failed call as the request's error

An attempt raises Retry when its instance did not take the request (it answered 503,
say) and UpstreamError to end the request with that answer. A call that cannot reach
its instance (connect refused or timed out) marks the instance down and the next one is
tried; one that broke after the request was sent marks it down too, and the next one is
tried only where sending the request twice is harmless (`resend`).

Timeouts (`--upstream-connect-timeout`, `--upstream-read-timeout`): connect bounds
reaching an instance; read bounds every wait for bytes, so the whole answer of a
non-streamed call and the gap between two chunks of a streamed one. An instance that
does not answer in time is marked down (the health loop puts it back when its /health
answers) and the request ends with a 504: it may still be working on it, so the request
is not sent again.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from duetserve.entrypoints.router.policy import NoInstanceError, Policy
from duetserve.entrypoints.router.pool import Instance, InstancePool

MAX_ATTEMPTS = 3
T = TypeVar("T")


class UpstreamError(Exception):
    """The request ends with this answer: an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status, self.body = status, body


class Retry(Exception):
    """Raised by a failover attempt: its instance did not take the request (the message
    says why); another one may."""


def error_body(message: str, type_: str, status: int) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def unavailable(message: str) -> UpstreamError:
    """The router's 503: no instance could take the request."""
    return UpstreamError(503, error_body(message, "ServiceUnavailableError", 503))


def answer_json(r: httpx.Response | bytes) -> dict:
    """An instance's answer as a dict (an OpenAI error body when it is not JSON)."""
    raw = r if isinstance(r, bytes) else r.content
    try:
        data = json.loads(raw)
        return data if isinstance(data, dict) else {"error": {"message": str(data)}}
    except ValueError:
        return error_body(raw[:200].decode(errors="replace"), "InternalServerError", 502)


def error_message(data: dict) -> object:
    """The message of an instance's error answer (the answer itself when it has none)."""
    error = data.get("error")
    return error.get("message", data) if isinstance(error, dict) else data


@dataclass(frozen=True)
class Timeouts:
    """Of every call to an instance (health checks have their own, InstancePool's)."""

    connect_s: float = 5.0
    read_s: float = 600.0

    def __post_init__(self) -> None:
        for name, flag in (("connect_s", "connect"), ("read_s", "read")):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"--upstream-{flag}-timeout must be > 0, got {value}")

    @classmethod
    def from_args(cls, args) -> Timeouts:
        """From `duet router` / `duet cluster` flags (ValueError: not > 0)."""
        return cls(args.upstream_connect_timeout, args.upstream_read_timeout)

    def for_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(self.read_s, connect=self.connect_s)


def never_reached(e: httpx.HTTPError) -> bool:
    """The request did not reach the instance (sending it elsewhere is harmless)."""
    return isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))


def _timed_out(e: httpx.HTTPError) -> bool:
    return isinstance(e, httpx.TimeoutException) and not never_reached(e)


@dataclass
class Opened:
    """A streamed answer, its body not read yet; counted in its instance's requests in
    flight until close()."""

    inst: Instance
    response: httpx.Response
    closed: bool = False

    async def close(self) -> None:
        """Closes the response and ends the instance's count (once)."""
        if not self.closed:
            self.closed = True
            try:
                await self.response.aclose()
            finally:
                self.inst.end()


class Upstream:
    """The client the router calls its instances with (its timeouts set), and the pool
    whose instances a failed call marks down."""

    def __init__(self, client: httpx.AsyncClient, pool: InstancePool,
                 timeouts: Timeouts) -> None:
        self.client, self.pool, self.timeouts = client, pool, timeouts

    async def failover(self, kind: str, policy: Policy,
                       attempt: Callable[[Instance], Awaitable[T]], *, key: str = "",
                       tried: set[str] | None = None, resend: bool = True) -> T:
        """attempt(inst) on instances of `kind` that `policy` picks (for prompt `key`),
        never one in `tried` (extended with each pick), until one returns: its result.
        After Retry or a call that never reached its instance, the next instance; after a
        call that broke once sent, the next one only when `resend`. Marks the instances
        whose calls failed down. Raises UpstreamError: the attempt's own, 504 (a read
        timeout), 502 (a broken call, not resent), or 503 (none left, or every attempt
        failed)."""
        tried = set() if tried is None else tried
        last = "no attempt"
        for _ in range(max(MAX_ATTEMPTS, len(self.pool.of(kind)))):
            try:
                inst = policy.pick(self.pool.of(kind), key, tried)
            except NoInstanceError as e:
                raise unavailable(f"{e}; last error: {last}") from None
            tried.add(inst.url)
            try:
                return await attempt(inst)
            except Retry as e:
                last = f"{inst.name}: {e}"
            except httpx.HTTPError as e:
                err = self.transport_error(inst, e)
                if _timed_out(e) or not (resend or never_reached(e)):
                    raise err from None
                last = f"{inst.name}: {type(e).__name__}: {e}"
        raise unavailable(f"every {kind} attempt failed; last: {last}")

    def transport_error(self, inst: Instance, e: httpx.HTTPError, during: str = ""
                        ) -> UpstreamError:
        """Marks `inst` down; the error a request whose call to it failed with `e` ends
        with: 504 for a read timeout, else 502. `during`: where, e.g. " mid-stream"."""
        why = f"{type(e).__name__}: {e}".rstrip(": ")
        if _timed_out(e):
            inst.mark_down(f"no answer within {self.timeouts.read_s:g} s ({why})")
            return UpstreamError(504, error_body(
                f"{inst.kind} instance {inst.name} did not answer within "
                f"{self.timeouts.read_s:g} s{during} (--upstream-read-timeout)",
                "TimeoutError", 504))
        inst.mark_down(why)
        return UpstreamError(502, error_body(f"{inst.kind} instance {inst.name} failed"
                                             f"{during}: {why}", "InternalServerError", 502))

    async def post(self, inst: Instance, path: str, body: dict) -> httpx.Response:
        """POST `body` to `inst` and read the whole answer (counted in its requests in
        flight meanwhile). Raises httpx.HTTPError."""
        inst.begin()
        try:
            return await self.client.post(inst.url + path, json=body)
        finally:
            inst.end()

    async def open(self, inst: Instance, path: str, body: dict) -> Opened:
        """POST `body` to `inst`, the answer's body not read (the caller reads it, then
        closes it). Raises httpx.HTTPError."""
        inst.begin()
        try:
            r = await self.client.send(self.client.build_request(
                "POST", inst.url + path, json=body), stream=True)
        except BaseException:
            inst.end()
            raise
        return Opened(inst, r)

    async def refused(self, opened: Opened) -> dict | None:
        """None when `opened` answered 200 (left open); else its answer, read and
        closed. Raises httpx.HTTPError."""
        if opened.response.status_code == 200:
            return None
        try:
            return answer_json(await opened.response.aread())
        finally:
            await opened.close()
