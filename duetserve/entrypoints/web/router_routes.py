"""The pages on the router (`duet router`, `duet cluster`): one `install` call.

    GET /, /ui                    the chat page (over the router's /v1 endpoints)
    GET /dashboard                a summary of every instance, and any one instance's
                                  live dashboard (the same page as `duet serve`'s)
    GET /ui/info                  the first healthy instance's, marked router: true
    GET /dashboard/summary        per instance: the pool's view (health, in flight,
                                  served) and its /dashboard/data?steps=0
    GET /dashboard/instance       ?name=NAME&since=SEQ: that instance's /dashboard/data

Instances are asked concurrently with a short timeout; one that does not answer shows
its error in its row and does not hold up the others. The caller's Authorization header
is passed on (instances started with --api-key).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from duetserve.entrypoints.router.flow import error_body
from duetserve.entrypoints.router.pool import Instance, InstancePool
from duetserve.entrypoints.web.pages import page_response, render

INSTANCE_TIMEOUT_S = 3.0


def install(app: FastAPI, pool: InstancePool,
            client: Callable[[], httpx.AsyncClient]) -> None:
    """Add the pages and their data routes to the router app. `client()` returns the
    router's HTTP client (created in its lifespan)."""
    chat = render("chat", {"page": "chat", "router": True})
    dashboard = render("dashboard", {"page": "dashboard", "router": True})

    @app.get("/", include_in_schema=False)
    @app.get("/ui", include_in_schema=False)
    async def chat_page():
        return page_response(chat)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return page_response(dashboard)

    @app.get("/ui/info")
    async def ui_info(raw: Request):
        for inst in pool.all:
            if inst.available and inst.kind in pool.serving_kinds:
                status, data = await _get(client(), inst, "/ui/info", raw)
                if status == 200:
                    return {**data, "router": True, "instances": len(pool.all)}
        return JSONResponse(error_body("no healthy instance answered /ui/info",
                                       "ServiceUnavailableError", 503), 503)

    @app.get("/dashboard/summary")
    async def summary(raw: Request):
        answers = await asyncio.gather(*(
            _get(client(), inst, "/dashboard/data?steps=0", raw) for inst in pool.all))
        return {"now": time.time(), "colocated": pool.colocated,
                "instances": [_row(inst, status, data)
                              for inst, (status, data) in zip(pool.all, answers)]}

    @app.get("/dashboard/instance")
    async def instance_data(raw: Request, name: str, since: int = Query(0, ge=0)):
        inst = next((i for i in pool.all if i.name == name), None)
        if inst is None:
            return JSONResponse(error_body(f"no instance named {name!r}", "NotFoundError",
                                           404), 404)
        status, data = await _get(client(), inst, f"/dashboard/data?since={since}", raw)
        return JSONResponse(data, status)


async def _get(client: httpx.AsyncClient, inst: Instance, path: str,
               raw: Request) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of GET inst.url + path; a 502 body when it cannot answer."""
    headers = {}
    if "authorization" in raw.headers:
        headers["Authorization"] = raw.headers["authorization"]
    try:
        r = await client.get(inst.url + path, headers=headers, timeout=INSTANCE_TIMEOUT_S)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as e:
        return 502, error_body(f"instance {inst.name} ({inst.url}): {type(e).__name__}: "
                               f"{e}", "BadGatewayError", 502)


def _row(inst: Instance, status: int, data: dict[str, Any]) -> dict[str, Any]:
    """One instance's summary row: the pool's view and what its data say."""
    row: dict[str, Any] = {"name": inst.name, "url": inst.url, "kind": inst.kind,
                           "healthy": inst.healthy, "draining": inst.draining,
                           "in_flight": inst.in_flight, "served": inst.served,
                           "last_error": inst.last_error}
    if status != 200:
        row["error"] = (data.get("error") or {}).get("message") or f"HTTP {status}"
        return row
    requests = data.get("requests", {})
    row.update({"state": data.get("state"), "recent": data.get("recent"),
                "finished": requests.get("finished"),
                "generation_tokens": requests.get("generation_tokens"),
                "ttft": requests.get("ttft"), "tpot": requests.get("tpot"),
                "transfers": data.get("transfers", {}).get("counts"),
                "role": (data.get("info") or {}).get("role"),
                "model": (data.get("info") or {}).get("model")})
    return row
