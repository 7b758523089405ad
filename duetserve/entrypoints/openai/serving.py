"""The two generation endpoints: request -> token ids + SamplingParams -> engine stream ->
OpenAI JSON (one response) or SSE chunks (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`).

Both endpoints share `_Generation` (add to the engine, whose `validate_request` is the one
validation, abort on client disconnect) and differ only in how a choice is rendered. The
engine streams deltas (each step's new tokens, text and logprobs): a streamed chunk
renders one delta as it is; a non-streaming response assembles them once
(`OutputAccumulator`). This file holds the shared part and /v1/completions;
/v1/chat/completions is serving_chat.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duetserve.engine.async_engine import (AsyncEngine, EngineStepError, RequestAbortedError,
                                           RequestFailedError, RequestStream)
from duetserve.entrypoints.fan_in import fan_in
from duetserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   error_body)
from duetserve.errors import EngineOverloadedError, RequestError
from duetserve.kv_transfer.params import PARAM as KV_PARAM
from duetserve.kv_transfer.params import parse_request_params
from duetserve.outputs import (CompletionOutput, Logprob, OutputAccumulator, RequestMetrics,
                               RequestOutput)
from duetserve.sampling_params import GuidedDecoding, SamplingParams


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "BadRequestError", headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.status),
                            status_code=self.status, headers=self.headers)


def _failed(e: RequestFailedError) -> APIError:
    """A request that failed in the engine: 400 naming the field whose value made it fail
    (a constraint no token of the model can continue), else 500."""
    if e.param is not None:
        return APIError(str(e), 400, e.param, "BadRequestError")
    return APIError(str(e), 500, None, "InternalServerError")


def overloaded(message: str) -> APIError:
    return APIError(message, 503, None, "ServiceUnavailableError", {"Retry-After": "1"})


class InFlight:
    """Generation requests between arrival and their last byte (for the drain)."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.count += 1
        self.idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


