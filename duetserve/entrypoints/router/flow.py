"""One sample of one prompt through the pair of instances:

    router ──POST (n=1, stream false, do_remote_decode)──> prefill instance
           <── first token (text, logprobs) + kv_transfer_params (block ids, addresses)
    yield FIRST (streamed to the client at once)
    router ──POST (stream true, remote_prefill + release_url)──> decode instance
           <── SSE: the whole output from the first token on; the first token is cut
    yield DELTA ... ; FINAL (finish_reason, usage)

Failures: a prefill instance that cannot be reached or fails (5xx) is taken out and the
request goes to another (nothing has reached the client yet). A decode instance that
cannot be reached is taken out and another reads the same held KV; one that fails after
it started answering ends the sample with an error event (its first token has reached
the client). 4xx answers are the client's mistake and are passed through.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from duetserve.entrypoints.router.policy import NoInstanceError, Policy
from duetserve.entrypoints.router.pool import Instance, InstancePool

MAX_ATTEMPTS = 3


class UpstreamError(Exception):
    """An instance answered with an error (status and OpenAI error body) or failed."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status, self.body = status, body


def error_body(message: str, type_: str, status: int) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


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


@dataclass
class Sample:
    """One engine request: one prompt, n=1 (its own seed), its place in the response."""

    index: int
    body: dict
    kind: str                          # "completions" | "chat"
    prompt_key: str
    stream: bool


