"""The router's calls to its instances (router/upstream.py) against fake instances
(router_fakes.py): failover to the next instance, answers passed through, and the read
timeout: an instance that accepts the connection and never answers is taken out and the
client gets an error (504), colocated or disaggregated, streamed or not."""
from __future__ import annotations

import asyncio
import json

import pytest
from router_fakes import FakeInstance, router
from server_process import free_port

from duetserve.entrypoints.router.pool import Instance
from duetserve.entrypoints.router.upstream import Timeouts

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
ANSWER = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "text": " blue sky", "logprobs": None,
                       "finish_reason": "length"}], "usage": USAGE}
PREFILLED = {**ANSWER, "choices": [{"index": 0, "text": " blue", "logprobs": None,
                                    "finish_reason": "length"}],
             "kv_transfer_params": {"block_ids": [0]}}
BODY = {"prompt": "The sky is", "max_tokens": 2}
SHORT = Timeouts(connect_s=5.0, read_s=0.5)


def answers(status: int, body):
    return lambda method, path, request: (status, body)


def silent(method, path, request):
    return None


def run(main) -> None:
    asyncio.run(main())


def test_a_failed_attempt_goes_to_the_next_replica():
    """A replica that refuses connections is taken out and the next one answers; with
    only a refusing one and a busy one (503, kept in), the client gets a 503 naming the
    last error."""
    async def main():
        async with FakeInstance(answers(200, ANSWER)) as good, \
                FakeInstance(answers(503, {"error": {"message": "queue full"}})) as busy, \
                FakeInstance(answers(200, ANSWER)) as gone:
            dead = Instance(gone.url, "replica")
            async with router([dead, Instance(good.url, "replica")]) as client:
                gone.server.close()
                await gone.server.wait_closed()
                for _ in range(2):
                    r = await client.post("/v1/completions", json=BODY)
                    assert r.status_code == 200 and r.json() == ANSWER
                assert not dead.healthy and "ConnectError" in dead.last_error
            dead = Instance(gone.url, "replica")
            busy_inst = Instance(busy.url, "replica")
            async with router([dead, busy_inst]) as client:
                dead.mark_up()         # as if it had answered its last health check
                r = await client.post("/v1/completions", json=BODY)
                assert r.status_code == 503
                assert r.json()["error"]["type"] == "ServiceUnavailableError"
                assert (dead.served, busy_inst.served) == (1, 1)
                assert not dead.healthy and busy_inst.healthy
    run(main)


def test_client_errors_are_passed_through_once():
    bad = {"error": {"message": "max_tokens too large", "type": "BadRequestError",
                     "param": "max_tokens", "code": 400}}

    async def main():
        async with FakeInstance(answers(400, bad)) as a, \
                FakeInstance(answers(400, bad)) as b:
            async with router([Instance(a.url, "replica"), Instance(b.url, "replica")]
                              ) as client:
                for stream in (False, True):
                    r = await client.post("/v1/completions", json={**BODY, "stream": stream})
                    assert r.status_code == 400 and r.json() == bad
            assert len(a.requests) + len(b.requests) == 2
    run(main)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_replica_that_never_answers_ends_the_request_with_a_504(stream):
    async def main():
        async with FakeInstance(silent) as hung:
            inst = Instance(hung.url, "replica")
            async with router([inst], SHORT) as client:
                r = await client.post("/v1/completions", json={**BODY, "stream": stream})
                assert r.status_code == 504, r.text
                error = r.json()["error"]
                assert "did not answer within 0.5 s" in error["message"]
                assert "--upstream-read-timeout" in error["message"]
                assert not inst.healthy and "no answer within" in inst.last_error
                r = await client.post("/v1/completions", json=BODY)
                assert r.status_code == 503          # out until /health answers again
    run(main)


