"""Response, for /v1/chat/completions: the last stage of its request (serving.py). A
message with `content` and, when tools are in play, `tool_calls` parsed from the output:

    output text ──ToolCallStreamParser──> content deltas / tool_calls deltas
    finish_reason "tool_calls" when the output stopped (EOS) after at least one call

Streamed tool calls arrive whole: one delta per call, with the complete arguments, as
soon as its closing tag is generated (clients that concatenate argument fragments get
the same result). An output that starts with "{" or "[" while tools are offered is held
back to its end, where it is either a bare call (a small model leaving out the tags) or
content.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

from duetserve.entrypoints.openai import tools as tool_plans
from duetserve.entrypoints.openai.context import ServerContext
from duetserve.entrypoints.openai.generation import Generation, chunk_json
from duetserve.entrypoints.openai.protocol import ChatCompletionRequest, finite
from duetserve.outputs import CompletionOutput, Logprob, RequestOutput
from duetserve.structured.tool_syntax import (ParsedToolCall, ToolCallStreamParser,
                                              parse_tool_calls)


def chat_logprobs(ctx: ServerContext, token_ids: list[int],
                  logprobs: list[dict[int, Logprob]] | None, num_top: int) -> dict | None:
    """The logprobs object of `token_ids` (a delta's, or a whole output's)."""
    if logprobs is None:
        return None

    def entry(tid: int, lp: Logprob) -> dict:
        text = ctx.token_text(tid)
        return {"token": text, "logprob": finite(lp.logprob), "bytes": list(text.encode())}

    content = []
    for tid, entries in zip(token_ids, logprobs):
        chosen = entries.get(tid) or Logprob(float("-inf"), -1)
        top = sorted(((t, lp) for t, lp in entries.items() if lp.rank <= num_top),
                     key=lambda kv: kv[1].rank)[:num_top]
        content.append({**entry(tid, chosen), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def _finish_reason(o: CompletionOutput, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and o.finish_reason == "stop" else o.finish_reason


class ChatRenderer:
    """Renders one chat request's outputs. Mutates its per-choice stream state (the
    first chunk carries the role; a parser per choice when tools are in play)."""

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest,
                 plan: tool_plans.ToolPlan, gen: Generation) -> None:
        self.ctx, self.body, self.plan, self.gen = ctx, body, plan, gen
        self.num_top = body.top_logprobs or 0
        self.names = frozenset(t["function"]["name"] for t in plan.tools)
        self.head = {"id": gen.req_id, "object": "chat.completion", "created": gen.created,
                     "model": ctx.served_model_name}
        n = gen.params.n
        self._started = [False] * n
        self._parsers = [ToolCallStreamParser(self.names) if plan.parse else None
                         for _ in range(n)]

    async def response(self):
        """The JSON body (every choice, once all have finished) or the SSE stream."""
        if self.body.stream:
            self.head["object"] = "chat.completion.chunk"
            usage = (lambda u: {**self.head, "choices": [], "usage": u}) \
                if self.body.include_usage else None
            return StreamingResponse(self.gen.sse(self.chunks, usage),
                                     media_type="text/event-stream")
        outs = await self.gen.final()
        choices = []
        for o in outs[0].outputs:
            message, num_calls = self._message(o)
            choices.append({"index": o.index, "message": message,
                            "logprobs": chat_logprobs(self.ctx, o.token_ids, o.logprobs,
                                                      self.num_top),
                            "finish_reason": _finish_reason(o, num_calls),
                            "stop_reason": o.stop_reason})
        return JSONResponse({**self.head, "choices": choices, "usage": self.gen.usage(),
                             "server_timing": self.gen.timing(), **self.gen.kv_response()})

    def _message(self, o: CompletionOutput) -> tuple[dict, int]:
        """(the choice's message, number of tool calls in it)."""
        if not self.plan.parse:
            return {"role": "assistant", "content": o.text}, 0
        content, calls = parse_tool_calls(o.text, self.names)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_plans.tool_call_json(c) for c in calls]
        return message, len(calls)

    def chunks(self, _: int, out: RequestOutput) -> list[dict]:
        """One SSE chunk per sample that changed in delta `out`."""
        chunks = []
        for o in out.outputs:
            delta, num_calls = self._delta(o)
            choice = {"index": o.index, "delta": delta,
                      "logprobs": chat_logprobs(self.ctx, o.token_ids, o.logprobs,
                                                self.num_top),
                      "finish_reason": _finish_reason(o, num_calls)}
            chunks.append(chunk_json(self.head, choice, self.gen.usage()
                                     if self.body.continuous_usage else None))
        return chunks

    def _delta(self, o: CompletionOutput) -> tuple[dict, int]:
        """(a sample's delta message, its tool calls so far)."""
        parser, text = self._parsers[o.index], o.text
        first, self._started[o.index] = not self._started[o.index], True
        delta = {"role": "assistant"} if first else {}
        if parser is None:
            if text or first:
                delta["content"] = text
            return delta, 0
        events = parser.feed(text) + (parser.finish() if o.finished else [])
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ParsedToolCall)]
        if content or first:
            delta["content"] = content
        if calls:
            base = parser.num_calls - len(calls)
            delta["tool_calls"] = [tool_plans.tool_call_json(c, base + k)
                                   for k, c in enumerate(calls)]
        return delta, parser.num_calls
