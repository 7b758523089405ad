"""The FastAPI app: routes, OpenAI-shaped errors, API-key check, metrics wiring.

    POST /v1/completions, /v1/chat/completions     (serving.py: prompt, params,
                                                    generation, render_*.py)
    GET  /v1/models, /health, /version, /metrics
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (lora_routes.py)
    GET  /load, POST /kv/release                   (prefill/decode disaggregation)
    GET  /, /ui, /dashboard, /ui/info, /dashboard/data   (entrypoints/web/)

Every client mistake is a 4xx with {"error": {"message", "type", "param", "code"}}:
FastAPI's 422 validation errors (malformed JSON, wrong types, missing fields) become 400.
"""
from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from duetserve import __version__
from duetserve.engine.async_engine import AsyncEngine
from duetserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   error_body)
from duetserve.entrypoints.openai.http_guard import RequestGuard
from duetserve.entrypoints.openai.context import APIError, ServerContext
from duetserve.entrypoints.openai.lora_routes import LoRARegistry, add_lora_routes
from duetserve.entrypoints.openai.serving import create_chat_completion, create_completion
from duetserve.entrypoints.web import PAGE_PATHS
from duetserve.entrypoints.web.server_routes import install as install_web_pages
from duetserve.metrics.kv_store import KVStoreMetrics
from duetserve.metrics.kv_transfer import KVTransferMetrics
from duetserve.metrics.lora import LoRAMetrics
from duetserve.worker.kv_cache import kv_dtype_name
from duetserve.metrics.prometheus import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("duetserve.serve")

OPEN_PATHS = frozenset({"/health"}) | PAGE_PATHS     # the pages hold no data


class ApiKeyMiddleware:
    """Pure ASGI middleware (does not wrap streaming bodies): 401 without the right
    `Authorization: Bearer <key>`, except on OPEN_PATHS."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = JSONResponse(error_body("invalid or missing API key (send "
                                               "`Authorization: Bearer <key>`)",
                                               "AuthenticationError", None, 401), 401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('msg')}", None
    where = ".".join(loc)
    param = loc[0] if loc else None
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"{where}: {err.get('msg')}" if where else str(err.get("msg"))) + more, param


DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_READ_TIMEOUT_S = 10.0


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              model_path: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              read_timeout: float = DEFAULT_READ_TIMEOUT_S) -> FastAPI:
    """The app; the engine thread starts and stops with the app's lifespan. Bodies past
    `max_request_bytes` get 413 before parsing; a body stalling `read_timeout` s, 408."""
    metrics = server_metrics(engine, served_model_name)
    core = engine.engine
    loras = LoRARegistry(core.runner.lora.check, served_model_name, core.config.lora_modules)
    ctx = ServerContext(engine, served_model_name, core.model_config.vocab_size,
                        engine.max_model_len, on_first_chunk=metrics.observe_first_chunk,
                        loras=loras)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="duetserve", version=__version__, lifespan=lifespan)
    app.state.ctx, app.state.metrics = ctx, metrics
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    # Outermost: arrival stamp, drain, body bound (before auth and before any parsing).
    app.add_middleware(RequestGuard, ctx=ctx, max_request_bytes=max_request_bytes,
                       read_timeout=read_timeout)
    add_error_handlers(app)
    # The routes, one group per feature: a new feature adds its group here.
    add_generation_routes(app, ctx)
    add_info_routes(app, ctx, metrics, model_path)
    add_disaggregation_routes(app, ctx)
    add_lora_routes(app, ctx)
    install_web_pages(app, engine, served_model_name)   # /, /ui, /dashboard (web/)
    return app


def server_metrics(engine: AsyncEngine, served_model_name: str) -> ServerMetrics:
    """The server's Prometheus metrics, observing the engine's steps and finished requests
    (and, disaggregated, its KV transfers). Mutates the engine's observer lists."""
    core = engine.engine
    metrics = ServerMetrics(served_model_name, engine.max_model_len,
                            core.max_num_batched_tokens,
                            slo_s=(core.config.slo_ttft_ms / 1e3,
                                   core.config.slo_tpot_ms / 1e3))
    loaded = core.loaded
    policy = loaded.kernel_policy
    metrics.set_kernel_info(
        ", ".join(f"{v} {k}" for k, v in loaded.quant_summary.items() if k.startswith("int"))
        or f"dense {str(loaded.dtype).replace('torch.', '')}",
        str(policy.dense_dtype if policy else loaded.dtype).replace("torch.", ""),
        policy.lowbit_max_rows if policy else -1,
        policy.reason if policy else loaded.dense_kernels)
    metrics.set_kv_cache_info(kv_dtype_name(core.kv_dtype),
                              core.kv_capacity_tokens,
                              core.kv_bytes_per_token)
    core.add_step_observer(metrics.observe_step)
    if core.disk_cache is not None:     # the prefix cache's disk tier (--kv-store)
        store = KVStoreMetrics(metrics.registry, served_model_name,
                               core.disk_cache.io.store.snapshot, metrics._lock)
        store.observe_step()
        core.add_step_observer(store.observe_step)
        engine.idle_stats_observers.append(store.observe_step)
    engine.idle_stats_observers.append(metrics.observe_step)
    engine.finish_observers.append(metrics.observe_finished)
    lora = LoRAMetrics(metrics.registry, served_model_name, core.runner.lora, metrics._lock)
    core.add_step_observer(lora.observe_step)
    engine.idle_stats_observers.append(lora.observe_step)
    engine.finish_observers.append(lora.observe_finished)
    roles = core.kv_roles
    if roles is not None:      # disaggregated: transfer metrics, TTFT split, trace spans
        kv_metrics = KVTransferMetrics(metrics.registry, served_model_name,
                                       roles.config.role, metrics._lock)
        roles.connector.observers.append(kv_metrics.observe_transfer)
        engine.finish_observers.append(kv_metrics.observe_finished)
        if core.trace is not None:
            roles.connector.observers.append(core.trace.transfer)
    return metrics


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object: APIError as raised, FastAPI's validation
    errors as 400, 404/405, anything unexpected as 500 (logged)."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "BadRequestError", param, 400), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code,
                                                                         "HTTPError")
        return JSONResponse(error_body(str(exc.detail), kind, None, exc.status_code),
                            exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unexpected error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                       "InternalServerError", None, 500), 500)


