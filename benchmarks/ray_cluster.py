"""`duet cluster` on a simulated two-node Ray cluster (docs/scaling.md): node A
(127.0.0.2, {"prefill": 1}) and node B (127.0.0.3, {"decode": 1}) on this host, one
prefill instance on A and one decode instance on B, KV over Mooncake TCP.

Measures: the Ray cluster's start, `duet cluster` up (driver start to router /health
200), the first successful request, per-request KV transfer time and bytes (the decode
instance's metrics) and router TTFT for --requests prompts of about --prompt-words words,
and restart-to-serving after SIGKILL of the decode instance's actor process (until a
request through the router succeeds again).

    python benchmarks/ray_cluster.py --requests 16 --prompt-words 200 \\
        --output-json out/ray_cluster.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from disagg import WORDS, free_port   # benchmarks/ (the script's own folder)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def until_ok(fn, timeout: float) -> float:
    """Seconds until fn() returns True (polled every 0.1 s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if fn():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"not within {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--serve-args", default="--num-threads 1 --kv-cache-memory 0.25")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="duetray-", dir="/tmp")
    os.environ.update({"RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled",
                       "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.pathsep.join(
                           filter(None, [REPO, os.environ.get("PYTHONPATH")]))})
    from ray.cluster_utils import Cluster
    out: dict = {"requests": args.requests, "prompt_words": args.prompt_words}
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"prefill": 1}, "node_ip_address": "127.0.0.2",
        "include_dashboard": False})
    cluster.add_node(num_cpus=4, resources={"decode": 1}, node_ip_address="127.0.0.3")
    cluster.wait_for_nodes()
    out["ray_cluster_start_s"] = round(time.monotonic() - t0, 2)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(tmp, "cluster.log"), "w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "duetserve", "cluster", "--ray", cluster.address,
         "--port", str(port), "--health-interval", "0.5", "--serve-args", args.serve_args,
         "--prefill", "1", "--decode", "1", "--prefill-resources", '{"prefill": 1}',
         "--decode-resources", '{"decode": 1}'], stdout=log, stderr=subprocess.STDOUT)
    try:
        t1 = time.monotonic()
        out["duet_cluster_up_s"] = round(until_ok(
            lambda: httpx.get(base + "/health", timeout=1).status_code == 200, 600), 2)
        body = {"prompt": "The sky is", "max_tokens": args.max_tokens, "temperature": 0}
        until_ok(lambda: httpx.post(base + "/v1/completions", json=body,
                                    timeout=60).status_code == 200, 60)
        out["first_request_after_driver_start_s"] = round(time.monotonic() - t1, 2)
        inst = {m["name"]: m for m in httpx.get(base + "/cluster").json()["instances"]}
        out["placement"] = {n: m["host"] for n, m in inst.items()}
        decode_url = inst["decode-0"]["url"]
        before = httpx.get(decode_url + "/metrics").text
        ttfts = []
        for i in range(args.requests):
            prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(args.prompt_words))
            t = time.monotonic()
            with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
                    **body, "prompt": f"{i}: {prompt}", "stream": True,
                    "ignore_eos": True}) as r:
                assert r.status_code == 200
                first = None
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic() - t
            ttfts.append(first)
        after = httpx.get(decode_url + "/metrics").text
        n = metric(after, "duet:kv_transfers_total", backend="mooncake", status="done") - \
            metric(before, "duet:kv_transfers_total", backend="mooncake", status="done")
        secs = metric(after, "duet:kv_transfer_time_seconds_total", backend="mooncake") - \
            metric(before, "duet:kv_transfer_time_seconds_total", backend="mooncake")
        nbytes = metric(after, "duet:kv_transfer_bytes_total", backend="mooncake") - \
            metric(before, "duet:kv_transfer_bytes_total", backend="mooncake")
        out.update(transfers=int(n), transfer_ms_per_request=round(1000 * secs / n, 2),
                   transfer_bytes_per_request=int(nbytes / n),
                   router_ttft_ms_median=round(1000 * statistics.median(ttfts), 1))
        killed = time.monotonic()
        os.kill(inst["decode-0"]["pid"], signal.SIGKILL)
        until_ok(lambda: httpx.post(base + "/v1/completions", json=body,
                                    timeout=60).status_code == 200, 300)
        out["decode_restart_to_serving_s"] = round(time.monotonic() - killed, 2)
    finally:
        driver.terminate()
        driver.wait(60)
        cluster.shutdown()
        log.close()
        subprocess.run(["rm", "-rf", tmp], check=False)
    print(json.dumps(out, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
