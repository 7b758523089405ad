"""The /cluster admin routes `duet cluster` adds to the router app:

    GET    /cluster                    the instances: kind, node, pid, URL, restarts
    POST   /cluster/instances          {"kind": K}: start one more, answer once it serves
    DELETE /cluster/instances/NAME     drain it (no new requests; in-flight ones finish),
                                       then stop it

With an admin key, each needs `Authorization: Bearer KEY` (401 otherwise).
"""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from duetserve.cluster.controller import ClusterError
from duetserve.entrypoints.router.upstream import error_body


def add_admin_routes(app: FastAPI, controller_ref: dict, admin_key: str | None) -> None:
    """/cluster routes on the router app; controller_ref["c"] is set at start-up."""
    def refused(raw: Request) -> JSONResponse | None:
        if admin_key and not hmac.compare_digest(
                raw.headers.get("authorization", "").encode(),
                f"Bearer {admin_key}".encode()):
            return JSONResponse(error_body("invalid or missing admin key",
                                           "AuthenticationError", 401), 401)
        return None

    def failed(e: ClusterError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "ClusterError", e.status), e.status)

    @app.get("/cluster")
    async def cluster(raw: Request):
        return refused(raw) or {"instances": controller_ref["c"].describe()}

    @app.post("/cluster/instances")
    async def add(raw: Request):
        if (r := refused(raw)) is not None:
            return r
        try:
            body = await raw.json()
            kind = body["kind"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse(error_body('expected {"kind": "replica"|"prefill"|'
                                           '"decode"}', "BadRequestError", 400), 400)
        try:
            return await controller_ref["c"].add(kind)
        except ClusterError as e:
            return failed(e)

    @app.delete("/cluster/instances/{name}")
    async def remove(name: str, raw: Request):
        if (r := refused(raw)) is not None:
            return r
        try:
            return await controller_ref["c"].remove(name)
        except ClusterError as e:
            return failed(e)
