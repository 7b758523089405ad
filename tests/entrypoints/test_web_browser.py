"""The chat page and the dashboard in a real browser: headless Chromium (Debian's package)
driven over the DevTools protocol (cdp.py), against `duet serve` with the default model,
the router in front of it, and a tiny model without a chat template.

Skipped, saying why, where no Chromium is installed; `.ci/run` installs it so CI runs
them. DUET_UI_SCREENSHOTS=docs saves the README's screenshots (docs/ui_chat.png,
docs/ui_dashboard.png); otherwise they go to the test's tmp dir.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cdp import Chromium, find_chromium
from server_process import ServerProcess, free_port

# .ci/run sets DUET_REQUIRE_BROWSER=1: there a missing browser fails the run instead of
# skipping these tests, so a CI pass means the pages were tested in a real browser.
if find_chromium() is None and os.environ.get("DUET_REQUIRE_BROWSER") == "1":
    raise RuntimeError("DUET_REQUIRE_BROWSER=1 but no Chromium was found (make browser "
                       "installs Debian's chromium)")

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium to drive (apt-get install chromium, or set DUET_CHROMIUM); "
           ".ci/run installs it")

COLOURS = ["red", "green", "blue"]
SHOTS = os.environ.get("DUET_UI_SCREENSHOTS")


# n-gram speculation always on: the dashboard's speculation view and decode-row count
# (a verify slice is one row of 1 + k tokens) are exercised; guided requests never
# speculate, and greedy output is the same with or without it.
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--speculative-config", SPEC) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Chromium.launch(str(tmp_path_factory.mktemp("chromium-profile"))) as b:
        yield b


def shot_path(tmp_path, name: str) -> str:
    folder = SHOTS or str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


def open_chat(browser: Chromium, base: str, width: int = 1280, height: int = 800):
    """A fresh chat page (saved settings cleared) with the server's info loaded."""
    page = browser.new_page(width, height)
    page.goto(base + "/")
    page.evaluate("localStorage.clear()")
    page.goto(base + "/")
    page.wait_for("Chat.state.model")
    return page


def set_fields(page, **values: object) -> None:
    for field, value in values.items():
        page.evaluate(f"""(() => {{ const e = document.getElementById({json.dumps(field)});
            e.value = {json.dumps(str(value))}; e.dispatchEvent(new Event("change")); }})()""")


def send(page, text: str, timeout_s: float = 120.0) -> dict:
    """Type `text`, press Send, wait for the reply's stats line; the reply's data."""
    # Every time the page changes, note how much reply text it shows: a reply that
    # streams is seen at several lengths; one parsed at the end is seen once.
    page.evaluate(f"""(() => {{
        window.shownLengths = [];
        const seen = () => {{
            const b = [...document.querySelectorAll('.msg.assistant .body')].pop();
            if (b && b.textContent) window.shownLengths.push(b.textContent.length); }};
        new MutationObserver(seen).observe(document.getElementById("messages"),
            {{childList: true, subtree: true, characterData: true}});
        document.getElementById("input").value = {json.dumps(text)};
        document.getElementById("send").click(); }})()""")
    last = "[...document.querySelectorAll('.msg.assistant')].pop()"
    page.wait_for(f"""(() => {{ const m = {last};
        if (!m) return false;
        const d = m.querySelector('.stats').dataset;
        return d.tokens || d.error; }})()""", timeout_s)
    return page.evaluate(f"""(() => {{ const m = {last};
        return Object.assign({{text: m.querySelector('.body').textContent,
                              error: m.querySelector('.body').classList.contains('err'),
                              lengths: new Set(window.shownLengths).size}},
                             m.querySelector('.stats').dataset); }})()""")


def test_chat_streams_a_reply(server, browser, tmp_path) -> None:
    page = open_chat(browser, server.base)
    assert "chat template" in page.evaluate("document.getElementById('mode-note').textContent")
    max_tokens = 96 if SHOTS else 24      # the README's screenshot shows a longer reply
    set_fields(page, max_tokens=max_tokens, temperature=0, seed=1)
    reply = send(page, "Name three colours.")
    assert not reply["error"] and reply["text"].strip()
    tokens, chunks = int(reply["tokens"]), int(reply["chunks"])
    assert 2 <= tokens <= max_tokens and chunks >= 2
    assert reply["lengths"] >= 2                       # shown piece by piece as it came
    assert all(float(reply[k]) > 0 for k in ("ttftMs", "tpotMs", "tps"))
    assert reply["finish"] in ("stop", "length")
    page.screenshot(shot_path(tmp_path, "ui_chat.png"))
    assert page.errors == []


