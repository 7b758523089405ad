"""Resident memory of `duet serve MODEL` after load and after serving requests.

    .venv/bin/python benchmarks/serve_memory.py --model FILE.gguf [--requests 8]

Starts the server, waits for /health, reads VmRSS from /proc, sends a few completions
(128 prompt tokens, 32 output tokens), reads VmRSS again, stops the server. Prints one JSON
line with the file size for comparison.

The KV cache is one lazily allocated mapping of `--kv-cache-memory` (default 2 GiB) whose
pages become resident as blocks are first written; it is reported apart (`kv_touched_mib`,
found in /proc/PID/smaps as the anonymous mapping of the cache's size), and
`ratio_to_file_without_kv` is the model's own footprint: RSS minus the KV cache's pages.
`peak_mib` is VmHWM (the high-water mark, prefill transients included).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx


def status_mib(pid: int, key: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib(pid: int) -> float:
    return status_mib(pid, "VmRSS")


def kv_cache_bytes(model: str, extra: list[str]) -> int:
    """Bytes of the KV cache `duet serve` allocates for this model and these flags."""
    from duetserve.config import EngineConfig
    from duetserve.loader import load_model_config
    from duetserve.worker.kv_cache import kv_bytes_per_token, num_blocks_for_memory
    import torch

    cfg = load_model_config(model)
    gib = EngineConfig().kv_cache_memory
    if "--kv-cache-memory" in extra:
        gib = float(extra[extra.index("--kv-cache-memory") + 1])
    block = EngineConfig().block_size
    return num_blocks_for_memory(cfg, torch.float32, block, gib) * block * \
        kv_bytes_per_token(cfg, torch.float32)


def mapping_rss_mib(pid: int, size_lo: int, size_hi: int) -> float:
    """Rss of the anonymous mappings whose size is in [size_lo, size_hi] (MiB)."""
    total, match = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                match = len(parts) <= 5 and size_lo <= b - a <= size_hi
            elif parts[0] == "Rss:" and match:
                total += int(parts[1])
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra", default="")
    args = ap.parse_args()
    extra = args.extra.split()
    kv = kv_cache_bytes(args.model, extra)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "duetserve", "serve", args.model, "--port",
                             str(port), "--num-threads", str(args.threads),
                             *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        after_load = rss_mib(proc.pid)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        for i in range(args.requests):
            httpx.post(f"{base}/v1/completions", timeout=600, json={
                "model": model, "prompt": [100 + (i * 31 + j) % 5000 for j in range(128)],
                "max_tokens": 32, "temperature": 0}).raise_for_status()
        after = rss_mib(proc.pid)
        kv_touched = mapping_rss_mib(proc.pid, kv, kv + 4 * 2**20)
        peak = status_mib(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    size = os.path.getsize(args.model) / 2**20
    print(json.dumps({"model": os.path.basename(args.model), "file_mib": round(size, 1),
                      "rss_after_load_mib": round(after_load, 1),
                      "rss_after_requests_mib": round(after, 1),
                      "peak_mib": round(peak, 1),
                      "kv_cache_mib": round(kv / 2**20, 1),
                      "kv_touched_mib": round(kv_touched, 1),
                      "ratio_to_file": round(after / size, 2),
                      "ratio_to_file_without_kv": round((after - kv_touched) / size, 2)}))


if __name__ == "__main__":
    main()
