"""`duet cluster`: duetserve instances as Ray actors across the nodes of a Ray cluster,
and the router in front of them (docs/scaling.md).

    duet cluster --replicas 2                                   # colocated replicas
    duet cluster --prefill 1 --decode 2 \\
        --prefill-resources '{"prefill": 1}' --decode-resources '{"decode": 1}'
    curl -X POST localhost:8080/cluster/instances -d '{"kind": "decode"}'   # scale up
    curl -X DELETE localhost:8080/cluster/instances/decode-1            # drain, remove

This process is the Ray driver: it owns the actors (they end with it) and runs the
router (router/app.py) with the controller (cluster/controller.py) filling its pool.

    GET    /cluster                    the instances: kind, node, pid, URL, restarts
    POST   /cluster/instances          {"kind": K}: start one more, answer once it serves
    DELETE /cluster/instances/NAME     drain it (no new requests; in-flight ones finish),
                                       then stop it
Admin routes need `Authorization: Bearer KEY` when --admin-key (or DUET_ADMIN_KEY) is set.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import time
from contextlib import asynccontextmanager

from duetserve.entrypoints.cli import UserError

log = logging.getLogger("duetserve.cluster")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from duetserve.entrypoints.router.app import add_policy_arguments
    from duetserve.entrypoints.shared_args import add_bind_arguments, add_kv_backend_argument
    p.add_argument("--ray", default="auto", metavar="ADDRESS",
                   help="Ray cluster to join: auto (default: the one `ray start` runs on "
                        "this host, or RAY_ADDRESS), HOST:PORT of its head, or local (a "
                        "private one-node Ray for trying it out)")
    p.add_argument("--replicas", type=int, default=None,
                   help="colocated replicas (each `duet serve --role both`)")
    p.add_argument("--prefill", type=int, default=None, help="prefill instances")
    p.add_argument("--decode", type=int, default=None, help="decode instances")
    for kind in ("replica", "prefill", "decode"):
        p.add_argument(f"--{kind}-resources", default="{}", metavar="JSON",
                       help=f"Ray resources each {kind} instance needs besides "
                            f"--instance-cpus, e.g. '{{\"{kind}\": 1}}' (nodes started "
                            f"with --resources='{{\"{kind}\": N}}' take at most N)")
    p.add_argument("--instance-cpus", type=float, default=1.0,
                   help="Ray CPUs each instance reserves (default %(default)s); set "
                        "--num-threads in --serve-args to match")
    p.add_argument("--serve-args", default="",
                   help="`duet serve` flags for every instance, one string (model, "
                        "threads, engine flags), e.g. \"--num-threads 2 --max-num-seqs "
                        "8\"; host, port, role and transfer backend are set per instance")
    add_kv_backend_argument(p, "mooncake", "how decode instances read KV: mooncake (TCP, "
                            "any node) or shm (only when every instance shares one host)")
    p.add_argument("--max-restarts", type=int, default=10,
                   help="times Ray restarts a dead instance (-1: forever; default "
                        "%(default)s)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds a removed instance may take to finish its requests "
                        "(default %(default)s); what is left then ends with an error")
    add_bind_arguments(p, 8080, "router")
    p.add_argument("--admin-key", default=None,
                   help="require `Authorization: Bearer KEY` on /cluster routes (default: "
                        "env DUET_ADMIN_KEY)")
    add_policy_arguments(p)


def _initial(args: argparse.Namespace) -> dict[str, int]:
    """{kind: count} from --replicas or --prefill/--decode. Raises UserError."""
    colocated = args.replicas is not None
    if colocated == (args.prefill is not None or args.decode is not None):
        raise UserError("give --replicas N, or --prefill P and --decode D")
    counts = {"replica": args.replicas} if colocated else \
        {"prefill": args.prefill, "decode": args.decode}
    for kind, n in counts.items():
        if n is None or n < 1:
            raise UserError(f"--{kind}{'s' if kind == 'replica' else ''} must be >= 1, "
                            f"got {n}")
    return counts


def _spec(args: argparse.Namespace):
    from duetserve.cluster.controller import InstanceSpec
    resources = {}
    for kind in ("replica", "prefill", "decode"):
        text = getattr(args, f"{kind}_resources")
        try:
            value = json.loads(text)
        except ValueError as e:
            raise UserError(f"--{kind}-resources: not JSON: {e}") from None
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and v > 0
                for k, v in value.items()):
            raise UserError(f"--{kind}-resources must be a JSON object of positive "
                            f"numbers, got {text}")
        resources[kind] = value
    if args.instance_cpus < 0:
        raise UserError(f"--instance-cpus must be >= 0, got {args.instance_cpus}")
    if args.drain_timeout <= 0 or args.health_interval <= 0:
        raise UserError("--drain-timeout and --health-interval must be > 0")
    return InstanceSpec(tuple(shlex.split(args.serve_args)), resources, args.instance_cpus,
                       args.max_restarts, args.kv_transfer_backend,
                       drain_timeout_s=args.drain_timeout,
                       watch_interval_s=min(args.health_interval, 1.0))


def connect(address: str) -> None:
    import ray
    t0 = time.monotonic()
    if address == "local":
        ray.init(address="local", include_dashboard=False, namespace="duetserve")
    else:
        ray.init(address=None if address == "auto" else address, namespace="duetserve")
    log.warning("connected to Ray in %.1f s: %d node(s), %s", time.monotonic() - t0,
                len([n for n in ray.nodes() if n.get("Alive")]), ray.cluster_resources())


def main(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from duetserve.cluster.admin import add_admin_routes
    from duetserve.cluster.controller import ClusterError, Controller
    from duetserve.entrypoints.openai.http_guard import QuietExitServer
    from duetserve.entrypoints.router.app import Policies, build_app, setup_logging
    from duetserve.entrypoints.router.pool import InstancePool
    from duetserve.entrypoints.router.upstream import Timeouts
    from duetserve.entrypoints.web import page_url

    counts = _initial(args)
    spec = _spec(args)
    try:
        timeouts = Timeouts.from_args(args)
    except ValueError as e:
        raise UserError(str(e)) from None
    pool = InstancePool([], "replica" in counts, args.health_interval)
    try:      # the flags every instance gets, checked here before Ray starts anything
        from duetserve.cluster.instance import serve_args
        for kind in counts:
            serve_args(kind, list(spec.serve_args), "127.0.0.1", spec.kv_backend)
    except ValueError as e:
        raise UserError(str(e)) from None
    setup_logging()
    logging.getLogger("duetserve.cluster").setLevel(logging.INFO)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UserError("duet cluster needs Ray: pip install 'duetserve[ray]'") from None
    connect(args.ray)
    controller_ref: dict = {}
    t0 = time.monotonic()

    @asynccontextmanager
    async def lifespan_hook(client):
        controller = controller_ref["c"] = Controller(pool, spec, client)
        try:
            await asyncio.gather(*(controller.add(kind) for kind, n in counts.items()
                                   for _ in range(n)))
            log.warning("cluster up in %.1f s: %s", time.monotonic() - t0,
                        ", ".join(f"{m['name']}@{m['host']}" for m in controller.describe()))
            yield
        except ClusterError as e:
            log.error("cluster start failed: %s", e)
            raise
        finally:
            await controller.stop()

    app = build_app(pool, Policies.from_args(args), timeouts, lifespan_hook)
    add_admin_routes(app, controller_ref, args.admin_key or os.environ.get("DUET_ADMIN_KEY"))
    log.warning("router at http://%s:%d/v1 (admin: /cluster); dashboards: %s", args.host,
                args.port, page_url(args.host, args.port, "/dashboard"))
    try:     # SIGTERM/SIGINT: the lifespan stops the actors, then Ray is left; exit 0
        QuietExitServer(uvicorn.Config(app, host=args.host, port=args.port,
                                       log_level="warning")).run()
    finally:
        import ray
        ray.shutdown()
    return 0
