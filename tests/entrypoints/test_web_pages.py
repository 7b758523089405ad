"""The pages and their data over HTTP, without a browser: `duet serve` (a tiny model, in
process, with an API key) and the router in front of it. The browser tests are in
test_web_browser.py."""
from __future__ import annotations

import argparse
import logging
import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from duetserve.entrypoints.openai import serve
from duetserve.entrypoints.web import PAGE_PATHS, page_url
from duetserve.entrypoints.web.pages import PAGES, render

KEY = {"Authorization": "Bearer k"}
ROOT = Path(__file__).resolve().parents[2]
START_LOG: list[str] = []     # what `duet serve` logged while the fixture built it


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        START_LOG.append(record.getMessage())


@pytest.fixture(scope="module")
def client(tiny_checkpoints):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([tiny_checkpoints["llama-gqa-tied"], "--port", "8123",
                         "--num-threads", "2", "--api-key", "k"])
    handler, logger = _Lines(), logging.getLogger("duetserve.serve")
    logger.addHandler(handler)
    try:
        app = serve.build_server(args).config.app
    finally:
        logger.removeHandler(handler)
    with TestClient(app) as c:       # the lifespan stops the engine at exit
        yield c


def test_start_up_log_prints_the_pages_address(client) -> None:
    assert any("http://127.0.0.1:8123/ in a browser" in line and
               "http://127.0.0.1:8123/dashboard" in line for line in START_LOG), START_LOG
    assert page_url("0.0.0.0", 80) == "http://127.0.0.1:80/"
    assert page_url("::1", 80, "/dashboard") == "http://[::1]:80/dashboard"
    assert page_url("10.0.0.2", 9) == "http://10.0.0.2:9/"


def test_pages_are_open_self_contained_and_locked_to_this_origin(client) -> None:
    for path in sorted(PAGE_PATHS):
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        html = r.text
        assert "/*SCRIPT*/" not in html and "/*STYLE*/" not in html
        # No CDN, no web font, no remote image: nothing is fetched from another origin.
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), path
        assert "@import" not in html and "url(http" not in html
    assert client.get("/").text == client.get("/ui").text
    assert "window.DUET = {\"page\": \"dashboard\"" in client.get("/dashboard").text


def test_data_routes_need_the_key(client) -> None:
    for path in ("/ui/info", "/dashboard/data", "/v1/models"):
        assert client.get(path).status_code == 401, path
    info = client.get("/ui/info", headers=KEY).json()
    assert info["has_chat_template"] is False          # the tiny checkpoint has none
    assert info["role"] == "both" and info["num_blocks"] > 0
    assert info["hardware"]["ridge"] == pytest.approx(
        info["hardware"]["peak_flops"] / info["hardware"]["mem_bandwidth"])


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


def test_dashboard_data_follows_the_engine_and_matches_metrics(client) -> None:
    first = client.get("/dashboard/data", headers=KEY).json()    # starts the recording
    since = first["seq"]
    r = client.post("/v1/completions", headers=KEY, json={
        "prompt": "hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    data = client.get(f"/dashboard/data?since={since}", headers=KEY).json()
    fields = data["fields"]
    steps = [dict(zip(fields, row)) for row in data["steps"]]
    assert [s["seq"] for s in steps] == list(range(since + 1, data["seq"] + 1))
    assert sum(s["decode_tokens"] for s in steps) == 4       # 1 token from the prefill step
    assert sum(s["prefill_tokens"] for s in steps) == r.json()["usage"]["prompt_tokens"]
    assert all(s["ai"] > 0 and s["flops_per_s"] > 0 for s in steps)
    text = client.get("/metrics", headers=KEY).text
    assert data["totals"]["all"]["steps"] == _metric(text, "duet:step_duration_seconds_count")
    assert data["totals"]["all"]["tokens"] == (_metric(text, "duet:step_prefill_tokens_sum")
                                               + _metric(text, "duet:step_decode_tokens_sum"))
    req = data["requests"]
    assert req["finished"] == _metric(text, "duet:request_success_total")
    assert req["generation_tokens"] == _metric(text, "duet:generation_tokens_total")
    assert req["ttft"]["n"] >= 1 and req["ttft"]["p50"] > 0
    state = data["state"]
    assert state["prefix_queries"] == _metric(text, "duet:prefix_cache_queries_total")
    assert state["used_blocks"] == _metric(text, "duet:kv_cache_used_blocks")
    assert state["running"] == 0 and data["info"]["model"]
    later = client.get(f"/dashboard/data?since={data['seq']}", headers=KEY).json()
    assert later["steps"] == []
    assert client.get("/dashboard/data?since=-1", headers=KEY).status_code == 400


def test_every_asset_is_package_data() -> None:
    """An installed package serves the same pages: pyproject's package-data globs cover
    every file in static/, and every page's assets exist."""
    static = resources.files("duetserve.entrypoints.web") / "static"
    names = {p.name for p in static.iterdir()}
    for template, styles, scripts in PAGES.values():
        assert {template, *styles, *scripts} <= names
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["duetserve"]
    covered = {p.name for g in globs for p in (ROOT / "duetserve").glob(g)
               if "entrypoints/web/static" in str(p)}
    assert covered == names
    assert render("chat", {"page": "chat"}).startswith(b"<!doctype html>")
