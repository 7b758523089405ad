"""The OpenAI-compatible server end to end with the official `openai` client: one server
(default model) in a subprocess for the whole module. Small max_tokens throughout."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

PROMPT = "The sky is"
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _wait_for(server: ServerProcess, cond, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics (bounded) until cond(metrics) holds; returns the last sample."""
    deadline = time.monotonic() + timeout
    m = server.metrics()
    while not cond(m) and time.monotonic() < deadline:
        time.sleep(0.2)
        m = server.metrics()
    return m


def test_models_health_version(server, model) -> None:
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert httpx.get(f"{server.base}/version").json()["version"]


def test_completion_and_usage(client, model) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text and c.finish_reason == "length"
    u = r.usage
    assert u.completion_tokens == 6 and u.prompt_tokens == 3
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0      # 3 tokens: not a whole block


def test_stream_equals_non_stream(client, model) -> None:
    """Streamed text concatenates to the non-streamed text. Each prompt is sent once
    before, so both compared requests hit the prefix cache alike: with low-bit weights
    a 1-token prefill (cache hit) and a full one run different kernels (int8-activation
    GEMV vs bf16 GEMM), which may flip a greedy near-tie (docs/performance.md)."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    client.completions.create(**kw)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    chat_kw = dict(model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                   top_logprobs=2)
    client.chat.completions.create(**chat_kw)
    chat_full = client.chat.completions.create(**chat_kw)
    chat_chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **chat_kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chat_chunks if ch.choices)
    assert text == chat_full.choices[0].message.content
    streamed_lps = [t.model_dump() for ch in chat_chunks if ch.choices
                    for t in ch.choices[0].logprobs.content]
    assert streamed_lps == [t.model_dump() for t in chat_full.choices[0].logprobs.content]
    assert len(streamed_lps) == chat_full.usage.completion_tokens
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].usage.completion_tokens == chat_full.usage.completion_tokens
    assert chat_chunks[-1].usage.prompt_tokens == chat_full.usage.prompt_tokens


def test_server_timing_extension(client, model) -> None:
    """The final usage chunk and non-streaming responses carry `server_timing`: seconds
    from the request's arrival at the server to its first scheduling, first token, first
    streamed chunk and end (an extension; OpenAI clients ignore the field)."""
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    timing = chunks[-1].model_extra["server_timing"]
    assert all(c.model_extra.get("server_timing") is None for c in chunks[:-1])
    assert 0 <= timing["queue_s"] <= timing["ttft_s"] <= timing["first_chunk_s"] \
        <= timing["e2e_s"]
    assert timing["arrival_time"] > 0
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3)
    timing = full.model_extra["server_timing"]
    assert 0 <= timing["queue_s"] <= timing["ttft_s"] <= timing["e2e_s"]
    assert timing["first_chunk_s"] is None                  # nothing was streamed


def test_continuous_usage_stats(client, model) -> None:
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in with_choices] == [1, 2, 3, 4]


def test_n_seed_and_logprobs(client, model) -> None:
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234, n=2,
              logprobs=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in a.choices)
    lp = a.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_stop_string_and_prompt_forms(client, model) -> None:
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=10,
                                     temperature=0).choices[0].text
    word = base.split()[1]
    r = client.completions.create(model=model, prompt=[PROMPT], max_tokens=10,
                                  temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(word)]
    ids = client.completions.create(model=model, prompt=[504, 6123, 314][:1], max_tokens=2,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 1
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                     temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPT)
    scored = client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                       temperature=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == echo.choices[0].text
    assert len(lp.tokens) == scored.usage.prompt_tokens + 2
    assert lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])


def test_64_concurrent_streams_and_metrics(server, model) -> None:
    before = server.metrics()

    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[int, str]:
        stream = await ac.completions.create(
            model=model, prompt=f"Request number {i} says", max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage, text = None, ""
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                usage = ch.usage
        return usage.completion_tokens, text

    async def run_all() -> list[tuple[int, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="x",
                                      max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert [n for n, _ in results] == [8] * 64 and all(t for _, t in results)
    m = _wait_for(server, lambda m: m["duet:kv_cache_used_blocks"] == 0)
    done = m["duet:request_success_total"] - before.get("duet:request_success_total", 0)
    assert done == 64
    gen = m["duet:generation_tokens_total"] - before.get("duet:generation_tokens_total", 0)
    assert gen == 64 * 8
    assert m["duet:kv_cache_used_blocks"] == 0 and m["duet:num_requests_running"] == 0
    assert m["duet:time_to_first_token_seconds_count"] >= 64
    assert m["duet:step_decode_tokens_count"] > 0


def test_client_disconnect_aborts(server, model) -> None:
    abort_key = f'duet:request_success_total{{finished_reason="abort",model_name="{model}"}}'
    before = server.metrics().get(abort_key, 0)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", f"{server.base}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data:")
                if got >= 3:
                    break
    # the connection is closed now: the request must be aborted and its blocks freed
    m = _wait_for(server, lambda m: m.get(abort_key, 0) > before
                  and m["duet:kv_cache_used_blocks"] == 0, timeout=20)
    assert m.get(abort_key, 0) == before + 1
    assert m["duet:kv_cache_used_blocks"] == 0 and m["duet:num_requests_running"] == 0
    assert m["duet:generation_tokens_total"] < 10_000


BAD_REQUESTS = [
    ("completions", b"{not json", 400, None),
    ("chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("chat/completions", {"messages": "hello"}, 400, "messages"),
    ("completions", {"prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "max_tokens": 10_000_000}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": -3}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1] * 100_000}, 400, "prompt"),
    ("completions", {"prompt": [10**9]}, 400, "prompt"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": PROMPT, "model": "no-such-model"}, 404, "model"),
    # per-request SLO targets: positive ms, never tighter than the server's
    ("completions", {"prompt": PROMPT, "slo_ttft_ms": -1}, 400, "slo_ttft_ms"),
    ("completions", {"prompt": PROMPT, "slo_tpot_ms": "fast"}, 400, "slo_tpot_ms"),
    ("chat/completions", {"messages": CHAT, "slo_tpot_ms": 5}, 400, "slo_tpot_ms"),
    # Lone surrogates (a JSON \ud800..\udfff escape without its pair; the prompt was a 500)
    ("completions", b'{"prompt": "a\\ud9e2b", "max_tokens": 2}', 400, "prompt"),
    ("completions", b'{"prompt": ["a", "\\udfff"], "max_tokens": 2}', 400, "prompt"),
    ("completions", b'{"prompt": "a", "stop": ["\\ud800"]}', 400, "stop"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_are_openai_errors(server, path, body, status, param) -> None:
    url = f"{server.base}/v1/{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == status and err["param"] == param


def test_a_request_may_relax_the_slo_targets(client, model) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                  extra_body={"slo_ttft_ms": 60_000, "slo_tpot_ms": 1000})
    assert r.usage.completion_tokens == 2


def test_long_text_prompt_and_server_still_serves(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hello " * 100_000, max_tokens=2)
    err = e.value.response.json()["error"]
    assert err["param"] == "prompt" and "max_model_len" in err["message"], err
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT, max_tokens=2)
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
    assert r.usage.completion_tokens >= 1
