"""`duet router --prefill URL[,URL...] --decode URL[,URL...]`: the OpenAI API in front of
prefill and decode instances (`duet serve --role prefill|decode`); or
`duet router --replica URL[,URL...]` in front of colocated replicas (`--role both`).

    POST /v1/completions, /v1/chat/completions   disaggregated: split into samples
                                                 (merge.py), each prefill -> decode
                                                 (flow.py); colocated: to one replica
                                                 whole (proxy.py)
    GET  /v1/models                              a healthy (prefill or replica) instance's
    GET  /health                                 200 while each kind has a healthy one
    GET  /instances                              the pool: health, load, last error
    GET  /metrics                                requests, per-instance counts, TTFT split
    GET  /, /dashboard                           chat page; every instance's dashboard
                                                 and a summary (entrypoints/web/)

Every call to an instance goes through upstream.py (failover, timeouts, error bodies).
build_app = the handlers' shared state (RouterState) + the lifespan (client, health loop)
+ the generation routes + the information routes. `duet cluster` (duetserve/cluster/)
builds the same app over a pool it fills at run time.
"""
from __future__ import annotations

import argparse
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from duetserve.entrypoints.cli import UserError
from duetserve.entrypoints.router.flow import Flow, Timings
from duetserve.entrypoints.router.merge import complete, split, stream
from duetserve.entrypoints.router.policy import POLICIES, Policy
from duetserve.entrypoints.router.pool import Instance, InstancePool, parse_urls
from duetserve.entrypoints.router.proxy import Proxy
from duetserve.entrypoints.router.upstream import (Timeouts, Upstream, UpstreamError,
                                                   answer_json, error_body, unavailable)
from duetserve.entrypoints.shared_args import add_bind_arguments
from duetserve.entrypoints.web import page_url
from duetserve.entrypoints.web.router_routes import install as install_web_pages

log = logging.getLogger("duetserve.router")
BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]


# Idle pooled connections to the instances are dropped after this many seconds. It must
# stay below the instances' keep-alive timeout (`duet serve --timeout-keep-alive`, 5 s by
# default; httpx's own default expiry is also 5 s): otherwise the router can reuse a
# connection at the moment the instance closes it, and the request fails with ReadError
# (seen in tests/entrypoints/test_disagg.py: "decode instance ... failed: ReadError").
KEEPALIVE_EXPIRY_S = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", default=None, help="prefill instance URLs, comma-separated")
    p.add_argument("--decode", default=None, help="decode instance URLs, comma-separated")
    p.add_argument("--replica", default=None,
                   help="colocated replica URLs (`duet serve`), comma-separated; instead of "
                        "--prefill/--decode")
    add_bind_arguments(p, 8080, "router")
    add_policy_arguments(p)


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """The picking, health-check and timeout flags (shared with `duet cluster`)."""
    p.add_argument("--prefill-policy", default="prefix", choices=POLICIES,
                   help="how a prefill instance is picked (default %(default)s)")
    p.add_argument("--decode-policy", default="least_loaded", choices=POLICIES[:2],
                   help="how a decode instance is picked (default %(default)s)")
    p.add_argument("--replica-policy", default="least_loaded", choices=POLICIES[:2],
                   help="how a colocated replica is picked (default %(default)s)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health checks of each instance (default %(default)s)")
    p.add_argument("--upstream-connect-timeout", type=float, default=Timeouts.connect_s,
                   help="seconds to reach an instance; one that cannot be reached is taken "
                        "out and the next is tried (default %(default)s)")
    p.add_argument("--upstream-read-timeout", type=float, default=Timeouts.read_s,
                   help="seconds an instance may take to send the next bytes of an answer "
                        "(the whole answer of a non-streamed call, the gap between two "
                        "chunks of a stream); one that takes longer is taken out and the "
                        "request ends with a 504 (default %(default)s)")