def test_chat_structured_output(server, browser) -> None:
    page = open_chat(browser, server.base)
    schema = {"type": "object", "properties": {"colour": {"enum": COLOURS}},
              "required": ["colour"], "additionalProperties": False}
    set_fields(page, max_tokens=40, temperature=0, schema=json.dumps(schema))
    reply = send(page, "Pick a colour.")
    assert reply["json"] == "valid"
    assert json.loads(reply["text"])["colour"] in COLOURS
    set_fields(page, schema="{not json")
    error = page.evaluate("document.getElementById('schema-error').textContent")
    assert "JSON schema" in error
    assert page.errors == []


def _metrics(server) -> dict[str, float]:
    m = server.metrics()
    return {"v-steps": m.get("duet:step_duration_seconds_count", 0.0),
            "v-tokens": m.get("duet:step_prefill_tokens_sum", 0.0)
            + m.get("duet:step_decode_tokens_sum", 0.0),
            "v-finished": m.get("duet:request_success_total", 0.0),
            "v-gen-tokens": m.get("duet:generation_tokens_total", 0.0),
            "v-prompt-tokens": m.get("duet:prompt_tokens_total", 0.0),
            "v-prefix-queries": m.get("duet:prefix_cache_queries_total", 0.0),
            "v-prefix-hits": m.get("duet:prefix_cache_hits_total", 0.0),
            "v-kv-blocks": m.get("duet:kv_cache_used_blocks", 0.0),
            "v-running": m.get("duet:num_requests_running", 0.0),
            "v-waiting": m.get("duet:num_requests_waiting", 0.0),
            "v-preemptions": m.get("duet:num_preemptions_total", 0.0),
            "v-draft-tokens": m.get("duet:spec_decode_num_draft_tokens_total", 0.0),
            "v-accepted": m.get("duet:spec_decode_num_accepted_tokens_total", 0.0)}


def _shown(page, ids) -> dict[str, float]:
    """The dashboard's numbers (data-value) after one more poll."""
    return page.evaluate(f"""Dash.refresh().then(() => Object.fromEntries(
        {json.dumps(list(ids))}.map((id) =>
            [id, Number(document.getElementById(id).dataset.value)])))""")


def _value(page, element_id: str) -> float:
    return page.evaluate(f"Number(document.getElementById('{element_id}').dataset.value)")


