"""Resident memory of `duet serve MODEL` after load and after serving requests.

    .venv/bin/python benchmarks/serve_memory.py --model FILE.gguf [--requests 8]

Starts the server, waits for /health, reads VmRSS from /proc, sends a few completions
(128 prompt tokens, 32 output tokens), reads VmRSS again, stops the server. Prints one JSON
line with the file size for comparison.
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


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra", default="")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "duetserve", "serve", args.model, "--port",
                             str(port), "--num-threads", str(args.threads),
                             *args.extra.split()], stdout=subprocess.DEVNULL,
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
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    size = os.path.getsize(args.model) / 2**20
    print(json.dumps({"model": os.path.basename(args.model), "file_mib": round(size, 1),
                      "rss_after_load_mib": round(after_load, 1),
                      "rss_after_requests_mib": round(after, 1),
                      "ratio_to_file": round(after / size, 2)}))


if __name__ == "__main__":
    main()