class Flow:
    def __init__(self, client: httpx.AsyncClient, pool: InstancePool, prefill_policy: Policy,
                 decode_policy: Policy, timings_sink=None) -> None:
        self.client, self.pool = client, pool
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.timings_sink = timings_sink or (lambda t: None)

    def _path(self, kind: str) -> str:
        return "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    async def _post_json(self, inst: Instance, path: str, body: dict) -> dict:
        inst.begin()
        try:
            r = await self.client.post(inst.url + path, json=body, timeout=None)
        except httpx.HTTPError as e:
            inst.mark_down(f"{type(e).__name__}: {e}")
            raise ConnectionError(str(e)) from None
        finally:
            inst.end()
        data = answer_json(r)
        if r.status_code >= 500:      # alive (it answered); the request failed there
            raise ConnectionError(f"{inst.url} answered {r.status_code}: "
                                  f"{data.get('error', {}).get('message', data)}")
        if r.status_code != 200:
            raise UpstreamError(r.status_code, data)
        return data

    async def prefill(self, s: Sample) -> tuple[dict, Instance]:
        """The prefill instance's answer (with kv_transfer_params when a decode instance
        must continue) and the instance. Fails over; raises UpstreamError."""
        body = {**s.body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        body.pop("stream_options", None)
        tried: set[str] = set()
        last = "no attempt"
        for _ in range(max(MAX_ATTEMPTS, len(self.pool.prefill))):
            try:
                inst = self.prefill_policy.pick(self.pool.prefill, s.prompt_key, tried)
            except NoInstanceError as e:
                raise UpstreamError(503, error_body(f"{e}; last error: {last}",
                                                    "ServiceUnavailableError", 503)) from None
            tried.add(inst.url)
            try:
                return await self._post_json(inst, self._path(s.kind), body), inst
            except ConnectionError as e:
                last = str(e)
        raise UpstreamError(503, error_body(f"every prefill attempt failed; last: {last}",
                                            "ServiceUnavailableError", 503))

    async def run(self, s: Sample) -> AsyncIterator[Event]:
        """Streamed: first, delta*, done (or one final); else one final. Raises
        UpstreamError. Not streamed, nothing reaches the client before the end, so a
        decode instance failing is retried from the prefill on other instances."""
        failed_decodes: set[str] = set()
        last = "no attempt"
        for _ in range(MAX_ATTEMPTS):
            t = Timings()
            answer, prefill_inst = await self.prefill(s)
            t.prefill_s = time.monotonic() - t.start
            kv = answer.pop("kv_transfer_params", None)
            choice, model = answer["choices"][0], answer.get("model")
            if kv is None:                                  # finished at the first token
                self.timings_sink(t)
                yield Event("final", choice, answer.get("usage"), model)
                return
            kv["release_url"] = prefill_inst.url + "/kv/release"
            if s.stream:
                first = {**choice, "finish_reason": None}
                first.pop("stop_reason", None)
                yield Event("first", first, None, model)
                async for ev in self._decode(s, kv, choice, answer.get("usage"), t):
                    yield ev
                return
            body = {**s.body, "stream": False, "kv_transfer_params": {"remote_prefill": kv}}
            try:
                inst = self.decode_policy.pick(self.pool.decode, "", failed_decodes)
            except NoInstanceError as e:
                raise UpstreamError(503, error_body(f"{e}; last error: {last}",
                                                    "ServiceUnavailableError", 503)) from None
            try:
                data = await self._post_json(inst, self._path(s.kind), body)
            except ConnectionError as e:
                failed_decodes.add(inst.url)
                last = str(e)
                continue
            t.first_decode_s = time.monotonic() - t.start - t.prefill_s
            self.timings_sink(t)
            yield Event("final", data["choices"][0],
                        _merge_cached(data.get("usage") or {}, answer.get("usage")), model)
            return
        raise UpstreamError(503, error_body(f"every attempt failed; last: {last}",
                                            "ServiceUnavailableError", 503))

    async def _decode(self, s: Sample, kv: dict, first: dict, prefill_usage: dict | None,
                      t: Timings) -> AsyncIterator[Event]:
        body = {**s.body, "stream": True, "stream_options": {"include_usage": True},
                "kv_transfer_params": {"remote_prefill": kv}}
        cut = _FirstTokenCut(s.kind, first)
        tried: set[str] = set()
        for _ in range(max(MAX_ATTEMPTS, len(self.pool.decode))):
            try:
                inst = self.decode_policy.pick(self.pool.decode, "", tried)
            except NoInstanceError as e:
                raise UpstreamError(503, error_body(str(e), "ServiceUnavailableError", 503)) \
                    from None
            tried.add(inst.url)
            started = False
            inst.begin()
            try:
                async with self.client.stream("POST", inst.url + self._path(s.kind),
                                              json=body, timeout=None) as r:
                    if r.status_code != 200:
                        data = answer_json(await r.aread())
                        if r.status_code >= 500 and r.status_code != 503:
                            inst.mark_down(f"answered {r.status_code}")
                        raise UpstreamError(r.status_code, data)
                    started = True
                    final: dict | None = None
                    async for chunk in _sse_json(r):
                        if "error" in chunk:
                            raise UpstreamError(chunk["error"].get("code") or 500, chunk)
                        if chunk.get("usage") and not chunk.get("choices"):
                            usage = _merge_cached(chunk["usage"], prefill_usage)
                            self.timings_sink(t)
                            yield Event("done", final or {}, usage)
                            return
                        for c in chunk.get("choices", []):
                            if t.first_decode_s is None:
                                t.first_decode_s = time.monotonic() - t.start - t.prefill_s
                            c = cut(c)
                            if c is not None:
                                final = c
                                yield Event("delta", c)
                    raise UpstreamError(502, error_body(
                        f"decode instance {inst.url} ended the stream without a usage "
                        "chunk", "InternalServerError", 502))
            except httpx.HTTPError as e:
                inst.mark_down(f"{type(e).__name__}: {e}")
                if started:
                    raise UpstreamError(502, error_body(
                        f"decode instance {inst.url} failed mid-stream: "
                        f"{type(e).__name__}: {e}", "InternalServerError", 502)) from None
                if not isinstance(e, httpx.ConnectError):
                    raise UpstreamError(502, error_body(
                        f"decode instance {inst.url} failed: {type(e).__name__}: {e}",
                        "InternalServerError", 502)) from None
                # never reached it: the held KV is untouched, another may read it
            finally:
                inst.end()
        raise UpstreamError(503, error_body("no decode instance could be reached",
                                            "ServiceUnavailableError", 503))


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


def answer_json(r: httpx.Response | bytes) -> dict:
    """An instance's answer as a dict (an OpenAI error body when it is not JSON)."""
    raw = r if isinstance(r, bytes) else r.content
    try:
        data = json.loads(raw)
        return data if isinstance(data, dict) else {"error": {"message": str(data)}}
    except ValueError:
        return error_body(raw[:200].decode(errors="replace"), "InternalServerError", 502)


async def _sse_json(r: httpx.Response) -> AsyncIterator[dict]:
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            return
        yield json.loads(payload)
