"""The router's SSE merge (router/merge.stream) over fake flows: every sample's fragments
with its choice index, usage once at the end, and an upstream error (or any other error
of a flow) as one error event followed by [DONE], with no usage chunk."""
from __future__ import annotations

import asyncio
import json

from duetserve.entrypoints.router.flow import Event, Sample
from duetserve.entrypoints.router.upstream import UpstreamError, error_body
from duetserve.entrypoints.router.merge import stream


class FakeFlow:
    """run(sample): "delta" events of the texts scripted for its index, then "done" with
    usage, or the scripted exception after the texts."""

    def __init__(self, texts: dict[int, list[str]], fail: dict[int, Exception] | None = None):
        self.texts, self.fail = texts, fail or {}

    async def run(self, s: Sample):
        for t in self.texts[s.index]:
            yield Event("delta", {"text": t}, None, "m")
        if s.index in self.fail:
            raise self.fail[s.index]
        usage = {"prompt_tokens": 3, "completion_tokens": len(self.texts[s.index])}
        yield Event("done", {}, usage, "m")


def _samples(n: int) -> list[Sample]:
    return [Sample(i, {}, "completions", "p", True) for i in range(n)]


def _events(flow: FakeFlow, n: int) -> list:
    async def main():
        return [x async for x in stream(flow, _samples(n), n, include_usage=True)]
    lines = asyncio.run(main())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(x[len("data: "):]) for x in lines[:-1]]


def test_fragments_of_every_sample_then_usage():
    events = _events(FakeFlow({0: ["a", "b"], 1: ["x"]}), 2)
    chunks, usage = events[:-1], events[-1]
    by_index = {0: "", 1: ""}
    for c in chunks:
        (choice,) = c["choices"]
        by_index[choice["index"]] += choice["text"]
    assert by_index == {0: "ab", 1: "x"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_upstream_error_ends_the_stream_with_its_body():
    body = error_body("decode instance gone", "InternalServerError", 500)
    events = _events(FakeFlow({0: ["a"], 1: []}, fail={1: UpstreamError(500, body)}), 2)
    assert events[-1] == body
    assert all("usage" not in e for e in events)


def test_any_other_flow_error_becomes_a_502_event():
    events = _events(FakeFlow({0: ["a"]}, fail={0: KeyError("choices")}), 1)
    assert events[-1]["error"]["code"] == 502
    assert "router: KeyError" in events[-1]["error"]["message"]
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a"]
