"""Instances behind the router and their health.

An instance is healthy while /health answers 200; a request that cannot reach it (or a
5xx with no answer) takes it out at once, and the health loop puts it back when /health
answers again. /load (queue and KV usage) is read on each check for the least-loaded
policy; the router adds its own count of requests in flight to each instance.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("duetserve.router")


@dataclass
class Instance:
    url: str
    kind: str                        # "prefill" | "decode"
    healthy: bool = True
    in_flight: int = 0               # router requests being served there now
    load: dict = field(default_factory=dict)    # the last /load answer
    last_error: str | None = None
    since: float = field(default_factory=time.monotonic)

    @property
    def score(self) -> float:
        """Lower is less loaded: requests in flight, its queue, its KV usage."""
        return (self.in_flight + self.load.get("num_waiting", 0)
                + 0.5 * self.load.get("num_running", 0) + 4.0 * self.load.get("kv_usage", 0.0))

    def mark_down(self, why: str) -> None:
        if self.healthy:
            log.warning("%s instance %s taken out: %s", self.kind, self.url, why)
        self.healthy, self.last_error, self.since = False, why, time.monotonic()

    def mark_up(self) -> None:
        if not self.healthy:
            log.warning("%s instance %s back in", self.kind, self.url)
        self.healthy, self.last_error, self.since = True, None, time.monotonic()


def parse_urls(text: str, kind: str) -> list[Instance]:
    """"http://a:1,http://b:2" -> instances; ValueError for an empty or malformed list."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"--{kind} needs at least one URL")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--{kind}: {u!r} is not an http(s) URL")
    if len(set(urls)) != len(urls):
        raise ValueError(f"--{kind} lists a URL twice")
    return [Instance(u, kind) for u in urls]


class InstancePool:
    def __init__(self, prefill: list[Instance], decode: list[Instance],
                 interval_s: float = 2.0, timeout_s: float = 2.0) -> None:
        self.prefill, self.decode = prefill, decode
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._task: asyncio.Task | None = None

    @property
    def all(self) -> list[Instance]:
        return self.prefill + self.decode

    async def check(self, client: httpx.AsyncClient, inst: Instance) -> None:
        """One health check; mutates inst (healthy, load)."""
        try:
            r = await client.get(f"{inst.url}/health", timeout=self.timeout_s)
            if r.status_code != 200:
                inst.mark_down(f"/health answered {r.status_code}")
                return
            load = await client.get(f"{inst.url}/load", timeout=self.timeout_s)
            if load.status_code == 200:
                inst.load = load.json()
            inst.mark_up()
        except (httpx.HTTPError, ValueError) as e:
            inst.mark_down(f"{type(e).__name__}: {e}")

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, i) for i in self.all))

    def start(self, client: httpx.AsyncClient) -> None:
        async def loop() -> None:
            while True:
                await self.check_all(client)
                await asyncio.sleep(self.interval_s)     # the check period
        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