class PoolCollector:
    """Per-instance series read from the pool at scrape time (instances come and go)."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    def collect(self):
        served = CounterMetricFamily("duet_router:instance_requests", "Requests the router "
                                     "sent to each instance (attempts, failovers included).",
                                     labels=["instance", "kind"])
        in_flight = GaugeMetricFamily("duet_router:instance_in_flight", "Router requests "
                                      "being served by each instance now.",
                                      labels=["instance", "kind"])
        healthy = GaugeMetricFamily("duet_router:instance_healthy", "1 while the instance "
                                    "may get requests (healthy, not draining).",
                                    labels=["instance", "kind"])
        for i in self.pool.all:
            served.add_metric([i.name, i.kind], i.served)
            in_flight.add_metric([i.name, i.kind], i.in_flight)
            healthy.add_metric([i.name, i.kind], 1.0 if i.available else 0.0)
        return [served, in_flight, healthy]


@dataclass
class Policies:
    """How an instance of each kind is picked."""

    prefill: Policy = field(default_factory=lambda: Policy("prefix"))
    decode: Policy = field(default_factory=lambda: Policy("least_loaded"))
    replica: Policy = field(default_factory=lambda: Policy("least_loaded"))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Policies:
        return cls(Policy(args.prefill_policy), Policy(args.decode_policy),
                   Policy(args.replica_policy))


class RouterMetrics:
    """The router's own Prometheus series, and the pool's read at scrape time."""

    def __init__(self, pool: InstancePool) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("duet_router:requests", "Requests by outcome.", ["outcome"],
                                registry=self.registry)
        self.phase = Histogram(
            "duet_router:ttft_phase_seconds", "Per sample, as the router sees it: prefill "
            "(to the prefill answer: queue + prefill + first token) and first_decode (to the "
            "first decode chunk: transfer + first decode step).", ["phase"], buckets=BUCKETS,
            registry=self.registry)
        self.registry.register(PoolCollector(pool))

    def on_timings(self, t: Timings) -> None:
        if t.prefill_s is not None:
            self.phase.labels("prefill").observe(t.prefill_s)
        if t.first_decode_s is not None:
            self.phase.labels("first_decode").observe(t.first_decode_s)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()


@dataclass
class Running:
    """What exists while the app runs (made by its lifespan)."""

    upstream: Upstream
    flow: Flow
    proxy: Proxy


@dataclass
class RouterState:
    """What the router's handlers share. `running` is set between start-up and
    shutdown (the lifespan)."""

    pool: InstancePool
    policies: Policies
    timeouts: Timeouts
    metrics: RouterMetrics
    running: Running | None = None

    def live(self) -> Running:
        if self.running is None:
            raise RuntimeError("the router app is not running (its lifespan has not started)")
        return self.running


def build_app(pool: InstancePool, policies: Policies | None = None,
              timeouts: Timeouts | None = None, lifespan_hook=None) -> FastAPI:
    """The router app over `pool`. `lifespan_hook(client)`: an async context manager
    entered at start-up before the first health check (`duet cluster` starts and
    registers its instances there) and left at shutdown."""
    state = RouterState(pool, policies or Policies(), timeouts or Timeouts(),
                        RouterMetrics(pool))
    app = FastAPI(title="duetserve router", lifespan=_lifespan(state, lifespan_hook))
    _add_generation_routes(app, state)
    _add_info_routes(app, state)
    install_web_pages(app, state.pool,                   # /, /dashboard (web/)
                      lambda: state.running.upstream.client)
    return app


def _lifespan(state: RouterState, lifespan_hook):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(limits=limits, timeout=state.timeouts.for_httpx()
                                     ) as client:
            upstream = Upstream(client, state.pool, state.timeouts)
            state.running = Running(
                upstream, Flow(upstream, state.policies.prefill, state.policies.decode,
                               state.metrics.on_timings),
                Proxy(upstream, state.policies.replica))
            try:
                async with (lifespan_hook(client) if lifespan_hook else _nothing()):
                    await state.pool.check_all(client)
                    state.pool.start(client)
                    try:
                        yield
                    finally:
                        await state.pool.stop()
            finally:
                state.running = None
    return lifespan


def _add_generation_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await _generate(state, raw, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await _generate(state, raw, "chat")


async def _generate(state: RouterState, raw: Request, kind: str) -> Response:
    try:
        body = await raw.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
    except ValueError as e:
        state.metrics.count("bad_request")
        return JSONResponse(error_body(f"malformed JSON body: {e}", "BadRequestError", 400),
                            400)
    try:
        if state.pool.colocated:
            return await _forward(state, body, kind)
        return await _split(state, body, kind)
    except UpstreamError as e:
        state.metrics.count("error")
        return JSONResponse(e.body, status_code=e.status)


async def _split(state: RouterState, body: dict, kind: str) -> Response:
    """Disaggregated: the request's samples, each through a prefill and a decode
    instance, merged. Raises UpstreamError."""
    flow = state.live().flow
    samples, n = split(body, kind)
    if samples and samples[0].stream:
        include = bool((body.get("stream_options") or {}).get("include_usage"))
        state.metrics.count("stream")
        return StreamingResponse(stream(flow, samples, n, include),
                                 media_type="text/event-stream")
    out = await complete(flow, samples, n)
    state.metrics.count("ok")
    return JSONResponse(out)


async def _forward(state: RouterState, body: dict, kind: str) -> Response:
    """Colocated: the request whole to one replica. Raises UpstreamError."""
    proxy = state.live().proxy
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if body.get("stream"):
        opened = await proxy.open_stream(path, body)
        state.metrics.count("stream")
        return StreamingResponse(proxy.relay(path, body, opened),
                                 media_type="text/event-stream")
    status, out = await proxy.complete(path, body)
    state.metrics.count("ok" if status == 200 else "error")
    return JSONResponse(out, status_code=status)


def _add_info_routes(app: FastAPI, state: RouterState) -> None:
    pool = state.pool

    @app.get("/v1/models")
    async def models():
        kind = pool.serving_kinds[0]
        upstream = state.live().upstream

        async def attempt(inst: Instance) -> JSONResponse:
            r = await upstream.client.get(inst.url + "/v1/models")
            return JSONResponse(answer_json(r), r.status_code)
        policy = state.policies.replica if pool.colocated else state.policies.prefill
        try:
            return await upstream.failover(kind, policy, attempt)
        except UpstreamError as e:
            return JSONResponse(e.body, e.status)

    @app.get("/health")
    async def health():
        if pool.ready():
            return Response(status_code=200)
        e = unavailable(f"no healthy {' or '.join(pool.serving_kinds)} instance")
        return JSONResponse(e.body, e.status)

    @app.get("/instances")
    async def instances():
        return {"instances": [{"name": i.name, "url": i.url, "kind": i.kind,
                               "healthy": i.healthy, "draining": i.draining,
                               "in_flight": i.in_flight, "served": i.served, "load": i.load,
                               "last_error": i.last_error} for i in pool.all]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


def main(args: argparse.Namespace) -> int:
    import uvicorn
    colocated = args.replica is not None
    if colocated == (args.prefill is not None or args.decode is not None):
        raise UserError("give --replica, or --prefill and --decode (not both kinds)")
    if not colocated and (args.prefill is None or args.decode is None):
        raise UserError("--prefill and --decode go together")
    try:
        instances = parse_urls(args.replica, "replica") if colocated else \
            parse_urls(args.prefill, "prefill") + parse_urls(args.decode, "decode")
        pool = InstancePool(instances, colocated, args.health_interval)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not args.health_interval > 0:
        raise UserError(f"--health-interval must be > 0, got {args.health_interval}")
    setup_logging()
    try:
        timeouts = Timeouts.from_args(args)
    except ValueError as e:
        raise UserError(str(e)) from None
    app = build_app(pool, Policies.from_args(args), timeouts)
    if colocated:
        log.info("router at http://%s:%d/v1: replicas %s (%s)", args.host, args.port,
                 args.replica, args.replica_policy)
    else:
        log.info("router at http://%s:%d/v1: prefill %s (%s), decode %s (%s)", args.host,
                 args.port, args.prefill, args.prefill_policy, args.decode,
                 args.decode_policy)
    log.info("open %s for the instances' dashboards, %s to chat",
             page_url(args.host, args.port, "/dashboard"), page_url(args.host, args.port))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)    # not every health check


@asynccontextmanager
async def _nothing():
    yield
