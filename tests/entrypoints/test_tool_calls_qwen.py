"""Tool calling with Qwen2.5-Coder-0.5B-Instruct, whose chat template renders tools and
which writes <tool_call> itself: tool_choice auto (the model decides), streamed and not,
a forced call, and the second turn with the tool's result. Skipped when the checkpoint
is not on this machine (`../shared/models/fetch.sh qwen2.5-coder-0.5b`; CI never
downloads it)."""
from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from server_process import ServerProcess

QWEN = os.path.join(os.environ.get("DUET_MODELS",
                                   os.path.expanduser("~/.cache/duetserve-models")),
                    "qwen2.5-coder-0.5b-instruct.gguf")
pytestmark = pytest.mark.skipif(not os.path.isfile(QWEN),
                                reason=f"{QWEN} absent (shared/models/fetch.sh "
                                       "qwen2.5-coder-0.5b)")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "description": "the city name"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client():
    with ServerProcess("--model", QWEN, "--max-num-batched-tokens", "512",
                       "--max-model-len", "2048") as srv:
        yield openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0,
                            timeout=600)


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        assert name == "get_weather"
        args = json.loads(arguments)
        jsonschema.validate(args, WEATHER)
        assert "paris" in args["city"].lower()


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tool_call_non_streamed(client, tool_choice) -> None:
    r = client.chat.completions.create(model=client.models.list().data[0].id,
                                       messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                       temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])


def test_tool_call_streamed_then_answer(client) -> None:
    model = client.models.list().data[0].id
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                                temperature=0, max_tokens=80, stream=True):
        reasons.append(chunk.choices[0].finish_reason)
        for tc in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    _check_calls([(c["name"], c["arguments"]) for c in calls.values()])
    call = calls[0]
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"],
         "content": json.dumps({"temperature": 21, "unit": "celsius", "sky": "sunny"})}]
    r = client.chat.completions.create(model=model, messages=follow, tools=TOOLS,
                                       temperature=0, max_tokens=60)
    answer = r.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert "21" in answer.message.content
