"""One client request = prompts x n samples, each a Flow (flow.py) with n=1 and its own
seed (seed + sample index, as the engine seeds the samples of n>1). Merged here into one
OpenAI response or one SSE stream, choice index = prompt * n + sample, usage as the
colocated server counts it (each prompt once, every sample's completion tokens)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from duetserve.entrypoints.fan_in import fan_in
from duetserve.entrypoints.router.flow import Event, Flow, Sample
from duetserve.entrypoints.router.upstream import UpstreamError, error_body


def _prompts(body: dict, kind: str) -> list[tuple[object, str]]:
    """(prompt value for the sub-request, prompt key for prefix-aware routing)."""
    if kind == "chat":
        return [(None, json.dumps(body.get("messages"), sort_keys=True))]
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        return [(x, x if isinstance(x, str) else json.dumps(x)) for x in p]
    return [(p, p if isinstance(p, str) else json.dumps(p))]


def split(body: dict, kind: str) -> tuple[list[Sample], int]:
    """The samples of a request and n. Raises UpstreamError(400) for what the router
    cannot split."""
    for name in ("echo", "best_of", "kv_transfer_params"):
        if body.get(name):
            raise UpstreamError(400, error_body(f"`{name}` is not supported through the "
                                                "disaggregated router", "BadRequestError",
                                                400))
    opts = body.get("stream_options") or {}
    if opts.get("continuous_usage_stats"):
        raise UpstreamError(400, error_body("stream_options.continuous_usage_stats is not "
                                            "supported through the router",
                                            "BadRequestError", 400))
    n = body.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise UpstreamError(400, error_body(f"n must be an integer >= 1, got {n!r}",
                                            "BadRequestError", 400))
    seed = body.get("seed")
    stream = bool(body.get("stream"))
    samples = []
    for i, (prompt, key) in enumerate(_prompts(body, kind)):
        for s in range(n):
            sub = {**body, "n": 1}
            if kind == "completions":
                sub["prompt"] = prompt
            if isinstance(seed, int):
                sub["seed"] = seed + s
            samples.append(Sample(i * n + s, sub, kind, key, stream))
    return samples, n


def _usage(finals: dict[int, dict], n: int) -> dict:
    prompt = cached = completion = 0
    for index, usage in finals.items():
        completion += usage.get("completion_tokens", 0)
        if index % n == 0:
            prompt += usage.get("prompt_tokens", 0)
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _head(kind: str, model: str | None, stream: bool) -> dict:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    obj = ("chat.completion.chunk" if stream else "chat.completion") if kind == "chat" \
        else "text_completion"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": model}


async def complete(flow: Flow, samples: list[Sample], n: int) -> dict:
    """Non-streamed: every sample's final choice, merged. Raises UpstreamError."""
    async def one(s: Sample) -> Event:
        ev = None
        async for ev in flow.run(s):
            pass
        return ev
    events = await asyncio.gather(*(one(s) for s in samples))
    choices = [{**ev.choice, "index": s.index} for s, ev in zip(samples, events)]
    usage = _usage({s.index: ev.usage or {} for s, ev in zip(samples, events)}, n)
    return {**_head(samples[0].kind, events[0].model, False), "choices": choices,
            "usage": usage}


def _chunk_choice(kind: str, ev: Event, index: int) -> dict | None:
    """The streamed form of an event's choice (None: nothing to stream)."""
    c = ev.choice
    if ev.kind == "delta":
        return {**c, "index": index}
    if ev.kind == "done":
        return None
    if kind == "completions":
        return {"index": index, "text": c.get("text", ""), "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason")}
    message = c.get("message") or {}
    delta = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        delta["tool_calls"] = message["tool_calls"]
    return {"index": index, "delta": delta, "logprobs": c.get("logprobs"),
            "finish_reason": c.get("finish_reason")}


async def stream(flow: Flow, samples: list[Sample], n: int, include_usage: bool
                 ) -> AsyncIterator[str]:
    """SSE: each sample's fragments as they come; an error ends the stream with an error
    event; [DONE] last. The samples' tasks are cancelled when the client goes away."""
    kind = samples[0].kind
    head: dict | None = None
    usages: dict[int, dict] = {}
    try:
        async with aclosing(fan_in([(s, flow.run(s)) for s in samples])) as merged:
            async for s, item in merged:
                if head is None:
                    head = _head(kind, item.model, True)
                if item.usage is not None:
                    usages[s.index] = item.usage
                choice = _chunk_choice(kind, item, s.index)
                if choice is not None:
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
    except UpstreamError as e:
        yield f"data: {json.dumps(e.body)}\n\n"
    except Exception as e:  # noqa: BLE001 - becomes the stream's error event
        body = error_body(f"router: {type(e).__name__}: {e}", "InternalServerError", 502)
        yield f"data: {json.dumps(body)}\n\n"
    else:
        if include_usage and head is not None:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(usages, n)})}\n\n"
    yield "data: [DONE]\n\n"
