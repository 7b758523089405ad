"""`tools` / `tool_choice` on /v1/chat/completions: what the prompt shows, what the
output may be, and how tool calls come back.

    tool_choice     prompt shows tools   output constrained to           parsed
    none / absent*  no                   -                               no
    auto            yes                  -                               yes
    required        yes                  a call of any tool (several only when
                                         parallel_tool_calls is true)
    {"function"}    yes                  one call of that function       yes
    (* absent with tools means auto, as OpenAI.)

A template that renders tools itself (it mentions `tools`, like Qwen2.5's) gets them as
the `tools` variable and earlier calls as `tool_calls` with parsed arguments; any other
template gets a system message (tool_syntax.tools_system_prompt) and earlier calls and
results written in the same syntax as plain text. The output is parsed with
tool_syntax's parser either way.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from duetserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from duetserve.errors import RequestError
from duetserve.sampling_params import GuidedDecoding
from duetserve.structured.tool_syntax import (ParsedToolCall, format_tool_call,
                                              format_tool_response, tools_system_prompt)


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] = field(default_factory=list)   # OpenAI tool entries for the prompt
    parse: bool = False                  # parse tool calls out of the output
    forced: GuidedDecoding | None = None  # required / named: the output's grammar
    # The grammar of calls to any of the tools, compiled only to check their parameter
    # schemas (a 400 naming `tools`), also when nothing is forced.
    check: GuidedDecoding | None = None


def _calls_spec(tools: list, parallel: bool) -> str:
    return json.dumps({"tools": [{"name": t.function.name,
                                  "parameters": t.function.parameters or {"type": "object"}}
                                 for t in tools], "parallel": parallel},
                      sort_keys=True, ensure_ascii=False)


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The plan for the body's tools and tool_choice. Raises RequestError naming the
    field (tool_choice without tools, an unknown function, a duplicate name)."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools: no tools were given", "tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools: function names must be unique", "tools")
    if choice == "none":
        return ToolPlan()
    entries = [t.model_dump(exclude_none=True) for t in tools]
    check = GuidedDecoding("tool_calls", _calls_spec(tools, True), "tools")
    if choice in (None, "auto"):
        return ToolPlan(entries, True, None, check)
    if choice == "required":
        # NOTE: one call unless parallel_tool_calls is explicitly true (OpenAI's default
        # is true): forced into the syntax, small models repeat the call until
        # max_tokens when the grammar lets them.
        chosen, parallel = tools, body.parallel_tool_calls is True
    else:
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise RequestError(f"tool_choice names function {choice.function.name!r}, which "
                               f"is not among the tools ({', '.join(names)})", "tool_choice")
        parallel = False
    forced = GuidedDecoding("tool_calls", _calls_spec(chosen, parallel), "tools")
    return ToolPlan(entries, True, forced, check)


def _arguments(call) -> dict | str:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
    return args if isinstance(args, dict) else call.function.arguments


def _check_tool_turns(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.role != "tool":
            continue
        if not m.tool_call_id:
            raise RequestError(f"messages[{i}]: a tool message needs tool_call_id",
                               "messages")
        prev = messages[i - 1] if i else None
        if prev is None or not (prev.role == "tool" or (prev.role == "assistant"
                                                       and prev.tool_calls)):
            raise RequestError(f"messages[{i}]: a tool message must answer a preceding "
                               "assistant message with tool_calls", "messages")


def template_messages(messages: list[ChatMessage], plan: ToolPlan, supports_tools: bool
                      ) -> tuple[list[dict], dict]:
    """(messages for the chat template, extra template variables). Raises RequestError
    (param messages) for tool turns out of place. Mutates nothing."""
    _check_tool_turns(messages)
    out: list[dict] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if supports_tools:
            d: dict = {"role": role, "content": m.text}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c)}}
                    for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        elif role == "tool":
            out.append({"role": "user", "content": format_tool_response(m.text)})
        elif m.tool_calls:
            calls = "\n".join(format_tool_call(c.function.name, _arguments(c))
                              for c in m.tool_calls)
            out.append({"role": role, "content": f"{m.text}\n{calls}" if m.text else calls})
        else:
            out.append({"role": role, "content": m.text})
    if not plan.tools:
        return out, {}
    if supports_tools:
        return out, {"tools": plan.tools}
    prompt = tools_system_prompt(plan.tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def tool_call_json(call: ParsedToolCall, index: int | None = None) -> dict:
    """One call as OpenAI returns it (`index` set in streamed deltas)."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}
