"""`duet bench serve` against a real duetserve server (tiny random model): the counts the
benchmark reports equal what the server's /metrics counted."""
from __future__ import annotations

import json
import os
import sys

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
    requested = [r["expected_output_len"] for r in json.loads(out.read_text())["runs"][0]["requests"]]
    assert summary["total_output_tokens"] == sum(requested)
