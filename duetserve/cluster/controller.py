"""Controller: the Ray actors of one `duet cluster` deployment and the router pool they
are registered in. It lives in the router's process and event loop (no locks: every
method runs on that loop).

    add(kind)       create a ServerInstance actor (its resources, num_cpus, max_restarts);
                    await its info(); register it in the pool (registration)
    watch (a task per member)
                    info() every interval, one call at a time: "unavailable" while Ray
                    restarts it (out of the pool's picks); a new pid/URL after -> the pool
                    entry moves to the new URL (out until its /health answers there);
                    DEAD_AFTER_ERRORS "died" answers in a row -> gone for good,
                    deregistered
    remove(name)    drain first: the router stops sending it requests and waits for its
                    own in-flight ones, the instance drains (its in-flight requests, held
                    KV), then the actor is killed without restart and deregistered
    stop()          kill every actor (shutdown)

The pool (router/pool.py) is the registry the router reads; health stays the pool's
job (HTTP /health), liveness and placement are Ray's.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import httpx

from duetserve.cluster.instance import ServerInstance
from duetserve.entrypoints.router.pool import Instance, InstancePool

log = logging.getLogger("duetserve.cluster")

DEAD_AFTER_ERRORS = 3        # consecutive failed info() calls: the actor is gone


class ClusterError(Exception):
    """An operator request the cluster cannot do (status: the HTTP status to answer)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class InstanceSpec:
    """How every instance is started. `resources`: per kind (replica/prefill/decode),
    the Ray resources one instance needs, e.g. {"decode": 1} to pin decode instances to
    nodes that offer that custom resource."""

    serve_args: tuple[str, ...] = ()
    resources: dict = field(default_factory=dict)
    num_cpus: float = 1.0
    max_restarts: int = 10
    kv_backend: str = "mooncake"
    start_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    watch_interval_s: float = 1.0


@dataclass
class Member:
    name: str
    kind: str
    handle: object                      # ray ActorHandle
    info: dict = field(default_factory=dict)
    instance: Instance | None = None    # its pool entry
    restarts: int = 0
    state: str = "starting"             # starting | serving | draining | dead
    task: asyncio.Task | None = None

    def describe(self) -> dict:
        inst = self.instance
        return {"name": self.name, "kind": self.kind, "state": self.state,
                "restarts": self.restarts, **self.info,
                "healthy": inst.healthy if inst else False,
                "in_flight": inst.in_flight if inst else 0,
                "served": inst.served if inst else 0}


class Controller:
    def __init__(self, pool: InstancePool, spec: InstanceSpec,
                 client: httpx.AsyncClient) -> None:
        import ray
        self.ray = ray
        self.pool, self.spec, self.client = pool, spec, client
        self.members: dict[str, Member] = {}
        self._numbers = {k: itertools.count() for k in pool.serving_kinds}
        self._actor_class = ray.remote(ServerInstance)

    async def _call(self, ref, timeout_s: float):
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)

    async def add(self, kind: str) -> dict:
        """Start one instance of `kind` and register it; returns its description once
        the router sees it healthy. Raises ClusterError."""
        if kind not in self.pool.serving_kinds:
            raise ClusterError(f"this cluster runs {'/'.join(self.pool.serving_kinds)} "
                               f"instances, not {kind!r}")
        name = f"{kind}-{next(self._numbers[kind])}"
        handle = self._actor_class.options(
            num_cpus=self.spec.num_cpus, resources=self.spec.resources.get(kind) or {},
            max_restarts=self.spec.max_restarts, max_task_retries=0, max_concurrency=4,
        ).remote(name, kind, list(self.spec.serve_args), self.spec.kv_backend)
        m = self.members[name] = Member(name, kind, handle)
        try:
            m.info = await self._call(handle.info.remote(), self.spec.start_timeout_s)
        except Exception as e:  # noqa: BLE001 - creation failed, timed out or was refused
            self.members.pop(name)
            self.ray.kill(handle, no_restart=True)
            raise ClusterError(f"instance {name} did not start: {_why(e)}", 500) from None
        m.instance = Instance(m.info["url"], kind, healthy=False, name=name)
        self.pool.add(m.instance)
        await self.pool.check(self.client, m.instance)
        m.state = "serving"
        m.task = asyncio.create_task(self._watch(m))
        log.warning("registered %s at %s (node %s, pid %d, started in %.1f s)", name,
                    m.info["url"], m.info["host"], m.info["pid"], m.info["start_s"])
        return m.describe()

    async def _watch(self, m: Member) -> None:
        """Follows one actor until it is removed or dead (see the module docstring)."""
        fut: asyncio.Future | None = None
        errors = 0
        while m.state in ("serving", "draining"):
            if fut is None:
                fut = asyncio.wrap_future(m.handle.info.remote().future())
            await asyncio.wait({fut}, timeout=self.spec.watch_interval_s)
            if not fut.done():
                continue                  # restarting (the call waits for it) or busy
            try:
                info = fut.result()
            except self.ray.exceptions.ActorUnavailableError as e:   # Ray restarts it
                m.instance.mark_down(f"actor: {_why(e)}")
                await asyncio.sleep(self.spec.watch_interval_s)
            except Exception as e:  # noqa: BLE001 - died (the call it ran, or for good)
                errors += 1
                m.instance.mark_down(f"actor: {_why(e)}")
                if errors >= DEAD_AFTER_ERRORS:
                    log.error("%s is gone (%s); deregistered", m.name, _why(e))
                    m.state = "dead"
                    self.pool.remove(m.instance)
                    return
                await asyncio.sleep(self.spec.watch_interval_s)
            else:
                errors = 0
                if info["pid"] != m.info["pid"] or info["url"] != m.info["url"]:
                    m.restarts += 1
                    m.instance.move(info["url"], f"restarted by Ray (pid {info['pid']})")
                    m.info = info
                    await self.pool.check(self.client, m.instance)
                else:
                    await asyncio.sleep(self.spec.watch_interval_s)
            fut = None

    async def remove(self, name: str) -> dict:
        """Drain-first removal (see the module docstring). Raises ClusterError."""
        m = self.members.get(name)
        if m is None or m.state not in ("serving", "draining"):
            raise ClusterError(f"no instance named {name!r}", 404)
        others = [x for x in self.members.values()
                  if x.kind == m.kind and x is not m and x.state == "serving"]
        if not others:
            raise ClusterError(f"{name} is the last {m.kind} instance; add another first",
                               409)
        t0 = time.monotonic()
        deadline = t0 + self.spec.drain_timeout_s
        m.state, m.instance.draining = "draining", True
        while m.instance.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)    # router requests on it finish (no new ones)
        try:
            result = await self._call(
                m.handle.drain.remote(max(deadline - time.monotonic(), 0.1)),
                max(deadline - time.monotonic(), 0.1) + 10.0)
        except Exception as e:  # noqa: BLE001 - the actor is dead or restarting
            result = {"drained": False, "error": _why(e)}
        result["router_in_flight"] = m.instance.in_flight
        self._forget(m)
        result.update(name=name, drain_s=round(time.monotonic() - t0, 3))
        log.warning("removed %s after %.1f s: %s", name, result["drain_s"], result)
        return result

    def _forget(self, m: Member) -> None:
        m.state = "dead"
        if m.task is not None:
            m.task.cancel()
        if m.instance is not None:
            self.pool.remove(m.instance)
        self.ray.kill(m.handle, no_restart=True)
        self.members.pop(m.name, None)

    def describe(self) -> list[dict]:
        return [m.describe() for m in self.members.values()]

    async def stop(self) -> None:
        for m in list(self.members.values()):
            self._forget(m)


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
