"""The two generation endpoints: request -> token ids + SamplingParams -> engine stream ->
OpenAI JSON (one response) or SSE chunks (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`).

Both endpoints share `_Generation` (prompt checks, context limit, add to the engine,
abort on client disconnect) and differ only in how a choice is rendered.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duetserve.engine.async_engine import (AsyncEngine, EngineStepError, RequestAbortedError,
                                           RequestStream)
from duetserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   error_body)
from duetserve.outputs import CompletionOutput, Logprob, RequestOutput
from duetserve.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type_

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.status),
                            status_code=self.status)


_FIELD = re.compile(r"^(?:the )?([a-z_]+)")
_PARAMS = {"n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens",
           "stop", "stop_token_ids", "logprobs", "logit_bias", "prompt"}


def param_of(message: str, default: str | None = None) -> str | None:
    """The request field a SamplingParams/engine error message names, if any."""
    m = _FIELD.match(message)
    return m.group(1) if m and m.group(1) in _PARAMS else default


@dataclass
class ServerContext:
    engine: AsyncEngine
    served_model_name: str
    vocab_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer
        self._token_text: dict[int, str] = {}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"the model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`", 404, "model", "NotFoundError")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text


def _usage(out: RequestOutput) -> dict:
    completion = sum(len(o.token_ids) for o in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _chunk(head: dict, choice: dict, out: RequestOutput, with_usage: bool) -> dict:
    """One streamed chunk; usage on every chunk when continuous usage was asked."""
    chunk = {**head, "choices": [choice]}
    if with_usage:
        chunk["usage"] = _usage(out)
    return chunk


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class _Generation:
    """One request's life in the engine: validation, add, output stream with abort on
    client disconnect (watched through ASGI `http.disconnect`)."""

    def __init__(self, ctx: ServerContext, raw: Request, prefix: str) -> None:
        self.ctx, self.raw = ctx, raw
        self.req_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stream: RequestStream | None = None
        self._watcher: asyncio.Task | None = None

    def check_lengths(self, token_ids: list[int], params: SamplingParams, field: str) -> None:
        limit = self.ctx.max_model_len
        if not token_ids:
            raise APIError(f"the {field} is empty (it must contain at least one token)",
                           param=field)
        if len(token_ids) >= limit:
            raise APIError(f"the {field} has {len(token_ids)} tokens; this model's context "
                           f"is {limit} tokens (max_model_len), leaving room for at least "
                           "one generated token", param=field)
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise APIError(f"max_tokens ({params.max_tokens}) plus the {field} "
                           f"({len(token_ids)} tokens) exceeds the context of {limit} tokens "
                           f"(max_model_len); ask for at most {limit - len(token_ids)}",
                           param="max_tokens")

    async def start(self, token_ids: list[int], params: SamplingParams, prompt: str | None,
                    field: str) -> None:
        try:
            self.stream = await self.ctx.engine.add_request(self.req_id, token_ids, params,
                                                            prompt)
        except ValueError as e:
            raise APIError(str(e), param=param_of(str(e), field)) from None
        self._watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.raw.receive()
            if message["type"] == "http.disconnect":
                if self.stream is not None and not self.stream.finished:
                    self.ctx.engine.abort(self.req_id)
                return

    def close(self) -> None:
        """Stop watching; abort the request if it has not finished (idempotent)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self.stream is not None and not self.stream.finished:
            self.stream.finished = True
            self.ctx.engine.abort(self.req_id)

    async def final(self) -> RequestOutput:
        """Wait for the finished output (non-streaming)."""
        assert self.stream is not None
        last = None
        try:
            async for out in self.stream:
                last = out
        except EngineStepError as e:
            raise APIError(str(e), 500, None, "InternalServerError") from None
        except RequestAbortedError as e:
            raise APIError(str(e), 503, None, "ServiceUnavailableError") from None
        finally:
            self.close()
        assert last is not None
        return last

    async def sse(self, render_deltas, render_usage) -> AsyncIterator[str]:
        """SSE body: each output becomes the chunks `render_deltas(out)` returns."""
        assert self.stream is not None
        last = None
        try:
            async for out in self.stream:
                last = out
                for chunk in render_deltas(out):
                    yield _sse(chunk)
            if last is not None and render_usage is not None:
                yield _sse(render_usage(last))
        except (EngineStepError, RequestAbortedError) as e:
            yield _sse(error_body(str(e), "InternalServerError", None, 500))
        finally:
            self.close()
        yield _sse("[DONE]")


