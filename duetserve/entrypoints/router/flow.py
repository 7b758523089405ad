"""One sample of one prompt through the pair of instances:

    router ──POST (n=1, stream false, do_remote_decode)──> prefill instance
           <── first token (text, logprobs) + kv_transfer_params (block ids, addresses)
    yield FIRST (streamed to the client at once)
    router ──POST (stream true, remote_prefill + release_url)──> decode instance
           <── SSE: the whole output from the first token on; the first token is cut
    yield DELTA ... ; FINAL (finish_reason, usage)

Failures (the loop is upstream.py's failover): a prefill instance that cannot be reached
is taken out and the request goes to another (nothing has reached the client yet), as
it does when one answers 5xx. A decode instance that cannot be reached is taken out and
another reads the same held KV; one that fails after it started answering ends the
sample with an error event (its first token has reached the client). Not streamed, a
decode failure is retried from a new prefill. An instance that does not answer within
the read timeout is taken out and the sample ends with a 504. 4xx answers are the
client's mistake and are passed through.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import httpx

from duetserve.entrypoints.router.policy import Policy
from duetserve.entrypoints.router.pool import Instance
from duetserve.entrypoints.router.upstream import (Opened, Retry, Upstream, UpstreamError,
                                                   answer_json, error_body, error_message)


@dataclass
class Event:
    """first / delta: a choice fragment to stream (first: in the non-streamed form of
    the prefill answer); final: the complete choice (non-streamed form) and usage; done:
    the usage only, every fragment of the choice having been streamed."""

    kind: str                         # "first" | "delta" | "final" | "done"
    choice: dict
    usage: dict | None = None
    model: str | None = None


@dataclass
class Timings:
    start: float = field(default_factory=time.monotonic)
    prefill_s: float | None = None     # router -> prefill answer (queue + prefill)
    first_decode_s: float | None = None   # prefill answer -> first decode chunk

    def prefilled(self) -> None:
        self.prefill_s = time.monotonic() - self.start

    def first_decoded(self) -> None:
        if self.first_decode_s is None:
            self.first_decode_s = time.monotonic() - self.start - self.prefill_s


@dataclass
class Sample:
    """One engine request: one prompt, n=1 (its own seed), its place in the response."""

    index: int
    body: dict
    kind: str                          # "completions" | "chat"
    prompt_key: str
    stream: bool

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


@dataclass
class Prefilled:
    """The prefill instance's answer: the first token's choice, and the transfer
    descriptor a decode instance continues from (None: finished at the first token)."""

    choice: dict
    usage: dict | None
    model: str | None
    kv: dict | None


class Flow:
    def __init__(self, upstream: Upstream, prefill_policy: Policy, decode_policy: Policy,
                 timings_sink=None) -> None:
        self.upstream = upstream
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.timings_sink = timings_sink or (lambda t: None)

    async def _post_json(self, inst: Instance, path: str, body: dict) -> dict:
        """The instance's 200 answer. Raises Retry for a 5xx (alive, it answered; the
        request failed there), UpstreamError for a 4xx, httpx.HTTPError."""
        r = await self.upstream.post(inst, path, body)
        data = answer_json(r)
        if r.status_code >= 500:
            raise Retry(f"answered {r.status_code}: {error_message(data)}")
        if r.status_code != 200:
            raise UpstreamError(r.status_code, data)
        return data

    async def prefill(self, s: Sample) -> Prefilled:
        """The prefill instance's answer, its release URL in the descriptor. Fails over;
        raises UpstreamError."""
        body = {**s.body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        body.pop("stream_options", None)

        async def attempt(inst: Instance) -> Prefilled:
            answer = await self._post_json(inst, s.path, body)
            kv = answer.pop("kv_transfer_params", None)
            if kv is not None:
                kv["release_url"] = inst.url + "/kv/release"
            return Prefilled(answer["choices"][0], answer.get("usage"), answer.get("model"),
                             kv)
        return await self.upstream.failover("prefill", self.prefill_policy, attempt,
                                            key=s.prompt_key)

    async def run(self, s: Sample) -> AsyncIterator[Event]:
        """Streamed: first, delta*, done (or one final); else one final. Raises
        UpstreamError."""
        if not s.stream:
            yield await self._complete(s)
            return
        t = Timings()
        p = await self.prefill(s)
        t.prefilled()
        if p.kv is None:                                  # finished at the first token
            self.timings_sink(t)
            yield Event("final", p.choice, p.usage, p.model)
            return
        first = {**p.choice, "finish_reason": None}
        first.pop("stop_reason", None)
        yield Event("first", first, None, p.model)
        async for ev in self._decode(s, p, t):
            yield ev

    async def _complete(self, s: Sample) -> Event:
        """Not streamed: nothing reaches the client before the end, so a decode instance
        failing is retried on another one, from a new prefill (the failed one may have
        read or released the held KV)."""
        async def attempt(inst: Instance) -> Event:
            t = Timings()
            p = await self.prefill(s)
            t.prefilled()
            if p.kv is None:                              # finished at the first token
                self.timings_sink(t)
                return Event("final", p.choice, p.usage, p.model)
            body = {**s.body, "stream": False,
                    "kv_transfer_params": {"remote_prefill": p.kv}}
            data = await self._post_json(inst, s.path, body)
            t.first_decoded()
            self.timings_sink(t)
            return Event("final", data["choices"][0],
                         _merge_cached(data.get("usage") or {}, p.usage), p.model)
        return await self.upstream.failover("decode", self.decode_policy, attempt)

    async def _decode(self, s: Sample, p: Prefilled, t: Timings) -> AsyncIterator[Event]:
        """The decode instance's stream, the first token cut (the client has it). A
        decode instance that was never reached is replaced by another one (it reads the
        same held KV); one that failed later ends the sample."""
        body = {**s.body, "stream": True, "stream_options": {"include_usage": True},
                "kv_transfer_params": {"remote_prefill": p.kv}}

        async def attempt(inst: Instance) -> Opened:
            opened = await self.upstream.open(inst, s.path, body)
            data = await self.upstream.refused(opened)
            if data is None:
                return opened
            status = opened.response.status_code
            if status == 503:                  # refused at admission: the KV is unread
                raise Retry(f"answered 503: {error_message(data)}")
            if status >= 500:
                inst.mark_down(f"answered {status}")
            raise UpstreamError(status, data)
        opened = await self.upstream.failover("decode", self.decode_policy, attempt,
                                              resend=False)
        events = self._relay(opened, _FirstTokenCut(s.kind, p.choice), p.usage, t)
        try:
            async with aclosing(events):
                async for ev in events:
                    yield ev
        except httpx.HTTPError as e:
            raise self.upstream.transport_error(opened.inst, e, " mid-stream") from None
        finally:
            await opened.close()

    async def _relay(self, opened: Opened, cut: _FirstTokenCut, prefill_usage: dict | None,
                     t: Timings) -> AsyncIterator[Event]:
        """delta* then done from a decode instance's SSE answer. Raises UpstreamError
        (an error event, or no usage chunk), httpx.HTTPError."""
        final: dict | None = None
        async for chunk in _sse_json(opened.response):
            if "error" in chunk:
                raise UpstreamError(chunk["error"].get("code") or 500, chunk)
            if chunk.get("usage") and not chunk.get("choices"):
                self.timings_sink(t)
                yield Event("done", final or {}, _merge_cached(chunk["usage"], prefill_usage))
                return
            for c in chunk.get("choices", []):
                t.first_decoded()
                c = cut(c)
                if c is not None:
                    final = c
                    yield Event("delta", c)
        raise UpstreamError(502, error_body(
            f"decode instance {opened.inst.name} ended the stream without a usage chunk",
            "InternalServerError", 502))


class _FirstTokenCut:
    """The decode instance streams the output from the first token on (it seeds it);
    the client already has the first token from the prefill answer, so cut it from the
    first decode chunk: its text or content prefix, one logprob entry, and the role."""

    def __init__(self, kind: str, first: dict) -> None:
        self.kind = kind
        self.text = first.get("text", "") if kind == "completions" else \
            (first.get("message") or {}).get("content") or ""
        lps = first.get("logprobs") or {}
        tokens = lps.get("tokens") or []
        self.offset = len(tokens[0]) if tokens else 0
        self.done = False

    def __call__(self, c: dict) -> dict | None:
        if self.done:
            return c
        self.done = True
        c = dict(c)
        if self.kind == "completions":
            text = c.get("text") or ""
            c["text"] = text[len(self.text):] if text.startswith(self.text) else text
            lp = c.get("logprobs")
            if lp:
                c["logprobs"] = {"tokens": lp["tokens"][1:],
                                 "token_logprobs": lp["token_logprobs"][1:],
                                 "top_logprobs": lp["top_logprobs"][1:],
                                 "text_offset": [o - self.offset for o in lp["text_offset"][1:]]}
        else:
            delta = dict(c.get("delta") or {})
            delta.pop("role", None)
            content = delta.get("content")
            if content is not None:
                delta["content"] = content[len(self.text):] \
                    if content.startswith(self.text) else content
            c["delta"] = delta
            lp = c.get("logprobs")
            if lp and lp.get("content") is not None:
                c["logprobs"] = {**lp, "content": lp["content"][1:]}
        return c


def _merge_cached(usage: dict, prefill_usage: dict | None) -> dict:
    """The decode instance's usage with the prefill instance's cached prompt tokens."""
    usage = dict(usage)
    if prefill_usage and "prompt_tokens_details" in prefill_usage:
        usage["prompt_tokens_details"] = prefill_usage["prompt_tokens_details"]
    return usage


async def _sse_json(r: httpx.Response) -> AsyncIterator[dict]:
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            return
        yield json.loads(payload)