def add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    """POST /v1/completions and /v1/chat/completions (serving.py)."""
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)


def add_info_routes(app: FastAPI, ctx: ServerContext, metrics: ServerMetrics,
                    model_path: str | None) -> None:
    """GET /v1/models, /health (503 while draining or without an engine loop), /version,
    /metrics."""
    engine = ctx.engine
    created = int(time.time())

    @app.get("/v1/models")
    async def models():
        base = {"id": ctx.served_model_name, "object": "model", "created": created,
                "owned_by": "duetserve", "root": model_path or ctx.served_model_name,
                "parent": None, "max_model_len": engine.max_model_len}
        adapters = [{**base, "id": lora.lora_name, "root": lora.lora_path,
                     "parent": ctx.served_model_name}
                    for lora in list(ctx.loras.by_name.values())]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/health")
    async def health():
        if ctx.draining:
            return JSONResponse(error_body("the server is shutting down",
                                           "ServiceUnavailableError", None, 503), 503)
        if not engine.is_running:
            return JSONResponse(error_body("the engine loop is not running",
                                           "ServiceUnavailableError", None, 503), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def add_disaggregation_routes(app: FastAPI, ctx: ServerContext) -> None:
    """GET /load (what the router's least-loaded policy reads) and POST /kv/release (a
    decode instance finished reading a transfer)."""
    core = ctx.core
    roles = core.kv_roles

    @app.get("/load")
    async def load():
        """What the router's least-loaded policy reads: the latest step's queue and KV
        state (a snapshot the engine thread replaces after every step and abort)."""
        st = core.last_step
        return {"role": roles.config.role if roles else "both",
                "num_running": st.num_running, "num_waiting": st.num_waiting,
                "kv_usage": st.kv_usage, "num_used_blocks": st.num_used_blocks,
                "num_held_transfers": roles.connector.num_held if roles else 0}

    @app.post("/kv/release")
    async def kv_release(raw: Request):
        """Free the blocks a prefill instance held for the transfer."""
        if roles is None or roles.config.role != "prefill":
            raise APIError("this instance is not a prefill instance", 404, None,
                           "NotFoundError")
        try:
            body = await raw.json()
            transfer_id, ok = str(body["transfer_id"]), bool(body.get("ok", True))
        except Exception:  # noqa: BLE001 - malformed control message
            raise APIError("expected {\"transfer_id\": str, \"ok\": bool}") from None
        held = roles.connector.post_release(transfer_id, ok)
        return {"released": transfer_id, "held": held}