@dataclass
class _Sent:
    """What has been streamed of one choice so far."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False


def _new_part(o: CompletionOutput, sent: _Sent) -> tuple[str, int, int] | None:
    """(delta text, token start, token end) of choice `o` since `sent`; None if nothing."""
    if sent.finished:
        return None
    text = o.text[sent.num_chars:]
    start, end = sent.num_tokens, len(o.token_ids)
    if not text and start == end and not o.finished:
        return None
    sent.num_chars, sent.num_tokens, sent.finished = len(o.text), end, o.finished
    return text, start, end


def _finish_reason(o: CompletionOutput) -> str | None:
    return o.finish_reason


# -- /v1/completions ---------------------------------------------------------------------

def _completion_prompt(ctx: ServerContext, prompt) -> tuple[list[int], str | None]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(f"only one prompt per request is supported, got {len(prompt)}",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("the prompt is empty", param="prompt")
        return ctx.tokenizer.encode(prompt), prompt
    ids = list(prompt)
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(f"prompt token id {bad[0]} is not in the vocabulary "
                       f"(valid ids: 0..{ctx.vocab_size - 1})", param="prompt")
    return ids, None


def _completion_logprobs(ctx: ServerContext, o: CompletionOutput, start: int, end: int,
                         offset: int) -> dict | None:
    if o.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entries in zip(o.token_ids[start:end], o.logprobs[start:end]):
        text = ctx.token_text(tid)
        tokens.append(text)
        chosen = entries.get(tid)
        token_lps.append(None if chosen is None else _finite(chosen.logprob))
        tops.append({ctx.token_text(t): _finite(lp.logprob)
                     for t, lp in sorted(entries.items(), key=lambda kv: kv[1].rank)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _with_prompt(ctx: ServerContext, out: RequestOutput, token_ids: list[int],
                 completion: dict | None) -> dict | None:
    """Prepend the prompt's tokens and logprobs (echo + logprobs); the first is None.
    `completion`'s text offsets must already count the echoed prompt."""
    if out.prompt_logprobs is None or completion is None:
        return completion
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for tid, entries in zip(token_ids, out.prompt_logprobs):
        text = ctx.token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entries is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(_finite(entries[tid].logprob))
        tops.append({ctx.token_text(t): _finite(lp.logprob)
                     for t, lp in sorted(entries.items(), key=lambda kv: kv[1].rank)})
    return {"tokens": tokens + completion["tokens"],
            "token_logprobs": lps + completion["token_logprobs"],
            "top_logprobs": tops + completion["top_logprobs"],
            "text_offset": offsets + completion["text_offset"]}