def test_dashboard_moves_under_load_and_matches_metrics(server, browser, tmp_path) -> None:
    page = browser.new_page(1280, 1480)
    page.goto(server.base + "/dashboard")
    page.wait_for("Dash.store.polls > 0")
    before = _metrics(server)
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    # The load runs until the test closes its streams: no race with its end.
    with httpx.Client(base_url=server.base, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as a, \
                client.stream("POST", "/v1/completions", json=body) as b:
            lines = [a.iter_lines(), b.iter_lines()]
            for it in lines:                       # both have their first token
                assert next(line for line in it if line.startswith("data:"))
            steps = _shown(page, ["v-steps"])["v-steps"]
            shown = "Number(document.getElementById('{}').dataset.value)".format
            page.wait_for(f"{shown('v-steps')} > {steps} && {shown('v-running')} >= 2"
                          f" && {shown('v-decode-tps')} > 0")
            page.wait_for(f"Number(document.getElementById('v-steps').dataset.value) > "
                          f"{_value(page, 'v-steps')} && Dash.store.rows.length >= 3")
            rows = page.evaluate("Dash.store.rows.length")
            assert rows >= 3
            assert page.evaluate("Dash.store.rows.every((r) => r[Dash.store.idx.ai] > 0)")
            # Two requests decode: 2 rows per decode step whatever the drafts verified.
            assert page.evaluate("Dash.store.rows.slice(-2).every((r) => "
                                 "r[Dash.store.idx.decode_rows] === 2)")
            assert not page.evaluate("document.getElementById('c-spec').classList"
                                     ".contains('hidden')")
            extra = _docs_load(server.base, page) if SHOTS else 0
            page.screenshot(shot_path(tmp_path, "ui_dashboard.png"))
    # The streams closed: both requests are aborted. At rest, the page and /metrics agree.
    deadline = time.monotonic() + 60
    while True:
        expected = _metrics(server)
        shown = _shown(page, list(expected))
        settled = expected["v-running"] == 0 and \
            expected["v-finished"] == before["v-finished"] + 2 + extra
        if (settled and shown == expected) or time.monotonic() > deadline:
            break
        time.sleep(0.2)        # between bounded checks of a state the engine converges to
    assert settled and shown == expected
    assert page.errors == []


def _docs_load(base: str, page, seconds: float = 40.0) -> int:
    """Screenshot mode only: short requests beside the long ones (some sharing a prefix)
    until the page holds `seconds` of steps. Returns how many were sent."""
    stop, sent = threading.Event(), [0]
    prefix = "You are a helpful assistant. Answer in one short paragraph. " * 4

    def run(k: int) -> None:
        with httpx.Client(base_url=base, timeout=120) as c:
            i = 0
            while not stop.is_set():
                prompt = (prefix if i % 2 else f"Request {k}-{i}: ") + f"Tell me about {i}."
                c.post("/v1/completions", json={"prompt": prompt, "temperature": 0.7,
                                                "max_tokens": 24 + 8 * (i % 5)})
                sent[0] += 1
                i += 1

    workers = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    try:
        page.wait_for(f"Dash.store.rows.length > 1 && Dash.store.rows.at(-1)[Dash.store.idx.t]"
                      f" - Dash.store.rows[0][Dash.store.idx.t] >= {seconds}", seconds + 120)
    finally:
        stop.set()
        for w in workers:
            w.join()
    return sent[0]


def test_chat_without_a_chat_template(browser, tiny_checkpoints) -> None:
    """A base model: auto mode sends a transcript to /v1/completions; forcing chat shows
    the server's 400. When the server goes away, the dashboard says so and keeps going."""
    with ServerProcess(tiny_checkpoints["llama-gqa-tied"]) as srv:
        dash = browser.new_page(1280, 900)
        dash.goto(srv.base + "/dashboard")
        dash.wait_for("Dash.store.polls > 0 && Dash.store.error === null")
        page = open_chat(browser, srv.base)
        note = page.evaluate("document.getElementById('mode-note').textContent")
        assert "no chat template" in note and "/v1/completions" in note
        set_fields(page, max_tokens=6, temperature=0)
        reply = send(page, "hi")
        assert not reply["error"] and int(reply["tokens"]) >= 1
        set_fields(page, mode="chat")
        reply = send(page, "hi again")
        assert reply["error"] and reply["text"].startswith("400:")
        assert "chat template" in reply["text"]
        # The browser logs the refused request itself; nothing else went wrong.
        assert all("status of 400" in e for e in page.errors), page.errors
        dash.call("Page.bringToFront")
    dash.wait_for("Dash.store.error !== null && document.getElementById('status')"
                  ".textContent.startsWith('error')")
    assert not [e for e in dash.errors if not e.startswith("log:")], dash.errors


def test_router_pages(server, browser) -> None:
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "duetserve", "router", "--replica",
                               server.base, "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(router, base)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                       timeout=120)
        assert r.status_code == 200
        page = browser.new_page(1280, 900)
        page.goto(base + "/dashboard")
        row = f"document.querySelector('#summary tbody tr[data-name=\"{server.base}\"]')"
        page.wait_for(f"{row} && Dash.store.polls > 0 && Dash.store.instance === "
                      f"{json.dumps(server.base)}")
        assert page.evaluate(f"{row}.classList.contains('on')")
        steps = _value(page, "v-steps")
        assert steps >= 1 and steps == _metrics(server)["v-steps"]
        assert server.base.rsplit(":", 1)[1] in page.evaluate(
            "document.getElementById('model-name').textContent")
        chat = open_chat(browser, base)
        assert chat.evaluate("Chat.state.info.router") is True
        assert page.errors == [] and chat.errors == []
    finally:
        router.terminate()
        router.wait(15)


def _wait_healthy(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)    # between readiness attempts only
    raise RuntimeError("router did not become ready")
