"""Reliability of the HTTP server (issue #11), end to end against the default model:
admission checks that name the field, OpenAI fields never silently ignored, a list of
prompts, bounded bodies, header timeouts, a full waiting queue, and the SIGTERM drain."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

PROMPT = "The sky is"
CHAT = [{"role": "user", "content": "Name a color."}]
MAX_BODY = 100_000


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-request-bytes", str(MAX_BODY), "--header-timeout", "1",
                       "--max-num-seqs", "4", "--max-waiting-requests", "4",
                       "--max-num-batched-tokens", "256") as srv:
        yield srv


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}/v1/{path}", json=body, timeout=120)


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status, err
    return err["message"]


@pytest.mark.parametrize("seed,n", [(2**64, 1), (-(2**63) - 1, 1), (2**64 - 1, 2),
                                    (10**30, 1)])
def test_seed_out_of_generator_range_is_400(server, seed, n) -> None:
    msg = _error(_post(server, "completions", {"prompt": PROMPT, "seed": seed, "n": n,
                                               "max_tokens": 2}), 400, "seed")
    assert str(2**64 - 1) in msg


def test_seed_range_edges_run(server) -> None:
    for seed, n in ((2**64 - 1, 1), (2**64 - 2, 2), (-(2**63), 3)):
        r = _post(server, "completions", {"prompt": PROMPT, "seed": seed, "n": n,
                                          "max_tokens": 2, "temperature": 1.0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == n


def test_n_capped_and_default_max_tokens(server) -> None:
    msg = _error(_post(server, "completions", {"prompt": PROMPT, "n": 10_000}), 400, "n")
    assert "128" in msg
    r = _post(server, "completions", {"prompt": PROMPT, "temperature": 0,
                                      "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


BAD_FIELDS = [
    ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"store": True}, "store"),
    ("chat/completions", {"no_such_field": 1}, "no_such_field"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"foo": "bar"}, "foo"),
]


@pytest.mark.parametrize("path,extra,param", BAD_FIELDS)
def test_unimplemented_or_unknown_fields_are_400(server, path, extra, param) -> None:
    body = {"messages": CHAT} if path.startswith("chat") else {"prompt": PROMPT}
    _error(_post(server, path, {**body, "max_tokens": 2, **extra}), 400, param)


@pytest.mark.parametrize("role", ["", "robot", "tool"])
def test_chat_roles_validated(server, role) -> None:
    _error(_post(server, "chat/completions",
                 {"messages": [{"role": role, "content": "hi"}], "max_tokens": 2}),
           400, "messages")


def test_no_op_values_of_unimplemented_fields_pass(server) -> None:
    r = _post(server, "chat/completions", {
        "messages": [{"role": "developer", "content": "Be brief."}, *CHAT], "max_tokens": 2,
        "response_format": {"type": "text"}, "tool_choice": "none", "store": False})
    assert r.status_code == 200, r.text
    r = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, "best_of": 1})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def serial_server():
    """One sequence per step: every request runs the same kernels whether it came alone or
    in a list (the low-bit kernels at 1 row and the dense path at more rows round
    differently, which can flip a greedy near-tie between a batch and a single run)."""
    with ServerProcess("--max-num-seqs", "1") as srv:
        yield srv


def test_list_of_prompts_is_several_choices(serial_server) -> None:
    server = serial_server
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    prompts = ["The sky is", "One, two, three,", "Paris is the capital of", "Hello"]
    single = [client.completions.create(model=model, prompt=p, max_tokens=4,
                                        temperature=0).choices[0].text for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=4,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(8))
    assert [c.text for c in batch.choices] == [t for t in single for _ in range(2)]
    assert batch.usage.completion_tokens == 8 * 4
    stream = client.completions.create(model=model, prompt=prompts, max_tokens=4,
                                       temperature=0, stream=True)
    texts = [""] * 4
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == single
    # lm-eval's loglikelihood call: token-id prompts, echo + logprobs, batch of 4
    ids = [[504, 6123, 314], [19, 20, 21, 22], [504], [1, 2]]
    scored = client.completions.create(model=model, prompt=ids, max_tokens=1,
                                       temperature=0, echo=True, logprobs=1)
    assert len(scored.choices) == 4
    for c, p in zip(scored.choices, ids):
        assert len(c.logprobs.token_logprobs) == len(p) + 1
        assert c.logprobs.token_logprobs[0] is None


def test_too_many_choices_in_a_prompt_list(server) -> None:
    _error(_post(server, "completions", {"prompt": ["a", "b"], "n": 100}), 400, "prompt")


def _raw_request(server, data: bytes) -> bytes:
    """Send raw bytes; return everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_oversized_body_413_before_parsing(server) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {20 * 2**20}\r\n\r\n").encode()
    answer = _raw_request(server, head + b'{"prompt": "')    # the rest is never sent
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"max-request-bytes" in answer
    # chunked (no Content-Length): counted while read
    body = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    with httpx.Client(timeout=60) as hc:
        r = hc.post(f"{server.base}/v1/completions", content=iter([body[:50_000],
                                                                  body[50_000:]]),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_prompt_too_long_in_characters_is_400_without_tokenizing(server) -> None:
    # within the body limit, but more characters than the context could ever hold
    r = _post(server, "completions", {"prompt": "a" * 90_000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_idle_and_slow_header_connections_get_408(server) -> None:
    assert _raw_request(server, b"").startswith(b"HTTP/1.1 408")        # never sends
    partial = b"GET /health HTTP/1.1\r\nHost: x\r\n"                      # no final CRLF
    assert _raw_request(server, partial).startswith(b"HTTP/1.1 408")
    # a complete request is answered, then the idle keep-alive connection is closed
    answer = _raw_request(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200")


def test_full_waiting_queue_is_503_with_retry_after(server) -> None:
    long = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "n": 4,
            "stream": True}

    async def hold(ac: httpx.AsyncClient) -> None:
        async with ac.stream("POST", f"{server.base}/v1/completions", json=long) as resp:
            async for _ in resp.aiter_lines():
                pass

    async def until(name: str, value: float) -> None:
        deadline = time.monotonic() + 60
        while server.metrics()[name] < value and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert server.metrics()[name] >= value, f"{name} never reached {value}"

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as ac:
            # one at a time: two adds in the same engine iteration would both be waiting
            holders = [asyncio.create_task(hold(ac))]
            await until("duet:num_requests_running", 4)
            holders.append(asyncio.create_task(hold(ac)))
            await until("duet:num_requests_waiting", 4)
            r = await ac.post(f"{server.base}/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
            for t in holders:
                t.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return r

    r = asyncio.run(run())
    _error(r, 503, None)
    assert r.headers["retry-after"] == "1"


def test_sigterm_drains_in_flight_streams_then_exits_0() -> None:
    """SIGTERM: /health and new requests get 503 at once, the in-flight streams keep
    streaming until the shutdown timeout, then each ends with a 503 error chunk and
    [DONE], and the process exits 0. The streams ask for 4,000 tokens each, which takes
    4,000 steps: none can finish within the 2 s timeout, so every one is ended by it."""
    num_streams = 20
    with ServerProcess("--shutdown-timeout", "2") as srv:
        body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True,
                "temperature": 0}

        async def one(ac: httpx.AsyncClient, ready: asyncio.Queue) -> list[str]:
            events = []
            async with ac.stream("POST", f"{srv.base}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        if not events:
                            ready.put_nowait(1)
                        events.append(line[6:])
            return events

        async def run():
            ready: asyncio.Queue = asyncio.Queue()
            async with httpx.AsyncClient(timeout=120) as ac:
                tasks = [asyncio.create_task(one(ac, ready)) for _ in range(num_streams)]
                for _ in range(num_streams):
                    await ready.get()                 # every stream is mid-body
                srv.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:    # the drain has begun
                    if (await ac.get(f"{srv.base}/health")).status_code == 503:
                        break
                    await asyncio.sleep(0.05)
                late = await ac.post(f"{srv.base}/v1/completions",
                                     json={"prompt": PROMPT, "max_tokens": 2})
                return await asyncio.gather(*tasks), late

        results, late = asyncio.run(run())
        assert srv.proc.wait(60) == 0
    assert late.status_code == 503
    for events in results:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["error"]["code"] == 503                  # ended by the drain
        assert len(chunks) > 1 and all("error" not in c for c in chunks[:-1])
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]
                   if c.get("choices"))
