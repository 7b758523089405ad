"""`duet bench serve` against a real duetserve server (tiny random model): the counts the
benchmark reports equal what the server's /metrics counted, and so do the server TTFTs
it read from each response's `server_timing` (time to the first streamed chunk)."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))

from duetserve.entrypoints.cli import main  # noqa: E402
from server_process import ServerProcess  # noqa: E402


def test_bench_serve_counts_match_server_metrics(tiny_checkpoints, tmp_path):
    out = tmp_path / "bench.json"
    with ServerProcess(tiny_checkpoints["llama-gqa-tied"], "--served-model-name", "tiny",
                       "--max-model-len", "256") as server:
        before = server.metrics()
        rc = main(["bench", "serve", "--base-url", server.base, "--endpoint", "completions",
                   "--num-prompts", "12", "--input-len", "4:12", "--output-len", "3:9",
                   "--request-rate", "inf", "--max-concurrency", "4", "--seed", "1",
                   "--ignore-eos", "--no-progress", "--output-json", str(out)])
        assert rc == 0
        after = server.metrics()
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert delta["duet:request_success_total"] == 12
    assert delta["duet:prompt_tokens_total"] == summary["total_input_tokens"]
    assert delta["duet:generation_tokens_total"] == summary["total_output_tokens"]
    records = json.loads(out.read_text())["runs"][0]["requests"]
    requested = [r["expected_output_len"] for r in records]
    assert summary["total_output_tokens"] == sum(requested)
    # each request's server TTFT is its first chunk's time, the value the server's
    # time-to-first-chunk histogram observed; the engine's first-token stamps (the TTFT
    # histogram) come before them
    server_ttft = [r["server_ttft"] for r in records]
    assert all(t is not None and t > 0 for t in server_ttft)
    assert delta["duet:time_to_first_chunk_seconds_count"] == 12
    assert sum(server_ttft) == pytest.approx(
        delta["duet:time_to_first_chunk_seconds_sum"], rel=1e-6, abs=1e-6)
    assert 0 < delta["duet:time_to_first_token_seconds_sum"] <= sum(server_ttft)
    assert summary["server_ttft_ms"]["median"] is not None
    assert summary["server_vs_client_ttft_p50"] > 0
