"""ServerInstance: the Ray actor behind one duetserve instance (controller.py wraps it
with `ray.remote`). Its worker process runs what `duet serve` runs (engine thread,
uvicorn in a thread) bound to the node's address on a port of its own, so several
instances share a node. Ray restarts the process when it dies (max_restarts): __init__
runs again, loads the model, and comes up on a new port that info() reports.

Only control messages pass through Ray (info, drain); requests and KV bytes do not.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
import time

log = logging.getLogger("duetserve.cluster")

ROLE_OF_KIND = {"replica": "both", "prefill": "prefill", "decode": "decode"}
# Flags the cluster sets for every instance (`duet cluster --serve-args` may not).
RESERVED_FLAGS = ("--host", "--port", "--role", "--kv-transfer-host",
                  "--kv-transfer-backend")
START_TIMEOUT_S = 120.0       # uvicorn start-up after the model has loaded


def serve_args(kind: str, extra: list[str], host: str, kv_backend: str
               ) -> argparse.Namespace:
    """`duet serve`'s parsed flags for an instance of `kind` on `host`. Raises
    ValueError for a reserved or unknown flag in `extra` (the operator's flags)."""
    from duetserve.entrypoints.openai.serve import add_arguments
    for flag in extra:
        if flag.split("=", 1)[0] in RESERVED_FLAGS:
            raise ValueError(f"{flag.split('=', 1)[0]} is set by the cluster for each "
                             "instance; leave it out of --serve-args")
    parser = argparse.ArgumentParser(prog="duet serve (cluster instance)", add_help=False)
    add_arguments(parser)
    flags = [*extra, "--role", ROLE_OF_KIND[kind], "--host", host, "--port", "0",
             "--kv-transfer-host", host]
    if kind == "decode":
        flags += ["--kv-transfer-backend", kv_backend]
    try:
        args, unknown = parser.parse_known_args(flags)
    except SystemExit:
        raise ValueError(f"--serve-args: cannot parse {extra}") from None
    if unknown:
        raise ValueError(f"--serve-args: unknown flag(s) {unknown}")
    return args


class ServerInstance:
    """One instance in this Ray worker process. State: the server thread and its
    start time; nothing outside the process is touched. If the server thread ends, the
    process exits so that Ray restarts it."""

    def __init__(self, name: str, kind: str, extra_args: list[str], kv_backend: str
                 ) -> None:
        import ray

        from duetserve.entrypoints.openai.serve import build_server
        t0 = time.monotonic()
        self.name, self.kind = name, kind
        self.host = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.server = build_server(serve_args(kind, extra_args, self.host, kv_backend))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name="duet-http")
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:          # uvicorn start-up (lifespan) is short
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"instance {name}: the HTTP server did not start")
            time.sleep(0.02)
        self.started_at = time.time()
        self.start_s = time.monotonic() - t0
        log.warning("instance %s (%s) serving at %s:%d, pid %d, started in %.1f s", name,
                    kind, self.host, self.port, os.getpid(), self.start_s)

    def _serve(self, sock: socket.socket) -> None:
        try:
            self.server.run(sockets=[sock])
        finally:      # the server stopped under us (the controller kills, never stops it)
            if self.server.started:     # (before that, __init__ raises the failure)
                log.error("instance %s: the HTTP server stopped; exiting for Ray to "
                          "restart it", self.name)
                os._exit(1)

    def info(self) -> dict:
        return {"name": self.name, "kind": self.kind,
                "url": f"http://{self.host}:{self.port}", "host": self.host,
                "node_id": self.node_id, "pid": os.getpid(),
                "started_at": self.started_at, "start_s": round(self.start_s, 3)}

    def drain(self, timeout_s: float) -> dict:
        """Admit nothing new (/health 503, generation requests 503) and wait up to
        timeout_s for in-flight requests and, on a prefill instance, held KV transfers.
        Returns {"drained", "in_flight", "held"}."""
        app_state = self.server.config.app.state
        roles = app_state.ctx.core.kv_roles

        def held() -> int:
            return roles.connector.num_held if roles is not None else 0

        async def wait() -> bool:
            ctx = app_state.ctx
            ctx.draining = True
            deadline = time.monotonic() + timeout_s
            try:
                await asyncio.wait_for(ctx.in_flight.idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                return False
            while held() and time.monotonic() < deadline:   # released by decode reads
                await asyncio.sleep(0.05)
            return held() == 0

        drained = self.server.submit(wait()).result(timeout_s + 5.0)
        return {"drained": drained, "in_flight": app_state.ctx.in_flight.count,
                "held": held()}