@dataclass
class ServerContext:
    engine: AsyncEngine
    served_model_name: str
    vocab_size: int
    max_model_len: int
    # fn(seconds from arrival) when a streamed request's first chunk goes to the HTTP
    # server (the metrics' time-to-first-chunk histogram); None: not observed.
    on_first_chunk: Callable[[float], None] | None = None

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer
        self.core = self.engine.engine
        self._token_text: dict[int, str] = {}
        self.max_n = getattr(self.core.config, "max_n", 128)
        # A prompt longer than this many characters cannot fit the context whatever its
        # text: no token is longer than the longest vocabulary entry. Checked before
        # tokenizing, so an oversized prompt costs no tokenizer time.
        vocab = getattr(getattr(self.tokenizer, "tok", None), "get_vocab", None)
        longest = max((len(t) for t in vocab()), default=1) if vocab else 64
        self.max_prompt_chars = self.max_model_len * max(longest, 1)
        self.draining = False
        self.in_flight = InFlight()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"the model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`", 404, "model", "NotFoundError")

    def check_admitting(self) -> None:
        if self.draining:
            raise overloaded("the server is shutting down and admits no new requests")

    def check_chars(self, num_chars: int, field: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(f"the {field} has {num_chars} characters; it cannot fit the "
                           f"context of {self.max_model_len} tokens (max_model_len): at "
                           f"most {self.max_prompt_chars} characters", param=field)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _chunk(head: dict, choice: dict, usage: dict | None) -> dict:
    """One streamed chunk; `usage` on every chunk when continuous usage was asked."""
    chunk = {**head, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


@dataclass
class _Sub:
    """One prompt of a request: one engine request (with its n samples)."""

    req_id: str
    token_ids: list[int]
    prompt: str | None
    stream: RequestStream | None = None
    num_output_tokens: int = 0      # over its samples, from the deltas seen so far
    num_cached_tokens: int = 0
    started: bool = False           # a delta has arrived
    metrics: RequestMetrics | None = None   # the engine's stamps (from the latest delta)


class _Generation:
    """One HTTP request's life in the engine: its prompts added (all validated first),
    their output streams merged, abort on client disconnect (watched through ASGI
    `http.disconnect`), counted in ctx.in_flight until its last byte."""

    def __init__(self, ctx: ServerContext, raw: Request, prefix: str,
                 kv_transfer_params: dict | None = None) -> None:
        self.ctx, self.raw = ctx, raw
        self.kv_params = kv_transfer_params
        self.req_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival_time = getattr(raw.state, "arrival_time", None) or time.time()
        self.first_chunk_time: float | None = None   # first SSE chunk handed to the server
        self.subs: list[_Sub] = []
        self._watcher: asyncio.Task | None = None
        self._closed = False

    async def start(self, prompts: list[tuple[list[int], str | None]],
                    params: SamplingParams, field: str) -> None:
        """Add every prompt (the engine validates each, once). Raises APIError for the
        first refused; the ones added before it are aborted (nothing left queued)."""
        many = len(prompts) > 1
        self.subs = [_Sub(f"{self.req_id}-p{i}" if many else self.req_id, ids, text)
                     for i, (ids, text) in enumerate(prompts)]
        self._expect_kv_transfer(many)
        try:
            for sub in self.subs:
                sub.stream = await self.ctx.engine.add_request(
                    sub.req_id, sub.token_ids, params, sub.prompt, self.arrival_time)
        except EngineOverloadedError as e:
            self.close()
            raise overloaded(str(e)) from None
        except RequestError as e:
            self.close()
            raise APIError(e.message, param=field if e.param == "prompt" else e.param
                           ) from None
        except BaseException:
            self.close()
            raise
        self._watcher = asyncio.create_task(self._watch_disconnect())

    def _expect_kv_transfer(self, many: bool) -> None:
        """Hand the body's kv_transfer_params to the engine (disaggregation: one prompt,
        checked against this instance's role). Raises APIError."""
        if self.kv_params is None:
            return
        roles = self.ctx.core.kv_roles
        try:
            parsed = parse_request_params(self.kv_params,
                                          "both" if roles is None else roles.config.role)
        except RequestError as e:
            raise APIError(e.message, param=e.param) from None
        if parsed is not None and many:
            raise APIError(f"{KV_PARAM} needs a single prompt", param=KV_PARAM)
        if parsed is not None:
            roles.expect(self.subs[0].req_id, parsed)

    def kv_response(self) -> dict:
        """{"kv_transfer_params": descriptor} when a prefill instance holds this
        request's KV for a decode instance, else {} (the request is complete)."""
        roles = self.ctx.core.kv_roles
        if self.kv_params is None or roles is None or len(self.subs) != 1:
            return {}
        remote = roles.connector.published(self.subs[0].req_id)
        return {} if remote is None else {"kv_transfer_params": remote.to_dict()}

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.raw.receive()
            if message["type"] == "http.disconnect":
                self._abort_unfinished()
                return

    def _abort_unfinished(self) -> None:
        for sub in self.subs:
            if sub.stream is not None and not sub.stream.finished:
                sub.stream.finished = True
                self.ctx.engine.abort(sub.req_id)

    def close(self) -> None:
        """Stop watching; abort what has not finished (idempotent)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        self._abort_unfinished()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) as they come, all prompts merged. Mutates the
        subs' token counts (for usage)."""
        streams = [(i, s.stream) for i, s in enumerate(self.subs)]
        async with aclosing(fan_in(streams)) as merged:
            async for i, out in merged:
                self._count(self.subs[i], out)
                yield i, out

    @staticmethod
    def _count(sub: _Sub, delta: RequestOutput) -> None:
        sub.started = True
        sub.num_output_tokens += sum(len(o.token_ids) for o in delta.outputs)
        sub.num_cached_tokens = delta.num_cached_tokens
        if delta.metrics is not None:
            sub.metrics = delta.metrics

    def usage(self) -> dict:
        """The OpenAI usage object of the outputs so far (all prompts)."""
        return _usage(sum(len(s.token_ids) for s in self.subs),
                      sum(s.num_output_tokens for s in self.subs),
                      sum(s.num_cached_tokens for s in self.subs))

    def timing(self) -> dict:
        """The server's timing of this request, in seconds from its arrival (stamped by
        RequestGuard when the HTTP request reached the app): `queue_s` to its first
        scheduling, `ttft_s` to its first token (the engine's stamp, what the
        duet:time_to_first_token_seconds histogram records), `first_chunk_s` to the first
        streamed chunk handed to the HTTP server (streaming only; what the
        duet:time_to_first_chunk_seconds histogram records, and the server's end of the
        span a streaming client times as its TTFT), `e2e_s` to now. Sent as
        the `server_timing` field of the final usage chunk and of non-streaming
        responses (an extension OpenAI clients ignore); None where not reached."""
        ms = [s.metrics for s in self.subs if s.metrics is not None]

        def since(stamps: list[float | None]) -> float | None:
            known = [t for t in stamps if t is not None]
            return None if not known else min(known) - self.arrival_time
        return {"arrival_time": self.arrival_time,
                "queue_s": since([m.first_scheduled_time for m in ms]),
                "ttft_s": since([m.first_token_time for m in ms]),
                "first_chunk_s": since([self.first_chunk_time]),
                "e2e_s": time.time() - self.arrival_time}

    async def final(self) -> list[RequestOutput]:
        """Wait for every prompt's finished output (non-streaming): the deltas
        assembled into one cumulative RequestOutput per prompt."""
        acc, finals = OutputAccumulator(), [None] * len(self.subs)
        try:
            async for i, delta in self.outputs():
                finals[i] = acc.add(delta)
        except RequestFailedError as e:
            raise _failed(e) from None
        except EngineStepError as e:
            raise APIError(str(e), 500, None, "InternalServerError") from None
        except RequestAbortedError as e:
            raise APIError(str(e), 503, None, "ServiceUnavailableError") from None
        finally:
            self.close()
        return finals

    async def sse(self, render_deltas, render_usage) -> AsyncIterator[str]:
        """SSE body: each delta becomes the chunks `render_deltas(i, delta)` returns; an
        error ends the stream with an error event, and [DONE] always comes last."""
        try:
            async for i, out in self.outputs():
                for chunk in render_deltas(i, out):
                    if self.first_chunk_time is None:
                        self.first_chunk_time = time.time()
                        if self.ctx.on_first_chunk is not None:
                            self.ctx.on_first_chunk(self.first_chunk_time - self.arrival_time)
                    yield _sse(chunk)
            if render_usage is not None and any(s.started for s in self.subs):
                yield _sse({**render_usage(self.usage()), "server_timing": self.timing()})
        except RequestAbortedError as e:
            yield _sse(error_body(str(e), "ServiceUnavailableError", None, 503))
        except RequestFailedError as e:
            err = _failed(e)
            yield _sse(error_body(err.message, err.type, err.param, err.status))
        except EngineStepError as e:
            yield _sse(error_body(str(e), "InternalServerError", None, 500))
        finally:
            self.close()
        yield _sse("[DONE]")


def _finish_reason(o: CompletionOutput) -> str | None:
    return o.finish_reason


# -- /v1/completions ---------------------------------------------------------------------

async def _completion_prompts(ctx: ServerContext, body: CompletionRequest
                             ) -> list[tuple[list[int], str | None]]:
    """Each prompt as (token ids, text or None). Text is checked against the character
    bound first, then tokenized on a worker thread (the event loop keeps serving)."""
    prompts = body.prompts()
    if not prompts:
        raise APIError("the prompt list is empty", param="prompt")
    if len(prompts) > 1 and len(prompts) * body.n > ctx.max_n:   # n alone: the engine
        raise APIError(f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} "
                       f"choices; at most {ctx.max_n} (max_n) per request", param="prompt")
    ctx.check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise APIError("the prompt is empty", param="prompt")
            out.append((await asyncio.to_thread(ctx.tokenizer.encode, p), p))
        else:
            out.append((list(p), None))
    return out


def _completion_logprobs(ctx: ServerContext, token_ids: list[int],
                         logprobs: list[dict[int, Logprob]] | None, offset: int
                         ) -> dict | None:
    """The logprobs object of `token_ids` (a delta's, or a whole output's)."""
    if logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entries in zip(token_ids, logprobs):
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
    prompt_lps = out.prompt_logprobs
    if prompt_lps is None and len(token_ids) == 1:
        prompt_lps = [None]       # a one-token prompt has nothing to score
    if prompt_lps is None or completion is None:
        return completion
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for tid, entries in zip(token_ids, prompt_lps):
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


def _check_fields(body: CompletionRequest | ChatCompletionRequest) -> None:
    bad = body.unsupported_field()
    if bad is not None:
        raise APIError(bad[1], param=bad[0])


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw: Request):
    ctx.check_admitting()
    ctx.check_model(body.model)
    _check_fields(body)
    params = _params(body.to_sampling_params)
    prompts = await _completion_prompts(ctx, body)
    await compile_constraint(ctx, params.guided)
    if body.echo and body.logprobs is not None:   # echo scores the prompt too
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    gen = _Generation(ctx, raw, "cmpl", body.kv_transfer_params)
    await gen.start(prompts, params, "prompt")
    n = params.n
    echoes = [""] * len(prompts)
    if body.echo:
        echoes = [text if text is not None else ctx.tokenizer.decode(ids)
                  for ids, text in prompts]
    head = {"id": gen.req_id, "object": "text_completion", "created": gen.created,
            "model": ctx.served_model_name}

    if not body.stream:
        outs = await gen.final()
        choices = [{"index": i * n + o.index, "text": echoes[i] + o.text,
                    "logprobs": _with_prompt(ctx, out, prompts[i][0], _completion_logprobs(
                        ctx, o.token_ids, o.logprobs, len(echoes[i]))),
                    "finish_reason": _finish_reason(o), "stop_reason": o.stop_reason}
                   for i, out in enumerate(outs) for o in out.outputs]
        return JSONResponse({**head, "choices": choices, "usage": gen.usage(),
                             "server_timing": gen.timing(), **gen.kv_response()})

    started: set[int] = set()      # choices that have sent a chunk

    def deltas(i: int, out: RequestOutput) -> list[dict]:
        chunks = []
        for o in out.outputs:
            index = i * n + o.index
            text, offset = o.text, 0
            if echoes[i] and index not in started:
                text, offset = echoes[i] + text, len(echoes[i])
            lps = _completion_logprobs(ctx, o.token_ids, o.logprobs, offset)
            if offset:
                lps = _with_prompt(ctx, out, prompts[i][0], lps)
            started.add(index)
            choice = {"index": index, "text": text, "logprobs": lps,
                      "finish_reason": _finish_reason(o)}
            chunks.append(_chunk(head, choice,
                                 gen.usage() if body.continuous_usage else None))
        return chunks

    usage = (lambda u: {**head, "choices": [], "usage": u}) if body.include_usage else None
    return StreamingResponse(gen.sse(deltas, usage), media_type="text/event-stream")


def _params(build) -> SamplingParams:
    """`build()` (a body's to_sampling_params) with RequestError as a 400."""
    try:
        return build()
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None


async def compile_constraint(ctx: ServerContext, guided: GuidedDecoding | None) -> None:
    """Compile `guided`'s grammar on a worker thread (the event loop keeps serving; the
    engine's admission check then finds it cached). An invalid one is a 400 naming its
    field."""
    if guided is None:
        return
    try:
        await asyncio.to_thread(ctx.core.grammars.compile, guided)
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None
