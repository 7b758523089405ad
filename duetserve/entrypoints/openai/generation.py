"""Generation: the third stage of a request (serving.py). The request's prompts added to
the engine (whose `validate_request` is the one validation; all of them or none), their
output streams merged, aborted on client disconnect, and the deltas handed to the
renderer: a streamed response writes one SSE chunk per delta as it comes, a
non-streaming one waits for the deltas assembled once (`OutputAccumulator`)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request

from duetserve.engine.async_engine import (EngineStepError, RequestAbortedError,
                                           RequestFailedError, RequestStream)
from duetserve.entrypoints.fan_in import fan_in
from duetserve.entrypoints.openai.context import APIError, ServerContext, overloaded
from duetserve.entrypoints.openai.prompt import Prompt
from duetserve.entrypoints.openai.protocol import error_body
from duetserve.errors import EngineOverloadedError, RequestError
from duetserve.kv_transfer.params import PARAM as KV_PARAM
from duetserve.kv_transfer.params import parse_request_params
from duetserve.outputs import OutputAccumulator, RequestMetrics, RequestOutput
from duetserve.request import LoRARequest
from duetserve.sampling_params import SamplingParams


def _failed(e: RequestFailedError) -> APIError:
    """A request that failed in the engine: 400 naming the field whose value made it fail
    (a constraint no token of the model can continue), else 500."""
    if e.param is not None:
        return APIError(str(e), 400, e.param, "BadRequestError")
    return APIError(str(e), 500, None, "InternalServerError")


def usage_json(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chunk_json(head: dict, choice: dict, usage: dict | None) -> dict:
    """One streamed chunk; `usage` on every chunk when continuous usage was asked."""
    chunk = {**head, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def sse(obj: dict | str) -> str:
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


class Generation:
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
        self.prompts: list[Prompt] = []
        self.params: SamplingParams | None = None
        self._watcher: asyncio.Task | None = None
        self._closed = False

    async def start(self, prompts: list[Prompt], params: SamplingParams, field: str,
                    lora: LoRARequest | None = None) -> None:
        """Add every prompt (the engine validates each, once), under the LoRA adapter
        `lora` (None: the base). Raises APIError for the first refused; the ones added
        before it are aborted (nothing left queued)."""
        many = len(prompts) > 1
        self.prompts, self.params = prompts, params
        self.subs = [_Sub(f"{self.req_id}-p{i}" if many else self.req_id, ids, text)
                     for i, (ids, text) in enumerate(prompts)]
        self._expect_kv_transfer(many)
        try:
            for sub in self.subs:
                sub.stream = await self.ctx.engine.add_request(
                    sub.req_id, sub.token_ids, params, sub.prompt, self.arrival_time,
                    lora_request=lora)
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
        return usage_json(sum(len(s.token_ids) for s in self.subs),
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

    async def sse(self, render_deltas: Callable[[int, RequestOutput], list[dict]],
                  render_usage: Callable[[dict], dict] | None) -> AsyncIterator[str]:
        """SSE body: each delta becomes the chunks `render_deltas(i, delta)` returns; an
        error ends the stream with an error event, and [DONE] always comes last."""
        try:
            async for i, out in self.outputs():
                for chunk in render_deltas(i, out):
                    if self.first_chunk_time is None:
                        self.first_chunk_time = time.time()
                        if self.ctx.on_first_chunk is not None:
                            self.ctx.on_first_chunk(self.first_chunk_time - self.arrival_time)
                    yield sse(chunk)
            if render_usage is not None and any(s.started for s in self.subs):
                yield sse({**render_usage(self.usage()), "server_timing": self.timing()})
        except RequestAbortedError as e:
            yield sse(error_body(str(e), "ServiceUnavailableError", None, 503))
        except RequestFailedError as e:
            err = _failed(e)
            yield sse(error_body(err.message, err.type, err.param, err.status))
        except EngineStepError as e:
            yield sse(error_body(str(e), "InternalServerError", None, 500))
        finally:
            self.close()
        yield sse("[DONE]")
