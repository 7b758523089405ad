"""Structured output and forced tool calls with the official `openai` client, against a
server on a tiny random model and one on the default model (issue 17's acceptance):
100 concurrent JSON-schema requests per server all validate, json_object parses,
guided_choice and guided_regex are met, forced tool calls validate (streamed and not),
and every invalid constraint is a 400 naming its field."""
from __future__ import annotations

import asyncio
import json
import os
import re

import httpx
import jsonschema
import openai
import pytest
from server_process import ServerProcess
from structured_schemas import bounded_schemas, output_bound

from tiny_models import make_tiny_checkpoint

# A minimal ChatML template for the tiny checkpoint (it has none of its own).
TINY_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city",
    "parameters": WEATHER}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 20}},
                       "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-chat")), "qwen2-qkv-bias")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TINY_TEMPLATE, "eos_token": "</s>"}, f)
    with ServerProcess("--model", path, "--max-num-batched-tokens", "2048") as srv:
        yield srv


@pytest.fixture(scope="module")
def default_server():
    with ServerProcess() as srv:
        yield srv


def _clients(server: ServerProcess) -> tuple[openai.OpenAI, openai.AsyncOpenAI, str]:
    kw = dict(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=600)
    client = openai.OpenAI(**kw)
    return client, openai.AsyncOpenAI(**kw), client.models.list().data[0].id


def _schema_requests(server: ServerProcess, schemas: list[dict]) -> list:
    """One chat request per schema, all at once; returns the choices."""
    _, aclient, model = _clients(server)

    async def one(i: int, schema: dict):
        r = await aclient.chat.completions.create(
            model=model, temperature=0.7 if i % 2 else 0.0, seed=i,
            max_tokens=output_bound(schema) + 1,
            messages=[{"role": "user", "content": f"Fill in record {i} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"record_{i}", "schema": schema}})
        return r.choices[0]

    async def run():
        try:
            return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
        finally:
            await aclient.close()

    return asyncio.run(run())


@pytest.mark.parametrize("which", ["tiny_server", "default_server"])
def test_100_json_schema_requests_validate(which, request) -> None:
    schemas = bounded_schemas(100, seed=17, max_bound=160)
    choices = _schema_requests(request.getfixturevalue(which), schemas)
    for choice, schema in zip(choices, schemas):
        assert choice.finish_reason == "stop", choice.message.content   # ended by grammar
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_choice_and_regex(tiny_server, default_server) -> None:
    for server in (tiny_server, default_server):
        client, _, model = _clients(server)
        chat = [{"role": "user", "content": "Is the sky blue?"}]
        r = client.chat.completions.create(model=model, messages=chat, max_tokens=8,
                                           extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].message.content in ("yes", "no")
        r = client.completions.create(model=model, prompt="Call me at", max_tokens=20,
                                      temperature=0,
                                      extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
        assert r.choices[0].finish_reason == "stop"


def test_a_choice_the_model_cannot_write_is_a_400(default_server) -> None:
    """Issue 63's schemathesis finding, byte for byte: U+8892E (a surrogate pair in the
    JSON) starts with byte 0xf2, which no token of SmolLM2 holds. It was a 500 (the mask
    allowed a token the parser rejected); it is a 400 naming the field."""
    raw = ('{"prompt": "\\u00b5u\\u00da", "n": 2, "guided_choice": '
           '["\\f}\\u00dbq\\n\\ud9e2\\udd2e\\u001b"]}')
    r = httpx.post(f"{default_server.base}/v1/completions", content=raw, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_choice" and "byte 0xf2" in err["message"], err


def test_a_constraint_no_token_can_continue_fails_alone(default_server) -> None:
    """Both branches of the regex need U+8892E after their first character: the request
    fails when it gets there (400 naming the field; streamed, an error event), and a
    request running beside it finishes."""
    stuck = {"prompt": "Pick:", "max_tokens": 8, "n": 2,
             "guided_regex": "a\U0008892e|b\U0008892e"}
    plain = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=default_server.base, timeout=300) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json=stuck), c.post("/v1/completions", json=plain),
                c.post("/v1/completions", json={**stuck, "stream": True}))
    bad, good, streamed = asyncio.run(run())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["param"] == "guided_regex" and "byte 0xf2" in err["message"], err
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400, events[-1]
    assert events[-1]["error"]["param"] == "guided_regex"


def test_json_object_parses(default_server) -> None:
    client, _, model = _clients(default_server)
    r = client.chat.completions.create(
        model=model, max_tokens=200, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the capital of France as JSON with "
                                              "one key, capital."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_on_default_model(default_server, stream) -> None:
    client, _, model = _clients(default_server)
    kw = dict(model=model, temperature=0, max_tokens=200, tools=TOOLS,
              messages=[{"role": "user", "content": "What will the weather be in Paris?"}])
    for choice, names in ((({"type": "function", "function": {"name": "get_weather"}}),
                           {"get_weather"}), ("required", {"get_weather", "get_time"})):
        if stream:
            calls, reasons, content = {}, [], ""
            for chunk in client.chat.completions.create(stream=True, tool_choice=choice, **kw):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                reasons.append(chunk.choices[0].finish_reason)
                for tc in delta.tool_calls or ():
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
            assert reasons[-1] == "tool_calls" and content == ""
            found = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(tool_choice=choice, **kw)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
            found = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in msg.tool_calls]
            assert len({c.id for c in msg.tool_calls}) == len(msg.tool_calls)
        assert found and all(c["name"] in names for c in found)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for c in found:
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
        if choice != "required":
            assert len(found) == 1


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format",
     "uniqueItems"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "EOS"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools", "nope"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
     "messages", "tool_calls"),
]


@pytest.mark.parametrize("extra,param,word", BAD)
def test_invalid_constraints_are_400_naming_the_field(tiny_server, extra, param, word) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(f"{tiny_server.base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err
