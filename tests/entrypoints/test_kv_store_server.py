"""`duet serve --kv-store DIR` in process (tiny model): a second server on the same
directory answers a prompt sharing the first one's prefix from disk, and /metrics shows
it (hits and bytes per tier, the store's series, the KV capacity in tokens)."""
from __future__ import annotations

import argparse

from fastapi.testclient import TestClient

from duetserve.entrypoints.openai import serve

PREFIX = [(i * 37 + 11) % 250 + 3 for i in range(96)]


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _server(model: str, store: str) -> TestClient:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([model, "--num-threads", "2", "--block-size", "4",
                         "--max-num-batched-tokens", "64", "--kv-store", store])
    return TestClient(serve.build_server(args).config.app)


def _complete(c: TestClient, prompt: list[int]) -> list:
    r = c.post("/v1/completions", json={"model": c.get("/v1/models").json()["data"][0]["id"],
                                        "prompt": prompt, "max_tokens": 4,
                                        "temperature": 0.0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_second_server_reads_the_prefix_from_disk(tiny_checkpoints, tmp_path) -> None:
    model = tiny_checkpoints["llama-gqa-tied"]
    with _server(model, str(tmp_path)) as c:      # the lifespan's end flushes the writes
        _complete(c, PREFIX + [5, 6])
        first = c.get("/metrics").text
    assert _sample(first, "duet:prefix_cache_disk_hits_total") == 0
    assert _sample(first, "duet:kv_cache_capacity_tokens") > 0
    with _server(model, str(tmp_path)) as c:
        assert _sample(c.get("/metrics").text, "duet:kv_store_blocks") == len(PREFIX) // 4
        _complete(c, PREFIX + [7, 8, 9])
        text = c.get("/metrics").text
    assert _sample(text, "duet:prefix_cache_disk_hits_total") == len(PREFIX)
    assert _sample(text, "duet:kv_store_read_blocks_total") == len(PREFIX) // 4
    per_token = 3 * 2 * 2 * 16 * 4              # layers, k/v, kv heads, head dim, float32
    assert _sample(text, 'duet:prefix_cache_hit_bytes_total{model_name="llama-gqa-tied",'
                   'tier="disk"}') == len(PREFIX) * per_token