def test_a_prefill_instance_that_never_answers_ends_the_request_with_a_504():
    async def main():
        async with FakeInstance(silent) as pre, FakeInstance(answers(200, ANSWER)) as dec:
            prefill = Instance(pre.url, "prefill")
            async with router([prefill, Instance(dec.url, "decode")], SHORT) as client:
                r = await client.post("/v1/completions", json=BODY)
                assert r.status_code == 504 and "prefill instance" in r.text
                assert not prefill.healthy
            assert dec.requests == []
    run(main)


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


def test_a_decode_instance_that_never_answers_ends_the_sample_with_an_error():
    """Streamed: the first token (from the prefill instance) reached the client, then an
    error event and [DONE]; not streamed: a 504. The decode instance is taken out."""
    async def main():
        async with FakeInstance(answers(200, PREFILLED)) as pre, FakeInstance(silent) as dec:
            decode = Instance(dec.url, "decode")
            async with router([Instance(pre.url, "prefill"), decode], SHORT) as client:
                r = await client.post("/v1/completions", json={**BODY, "stream": True})
                assert r.status_code == 200
                events = _sse_events(r.text)
                assert events[0]["choices"][0]["text"] == " blue"
                assert events[-1]["error"]["code"] == 504
                assert "decode instance" in events[-1]["error"]["message"]
                assert r.text.rstrip().endswith("data: [DONE]")
                assert not decode.healthy
                decode.mark_up()
                r = await client.post("/v1/completions", json=BODY)
                assert r.status_code == 504 and "decode instance" in r.text
                assert not decode.healthy
    run(main)


def test_a_refused_decode_connection_fails_over_and_a_bad_flag_is_an_error():
    """A decode instance that cannot be reached is taken out and the other reads the
    same held KV (the prefill instance is asked once)."""
    stream = [{"choices": [{"index": 0, "text": " blue sky", "logprobs": None,
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "", "logprobs": None,
                            "finish_reason": "length"}]},
              {"choices": [], "usage": USAGE}]

    async def main():
        async with FakeInstance(answers(200, PREFILLED)) as pre, \
                FakeInstance(answers(200, stream)) as dec:
            gone = Instance(f"http://127.0.0.1:{free_port()}", "decode")
            async with router([Instance(pre.url, "prefill"), gone,
                               Instance(dec.url, "decode")]) as client:
                gone.mark_up()
                r = await client.post("/v1/completions", json={**BODY, "stream": True})
                text = "".join(e["choices"][0]["text"] for e in _sse_events(r.text)
                               if e.get("choices"))
                assert text == " blue sky" and len(pre.requests) == 1
                assert len(dec.requests) == 1
                assert gone.served == 0 or not gone.healthy
    run(main)
    with pytest.raises(ValueError, match="--upstream-read-timeout must be > 0"):
        Timeouts(read_s=0)


def test_the_model_reaches_every_instance_unchanged():
    """A request's `model` (a LoRA adapter's name) goes unchanged to a replica, and to
    both the prefill and the decode instance, streamed or not (each runs the adapter)."""
    async def main():
        body = {**BODY, "model": "alpha"}
        async with FakeInstance(answers(200, ANSWER)) as rep:
            async with router([Instance(rep.url, "replica")]) as client:
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert [b["model"] for _, _, b in rep.requests] == ["alpha"]
        stream = {"choices": [{"index": 0, "text": " blue sky", "finish_reason": "length"}],
                  "usage": USAGE}

        def decode(method, path, request):
            return (200, [stream]) if request.get("stream") else (200, ANSWER)
        async with FakeInstance(answers(200, PREFILLED)) as pre, \
                FakeInstance(decode) as dec:
            async with router([Instance(pre.url, "prefill"),
                               Instance(dec.url, "decode")]) as client:
                for s in (False, True):
                    r = await client.post("/v1/completions", json={**body, "stream": s})
                    assert r.status_code == 200, r.text
            assert [b["model"] for _, _, b in pre.requests + dec.requests] == ["alpha"] * 4
            assert [bool(b.get("stream")) for _, _, b in dec.requests] == [False, True]
    run(main)
