"""/v1/chat/completions: messages (+ tools) -> chat template -> engine -> a message with
`content` and, when tools are in play, `tool_calls` parsed from the output.

    tools.plan_tools(body)            what the prompt shows, the forced grammar if any
    tools.template_messages(...)      messages and template variables
    output text ──ToolCallStreamParser──> content deltas / tool_calls deltas
    finish_reason "tool_calls" when the output stopped (EOS) after at least one call

Streamed tool calls arrive whole: one delta per call, with the complete arguments, as
soon as its closing tag is generated (clients that concatenate argument fragments get
the same result). An output that starts with "{" or "[" while tools are offered is held
back to its end, where it is either a bare call (a small model leaving out the tags) or
content.
"""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duetserve.entrypoints.openai import tools as tool_plans
from duetserve.entrypoints.openai.protocol import ChatCompletionRequest
from duetserve.entrypoints.openai.serving import (APIError, ServerContext, _check_fields,
                                                  _chunk, _finish_reason, _finite,
                                                  _Generation, _params, compile_constraint)
from duetserve.errors import RequestError
from duetserve.outputs import CompletionOutput, Logprob, RequestOutput
from duetserve.structured.tool_syntax import (ParsedToolCall, ToolCallStreamParser,
                                              parse_tool_calls)


def _chat_logprobs(ctx: ServerContext, token_ids: list[int],
                   logprobs: list[dict[int, Logprob]] | None, num_top: int) -> dict | None:
    """The logprobs object of `token_ids` (a delta's, or a whole output's)."""
    if logprobs is None:
        return None

    def entry(tid: int, lp: Logprob) -> dict:
        text = ctx.token_text(tid)
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode())}

    content = []
    for tid, entries in zip(token_ids, logprobs):
        chosen = entries.get(tid) or Logprob(float("-inf"), -1)
        top = sorted(((t, lp) for t, lp in entries.items() if lp.rank <= num_top),
                     key=lambda kv: kv[1].rank)[:num_top]
        content.append({**entry(tid, chosen), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def _chat_finish_reason(o: CompletionOutput, num_calls: int) -> str | None:
    if num_calls and o.finish_reason == "stop":
        return "tool_calls"
    return _finish_reason(o)


def _tool_names(plan: tool_plans.ToolPlan) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in plan.tools)


def _message(o: CompletionOutput, plan: tool_plans.ToolPlan) -> tuple[dict, int]:
    """(the choice's message, number of tool calls in it)."""
    if not plan.parse:
        return {"role": "assistant", "content": o.text}, 0
    content, calls = parse_tool_calls(o.text, _tool_names(plan))
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [tool_plans.tool_call_json(c) for c in calls]
    return message, len(calls)


async def _prompt(ctx: ServerContext, body: ChatCompletionRequest
                  ) -> tuple[list[int], tool_plans.ToolPlan, object]:
    """(prompt token ids, tool plan, sampling params). Raises APIError (400s)."""
    try:
        plan = tool_plans.plan_tools(body)
        constraint = body.guided()
        if plan.forced is not None and constraint is not None:
            raise RequestError(f"tool_choice {body.tool_choice!r} constrains the output "
                               f"already; it cannot be combined with {constraint.param}",
                               constraint.param)
        messages, template_vars = tool_plans.template_messages(
            body.messages, plan, ctx.tokenizer.supports_tools)
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None
    params = _params(lambda: body.to_sampling_params(plan.forced or constraint))
    ctx.check_chars(body.num_chars, "messages")
    try:
        token_ids = await asyncio.to_thread(ctx.tokenizer.encode_chat, messages,
                                            body.add_generation_prompt, **template_vars)
    except Exception as e:  # noqa: BLE001 - a template rejecting the conversation
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
    await compile_constraint(ctx, plan.check)
    await compile_constraint(ctx, params.guided)
    return token_ids, plan, params


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest,
                                 raw: Request):
    ctx.check_admitting()
    ctx.check_model(body.model)
    _check_fields(body)
    token_ids, plan, params = await _prompt(ctx, body)
    gen = _Generation(ctx, raw, "chatcmpl", body.kv_transfer_params)
    await gen.start([(token_ids, None)], params, "messages")
    num_top = body.top_logprobs or 0
    head = {"id": gen.req_id, "object": "chat.completion", "created": gen.created,
            "model": ctx.served_model_name}

    if not body.stream:
        outs = await gen.final()
        choices = []
        for o in outs[0].outputs:
            message, num_calls = _message(o, plan)
            choices.append({"index": o.index, "message": message,
                            "logprobs": _chat_logprobs(ctx, o.token_ids, o.logprobs, num_top),
                            "finish_reason": _chat_finish_reason(o, num_calls),
                            "stop_reason": o.stop_reason})
        return JSONResponse({**head, "choices": choices, "usage": gen.usage(),
                             "server_timing": gen.timing(), **gen.kv_response()})

    head["object"] = "chat.completion.chunk"
    started = [False] * params.n      # a choice's first chunk carries the role
    parsers = [ToolCallStreamParser(_tool_names(plan)) if plan.parse else None
               for _ in range(params.n)]

    def deltas(_: int, out: RequestOutput) -> list[dict]:
        chunks = []
        for o in out.outputs:
            parser, text = parsers[o.index], o.text
            first, started[o.index] = not started[o.index], True
            delta = {"role": "assistant"} if first else {}
            if parser is None:
                if text or first:
                    delta["content"] = text
            else:
                events = parser.feed(text) + (parser.finish() if o.finished else [])
                content = "".join(e for e in events if isinstance(e, str))
                calls = [e for e in events if isinstance(e, ParsedToolCall)]
                if content or first:
                    delta["content"] = content
                if calls:
                    base = parser.num_calls - len(calls)
                    delta["tool_calls"] = [tool_plans.tool_call_json(c, base + k)
                                           for k, c in enumerate(calls)]
            num_calls = parser.num_calls if parser is not None else 0
            choice = {"index": o.index, "delta": delta,
                      "logprobs": _chat_logprobs(ctx, o.token_ids, o.logprobs, num_top),
                      "finish_reason": _chat_finish_reason(o, num_calls)}
            chunks.append(_chunk(head, choice,
                                 gen.usage() if body.continuous_usage else None))
        return chunks

    usage = (lambda u: {**head, "choices": [], "usage": u}) if body.include_usage else None
    return StreamingResponse(gen.sse(deltas, usage), media_type="text/event-stream")