def _finite(x: float) -> float:
    return max(x, -9999.0)     # JSON has no -inf


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw: Request):
    ctx.check_model(body.model)
    if body.suffix:
        raise APIError("suffix is not supported", param="suffix")
    token_ids, prompt_text = _completion_prompt(ctx, body.prompt)
    params = _params(body)
    if body.echo and body.logprobs is not None:   # echo scores the prompt too
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    gen = _Generation(ctx, raw, "cmpl")
    gen.check_lengths(token_ids, params, "prompt")
    await gen.start(token_ids, params, prompt_text, "prompt")
    echo = ""
    if body.echo:
        echo = prompt_text if prompt_text is not None else ctx.tokenizer.decode(token_ids)
    head = {"id": gen.req_id, "object": "text_completion", "created": gen.created,
            "model": ctx.served_model_name}

    if not body.stream:
        out = await gen.final()
        choices = [{"index": o.index, "text": echo + o.text,
                    "logprobs": _with_prompt(ctx, out, token_ids, _completion_logprobs(
                        ctx, o, 0, len(o.token_ids), len(echo))),
                    "finish_reason": _finish_reason(o), "stop_reason": o.stop_reason}
                   for o in out.outputs]
        return JSONResponse({**head, "choices": choices, "usage": _usage(out)})

    sent = [_Sent() for _ in range(params.n)]

    def deltas(out: RequestOutput) -> list[dict]:
        chunks = []
        for o in out.outputs:
            part = _new_part(o, sent[o.index])
            if part is None:
                continue
            text, start, end = part
            lps = _completion_logprobs(ctx, o, start, end, 0)
            if echo and start == 0:
                text = echo + text
                lps = _with_prompt(ctx, out, token_ids,
                                   _completion_logprobs(ctx, o, start, end, len(echo)))
            choice = {"index": o.index, "text": text, "logprobs": lps,
                      "finish_reason": _finish_reason(o)}
            chunks.append(_chunk(head, choice, out, body.continuous_usage))
        return chunks

    usage = (lambda out: {**head, "choices": [], "usage": _usage(out)}) \
        if body.include_usage else None
    return StreamingResponse(gen.sse(deltas, usage), media_type="text/event-stream")


def _params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    try:
        return body.to_sampling_params()
    except ValueError as e:
        raise APIError(str(e), param=param_of(str(e))) from None


# -- /v1/chat/completions ----------------------------------------------------------------

def _chat_logprobs(ctx: ServerContext, o: CompletionOutput, start: int, end: int,
                   num_top: int) -> dict | None:
    if o.logprobs is None:
        return None

    def entry(tid: int, lp: Logprob) -> dict:
        text = ctx.token_text(tid)
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode())}

    content = []
    for tid, entries in zip(o.token_ids[start:end], o.logprobs[start:end]):
        chosen = entries.get(tid) or Logprob(float("-inf"), -1)
        top = sorted(((t, lp) for t, lp in entries.items() if lp.rank <= num_top),
                     key=lambda kv: kv[1].rank)[:num_top]
        content.append({**entry(tid, chosen), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest,
                                 raw: Request):
    ctx.check_model(body.model)
    params = _params(body)
    messages = [m.as_dict() for m in body.messages]
    try:
        token_ids = ctx.tokenizer.encode_chat(messages, body.add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template rejecting the conversation
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
    gen = _Generation(ctx, raw, "chatcmpl")
    gen.check_lengths(token_ids, params, "messages")
    await gen.start(token_ids, params, None, "messages")
    num_top = body.top_logprobs or 0
    head = {"id": gen.req_id, "object": "chat.completion", "created": gen.created,
            "model": ctx.served_model_name}

    if not body.stream:
        out = await gen.final()
        choices = [{"index": o.index,
                    "message": {"role": "assistant", "content": o.text},
                    "logprobs": _chat_logprobs(ctx, o, 0, len(o.token_ids), num_top),
                    "finish_reason": _finish_reason(o), "stop_reason": o.stop_reason}
                   for o in out.outputs]
        return JSONResponse({**head, "choices": choices, "usage": _usage(out)})

    head["object"] = "chat.completion.chunk"
    sent = [_Sent() for _ in range(params.n)]

    def deltas(out: RequestOutput) -> list[dict]:
        chunks = []
        for o in out.outputs:
            s = sent[o.index]
            first = s.num_tokens == 0 and s.num_chars == 0 and not s.finished
            part = _new_part(o, s)
            if part is None:
                continue
            text, start, end = part
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})
            choice = {"index": o.index, "delta": delta,
                      "logprobs": _chat_logprobs(ctx, o, start, end, num_top),
                      "finish_reason": _finish_reason(o)}
            chunks.append(_chunk(head, choice, out, body.continuous_usage))
        return chunks

    usage = (lambda out: {**head, "choices": [], "usage": _usage(out)}) \
        if body.include_usage else None
    return StreamingResponse(gen.sse(deltas, usage), media_type="text/event-stream")
