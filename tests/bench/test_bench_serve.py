"""`duet bench serve` end to end against a fake OpenAI-compatible streaming server
(tests/bench/fake_openai_server.py) on a free loopback port. No timing assertions."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import MODEL, NATURAL_LEN, FakeServer

from duetserve.entrypoints.cli import main as duet_main


def _run(tmp_path: Path, base_url: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "res.json"
    argv = ["bench", "serve", "--base-url", base_url, "--no-progress", "--seed", "3",
            "--output-json", str(out), *extra]
    assert duet_main(argv) == 0
    return json.loads(out.read_text())


def _check_counts_match(res: dict[str, Any], srv: FakeServer) -> None:
    s = res["runs"][-1]["summary"]
    assert s["failed"] == 0 and s["completed"] == srv.stats.num_requests
    assert s["total_input_tokens"] == srv.stats.prompt_tokens
    assert s["total_output_tokens"] == srv.stats.completion_tokens


def test_completions_random_counts_match_server(tmp_path: Path, capsys) -> None:
    with FakeServer() as srv:
        res = _run(tmp_path, srv.base_url, "--num-prompts", "6", "--input-len", "3:9",
                   "--output-len", "2:12", "--ignore-eos", "--max-concurrency", "3",
                   "--slo", "ttft=60000", "--percentiles", "50,99", "--label", "fake")
    _check_counts_match(res, srv)
    assert res["schema"] == "duet-bench-serve/1" and res["label"] == "fake"
    assert res["config"]["model"] == MODEL  # resolved from GET /v1/models
    run = res["runs"][0]
    assert run["request_rate"] == "inf" and len(run["requests"]) == 6
    assert all(b["ignore_eos"] and b["stream"] for b in srv.stats.bodies)
    for rec, body in zip(sorted(run["requests"], key=lambda r: r["expected_output_len"]),
                         sorted(srv.stats.bodies, key=lambda b: b["max_tokens"])):
        assert rec["output_tokens"] == rec["expected_output_len"] == body["max_tokens"]
        assert rec["token_source"] == "usage"
        assert len(rec["itl"]) == rec["output_tokens"] - 1  # one token per chunk
        assert rec["ttft"] <= rec["e2e"]
    assert run["summary"]["goodput"] is not None and run["summary"]["good_requests"] == 6
    assert "p99" in run["summary"]["ttft_ms"]
    out = capsys.readouterr().out
    assert "Successful requests" in out and "TPOT" in out


def test_multi_token_chunks_and_eos(tmp_path: Path) -> None:
    # 2 tokens per chunk with continuous usage; no ignore_eos -> the fake stops at NATURAL_LEN.
    with FakeServer(tokens_per_chunk=2) as srv:
        res = _run(tmp_path, srv.base_url, "--num-prompts", "4", "--input-len", "5",
                   "--output-len", "10", "--request-rate", "1000")
    _check_counts_match(res, srv)
    for rec in res["runs"][0]["requests"]:
        assert rec["output_tokens"] == NATURAL_LEN
        # 7 tokens in chunks of 2,2,2,1: the first chunk's 2 tokens give no ITL entry
        assert len(rec["itl"]) == NATURAL_LEN - 2


def test_lora_modules_spread_conversations_over_adapters(tmp_path: Path) -> None:
    """--lora-modules: conversation i names adapter i mod n as its `model`, every turn."""
    with FakeServer() as srv:
        res = _run(tmp_path, srv.base_url, "--endpoint", "chat", "--dataset", "chat",
                   "--num-prompts", "5", "--num-turns", "2", "--input-len", "3",
                   "--output-len", "2", "--ignore-eos", "--lora-modules", "a", "b")
    assert res["config"]["lora_modules"] == ["a", "b"]
    by_first = {}
    for body in srv.stats.bodies:
        by_first.setdefault(body["messages"][0]["content"], set()).add(body["model"])
    assert all(len(models) == 1 for models in by_first.values())    # one per conversation
    names = [b["model"] for b in srv.stats.bodies]
    assert sorted(set(names)) == ["a", "b"] and names.count("a") == 6    # 3 of 5 x 2 turns


def test_chat_multi_turn_resends_history(tmp_path: Path) -> None:
    with FakeServer() as srv:
        res = _run(tmp_path, srv.base_url, "--endpoint", "chat", "--dataset", "chat",
                   "--num-prompts", "3", "--num-turns", "3", "--input-len", "4",
                   "--output-len", "3", "--ignore-eos", "--sweep-rates", "500,inf")
    assert len(res["runs"]) == 2 and srv.stats.num_requests == 2 * 9
    s = res["runs"][0]["summary"]["total_input_tokens"] + res["runs"][1]["summary"]["total_input_tokens"]
    assert s == srv.stats.prompt_tokens
    replies = set(srv.stats.replies)
    for body in srv.stats.bodies:
        msgs = body["messages"]
        assert len(msgs) % 2 == 1 and msgs[-1]["role"] == "user"
        # every earlier assistant message is a reply the server actually produced
        assert all(m["content"] in replies for m in msgs if m["role"] == "assistant")
    assert max(len(b["messages"]) for b in srv.stats.bodies) == 5  # turn 3: u a u a u
    # turn t's prompt = 3 user messages of 4 words + earlier replies of 3 words
    turns = {r["turn"]: r["prompt_tokens"] for r in res["runs"][0]["requests"]}
    assert turns == {0: 4, 1: 4 + 3 + 4, 2: 4 + 3 + 4 + 3 + 4}


@pytest.mark.parametrize("mode", ["fresh", "same"])
def test_sweep_rates_send_each_rate_its_own_prompts(tmp_path: Path, mode: str) -> None:
    """A sweep's second rate resends none of the first rate's prompts (a prefix cache
    would answer them), unless --sweep-prompts same; the JSON says which seed drew each."""
    extra = [] if mode == "fresh" else ["--sweep-prompts", "same"]
    with FakeServer() as srv:
        res = _run(tmp_path, srv.base_url, "--num-prompts", "5", "--input-len", "6",
                   "--output-len", "2", "--ignore-eos", "--sweep-rates", "500,inf", *extra)
    first = {b["prompt"] for b in srv.stats.bodies[:5]}
    second = {b["prompt"] for b in srv.stats.bodies[5:]}
    assert len(first) == len(second) == 5
    assert [r["dataset_seed"] for r in res["runs"]] == ([3, 4] if mode == "fresh" else [3, 3])
    assert (first.isdisjoint(second) if mode == "fresh" else first == second)


def test_failures_counted_and_first_error_printed(tmp_path: Path, capsys) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "hello there", "output_len": 4},
        {"prompt": "please FAIL now", "output_len": 4},
        {"prompt": "one two three", "output_len": 2},
    ]))
    with FakeServer() as srv:
        res = _run(tmp_path, srv.base_url, "--dataset", "jsonl", "--dataset-path", str(data),
                   "--num-prompts", "3", "--ignore-eos")
    s = res["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (2, 1)
    _check_counts_match({"runs": [{"summary": {**s, "failed": 0}}]}, srv)
    assert "HTTP 500" in capsys.readouterr().out


def test_bad_flags_exit_2(tmp_path: Path) -> None:
    assert duet_main(["bench", "serve", "--slo", "ttft", "--model", "m", "--no-progress"]) == 2
    assert duet_main(["bench", "serve", "--dataset", "chat", "--model", "m"]) == 2
    assert duet_main(["bench", "serve", "--input-len", "9:1", "--model", "m"]) == 2


@pytest.mark.parametrize("sweep", [False, True])
def test_plot_from_results(tmp_path: Path, sweep: bool) -> None:
    pytest.importorskip("matplotlib")
    with FakeServer() as srv:
        extra = ["--sweep-rates", "400,800"] if sweep else []
        _run(tmp_path, srv.base_url, "--num-prompts", "4", "--input-len", "3", "--output-len", "4",
             "--slo", "ttft=60000", *extra)
    png = tmp_path / "out.png"
    assert duet_main(["bench", "plot", str(tmp_path / "res.json"), str(tmp_path / "res.json"), "-o", str(png)]) == 0
    assert png.stat().st_size > 1000
