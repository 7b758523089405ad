"""The pages and their data on an OpenAI server (`duet serve`): one `install` call.

    GET /, /ui             the chat page
    GET /dashboard         the live dashboard
    GET /ui/info           model, chat template or not, role, hardware ceilings
    GET /dashboard/data    ?since=SEQ: the steps recorded after SEQ, queue/KV state,
                           request and transfer summaries, per-phase totals
                           (&steps=0: everything but the step rows; the router's summary)

The data come from a LiveRecorder (metrics/live.py) fed by the engine's own hooks (the
step observer, the idle-stats, finish and transfer observers), never from the
Prometheus text. Steps are recorded only while a page polls (see live.py).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query

from duetserve import __version__
from duetserve.engine.async_engine import AsyncEngine
from duetserve.entrypoints.web.pages import page_response, render
from duetserve.metrics.live import LiveRecorder


def install(app: FastAPI, engine: AsyncEngine, served_model_name: str,
            recorder: LiveRecorder | None = None) -> LiveRecorder:
    """Add the pages and /ui/info, /dashboard/data to `app`; register the recorder's
    observers on `engine` (mutates the engine's observer lists). Returns the recorder."""
    core = engine.engine
    rec = recorder or LiveRecorder()
    rec.latest = core.last_step
    core.add_step_observer(rec.observe_step)
    engine.idle_stats_observers.append(rec.observe_state)
    engine.finish_observers.append(rec.observe_finished)
    roles = core.kv_roles
    if roles is not None:
        roles.connector.observers.append(rec.observe_transfer)
    info = server_info(engine, served_model_name)
    chat = render("chat", {"page": "chat", "router": False})
    dashboard = render("dashboard", {"page": "dashboard", "router": False})

    @app.get("/", include_in_schema=False)
    @app.get("/ui", include_in_schema=False)
    async def chat_page():
        return page_response(chat)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return page_response(dashboard)

    @app.get("/ui/info")
    async def ui_info():
        return info

    @app.get("/dashboard/data")
    async def dashboard_data(since: int = Query(0, ge=0), steps: int = Query(1, ge=0, le=1)):
        out = rec.snapshot(since, with_steps=bool(steps))
        out["totals"] = phase_totals(core.accountant.summary())
        out["held_transfers"] = roles.connector.num_held if roles is not None else 0
        out["info"] = info
        return out

    return rec


def server_info(engine: AsyncEngine, served_model_name: str) -> dict[str, Any]:
    """What the pages show once: the model, its limits, the role, the roofline's
    ceilings (the engine accountant's hardware profile and compute dtype)."""
    core = engine.engine
    acc = core.accountant
    roles = core.kv_roles
    hw = acc.hardware
    return {
        "model": served_model_name, "version": __version__, "router": False,
        "max_model_len": engine.max_model_len,
        "has_chat_template": bool(getattr(engine.tokenizer, "chat_template", None)),
        "role": roles.config.role if roles is not None else "both",
        "num_blocks": core.num_blocks, "block_size": core.config.block_size,
        "max_num_batched_tokens": core.max_num_batched_tokens,
        "speculation": core.speculator is not None,
        "hardware": {"name": hw.name, "description": hw.description,
                     "measured": hw.measured, "compute_dtype": acc.compute_dtype,
                     "peak_flops": acc.peak_flops, "mem_bandwidth": acc.mem_bandwidth,
                     "ridge": acc.peak_flops / acc.mem_bandwidth}}


def phase_totals(summary: dict[str, Any]) -> dict[str, Any]:
    """The accountant's per-phase totals, trimmed to what the dashboard shows."""
    keep = ("steps", "tokens", "seconds", "time_weighted_mfu", "time_weighted_mbu")
    return {phase: {k: summary[phase][k] for k in keep}
            for phase in ("prefill", "decode", "mixed", "all")}
