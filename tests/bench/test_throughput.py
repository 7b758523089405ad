"""`duet bench throughput` on a tiny random-weight checkpoint (fast; no timing asserts)."""
from __future__ import annotations

import json

import pytest

from duetserve.bench.throughput import make_random_requests
from duetserve.entrypoints.cli import main as cli_main

FIELDS = ("num_requests", "elapsed_s", "requests_per_s", "input_tokens_per_s",
          "output_tokens_per_s", "total_tokens_per_s", "num_input_tokens",
          "num_output_tokens", "num_steps", "mean_prefill_tokens_per_step",
          "mean_decode_tokens_per_step", "prefix_cache_hit_rate", "num_preemptions",
          "prefill_step_seconds", "decode_only_step_seconds", "prefill_tokens_per_s",
          "decode_tokens_per_s", "steps", "workload", "engine")


def _run(tmp_path, model: str, *extra: str) -> dict:
    out = tmp_path / "r.json"
    rc = cli_main(["bench", "throughput", "--model", model, "--num-prompts", "8",
                   "--input-len", "8:40", "--output-len", "4:12", "--num-threads", "2",
                   "--kv-cache-memory", "0.01", "--max-num-batched-tokens", "256",
                   "--output-json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_random_requests_are_seeded_and_avoid_specials():
    a = make_random_requests(8, (5, 9), (2, 3), 0, 300, {298, 299}, prefix_len=4)
    b = make_random_requests(8, (5, 9), (2, 3), 0, 300, {298, 299}, prefix_len=4)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(t not in (298, 299) for r in a for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids[:4]) for r in a}) == 1
    assert all(9 <= len(r.prompt_token_ids) <= 13 and 2 <= r.output_len <= 3 for r in a)


def test_cli_json_fields_and_output_count(tmp_path, tiny_checkpoints, capsys):
    r = _run(tmp_path, tiny_checkpoints["llama-gqa-untied"])
    for k in FIELDS:
        assert k in r, k
    assert r["num_requests"] == 8
    assert r["num_output_tokens"] == r["num_requested_output_tokens"]
    reqs = make_random_requests(8, (8, 40), (4, 12), 0, 298, {298, 299})
    assert r["num_output_tokens"] == sum(q.output_len for q in reqs)
    assert r["num_input_tokens"] == sum(len(q.prompt_token_ids) for q in reqs)
    assert r["num_steps"] == sum(s["num_steps"] for s in r["steps"].values())
    assert r["prefix_cache_hit_rate"] == 0.0     # random prompts share nothing
    assert "requests/s" in capsys.readouterr().out


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_len_hit_rate(tmp_path, tiny_checkpoints, caching):
    extra = ["--prefix-len", "64"] + ([] if caching else ["--no-prefix-caching"])
    r = _run(tmp_path, tiny_checkpoints["llama-gqa-untied"], *extra)
    assert r["num_output_tokens"] == r["num_requested_output_tokens"]
    if caching:
        assert r["prefix_cache_hit_rate"] > 0
    else:
        assert r["prefix_cache_hit_rate"] == 0


def test_jsonl_dataset(tmp_path, tiny_checkpoints):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"hello {i} world", "output_len": 3 + i})
                              for i in range(4)) + "\n")
    r = _run(tmp_path, tiny_checkpoints["llama-gqa-untied"], "--dataset-path", str(path))
    assert r["num_requests"] == 4
    assert r["num_output_tokens"] == 3 + 4 + 5 + 6
