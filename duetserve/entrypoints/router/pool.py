"""Instances behind the router and their health.

An instance is healthy while /health answers 200; a request that cannot reach it (or a
5xx with no answer) takes it out at once, and the health loop puts it back when /health
answers again. A health check that only times out counts after `TIMEOUTS_DOWN` in a row:
an instance busy with a long step on a loaded machine answers late, it is not gone
(a refused connection or a non-200 answer still takes it out at once). /load (queue and KV usage) is read on each check for the least-loaded
policy; the router adds its own count of requests in flight to each instance.

Membership may change at run time (`duet cluster`, duetserve/cluster/): add() registers
an instance, a draining one gets no new requests, remove() deregisters it; an instance
keeps its name when it moves to a new URL (restarted elsewhere by Ray).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("duetserve.router")


KINDS = ("prefill", "decode", "replica")     # replica: colocated (`--role both`)
TIMEOUTS_DOWN = 2    # consecutive timed-out health checks that take an instance out


@dataclass
class Instance:
    url: str
    kind: str                        # one of KINDS
    healthy: bool = True
    in_flight: int = 0               # router requests being served there now
    load: dict = field(default_factory=dict)    # the last /load answer
    last_error: str | None = None
    since: float = field(default_factory=time.monotonic)
    name: str = ""                   # stable identity (default: the URL)
    draining: bool = False           # being removed: no new requests
    served: int = 0                  # router requests sent there, ever
    timeouts: int = 0                # health checks timed out in a row

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"instance kind must be one of {KINDS}, got {self.kind!r}")
        self.name = self.name or self.url

    @property
    def available(self) -> bool:
        """May get a new request: healthy and not draining."""
        return self.healthy and not self.draining

    def begin(self) -> None:
        """A router request is sent here (pair with end())."""
        self.in_flight += 1
        self.served += 1

    def end(self) -> None:
        self.in_flight -= 1

    @property
    def score(self) -> float:
        """Lower is less loaded: requests in flight, its queue, its KV usage."""
        return (self.in_flight + self.load.get("num_waiting", 0)
                + 0.5 * self.load.get("num_running", 0) + 4.0 * self.load.get("kv_usage", 0.0))

    def mark_down(self, why: str) -> None:
        if self.healthy:
            log.warning("%s instance %s (%s) taken out: %s", self.kind, self.name, self.url,
                        why)
        self.healthy, self.last_error, self.since = False, why, time.monotonic()

    def mark_up(self) -> None:
        if not self.healthy:
            log.warning("%s instance %s (%s) back in", self.kind, self.name, self.url)
        self.healthy, self.last_error, self.since = True, None, time.monotonic()

    def move(self, url: str, why: str) -> None:
        """Now served at `url` (restarted): out until its /health answers there."""
        log.warning("%s instance %s moved %s -> %s (%s)", self.kind, self.name, self.url,
                    url, why)
        self.url, self.load = url, {}
        self.healthy, self.last_error, self.since = False, why, time.monotonic()


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
    """`colocated`: the instances are replicas (each serves whole requests); otherwise
    prefill and decode instances. Mutated by add/remove and the health loop."""

    def __init__(self, instances: list[Instance], colocated: bool,
                 interval_s: float = 2.0, timeout_s: float = 2.0) -> None:
        self.colocated = colocated
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._instances: list[Instance] = []
        self._task: asyncio.Task | None = None
        for inst in instances:
            self.add(inst)

    @property
    def all(self) -> list[Instance]:
        return list(self._instances)

    def of(self, kind: str) -> list[Instance]:
        return [i for i in self._instances if i.kind == kind]

    @property
    def prefill(self) -> list[Instance]:
        return self.of("prefill")

    @property
    def decode(self) -> list[Instance]:
        return self.of("decode")

    @property
    def replica(self) -> list[Instance]:
        return self.of("replica")

    @property
    def serving_kinds(self) -> tuple[str, ...]:
        return ("replica",) if self.colocated else ("prefill", "decode")

    def add(self, inst: Instance) -> None:
        """Register an instance (ValueError: wrong kind for this pool, or a name or URL
        already registered)."""
        if inst.kind not in self.serving_kinds:
            raise ValueError(f"a {'colocated' if self.colocated else 'disaggregated'} "
                             f"pool takes {'/'.join(self.serving_kinds)} instances, "
                             f"not {inst.kind}")
        for other in self._instances:
            if other.name == inst.name or other.url == inst.url:
                raise ValueError(f"instance {inst.name} ({inst.url}) is already registered")
        self._instances.append(inst)

    def remove(self, inst: Instance) -> None:
        """Deregister (requests already sent there finish on their own)."""
        self._instances = [i for i in self._instances if i is not inst]

    def get(self, name: str) -> Instance | None:
        return next((i for i in self._instances if i.name == name), None)

    def ready(self) -> bool:
        """Every kind this pool needs has an available instance."""
        return all(any(i.available for i in self.of(k)) for k in self.serving_kinds)

    async def check(self, client: httpx.AsyncClient, inst: Instance) -> None:
        """One health check; mutates inst (healthy, load, timeouts). An instance whose URL
        changed while the check ran (moved) is left to the next check."""
        url = inst.url
        try:
            r = await client.get(f"{url}/health", timeout=self.timeout_s)
            if r.status_code != 200:
                if inst.url == url:
                    inst.mark_down(f"/health answered {r.status_code}")
                return
            load = await client.get(f"{url}/load", timeout=self.timeout_s)
            if inst.url != url:
                return
            if load.status_code == 200:
                inst.load = load.json()
            inst.timeouts = 0
            inst.mark_up()
        except httpx.TimeoutException as e:
            if inst.url == url:
                inst.timeouts += 1
                if inst.timeouts >= TIMEOUTS_DOWN:
                    inst.mark_down(f"{inst.timeouts} health checks timed out: "
                                   f"{type(e).__name__}")
        except (httpx.HTTPError, ValueError) as e:
            if inst.url == url:
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
