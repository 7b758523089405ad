"""LoRA adapters loaded and unloaded at run time under load (issue 65): no request fails,
no KV block stays in use, the server's memory returns to its level after the unloads.

    PYTHONPATH=. .venv/bin/python benchmarks/lora_churn.py [--model FILE] [--cycles 4]
        [--clients 3] [--max-tokens 16] [--out out/lora_churn.json]

One `duet serve` (--max-loras 2, adapter a0 registered at start) takes requests from
--clients threads without pause (base and a0, alternating) while the main thread, --cycles
times: loads adapter `churn` (POST /v1/load_lora_adapter), sends it requests, unloads it
(POST /v1/unload_lora_adapter) right after the last was sent, so some run while it is
being unloaded (admitted requests finish under it). A control phase first runs the same
traffic with a0 in churn's place and no loading: memory after it is the level to return
to (the KV cache's pages and the allocator's caches grow with the first busy steps).
Random rank-16 adapters of every projection (benchmarks/lora_step.py's). Reports the
requests and their failures (any status but 200, except 404 for a `churn` request that
reached the server after the unload), `duet:kv_cache_used_blocks` once every answer is
in, and the server's resident memory (VmRSS) after a warm-up, after the control phase,
with `churn` resident, and after the last unload. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_step import write_adapter  # noqa: E402

from duetserve.loader import load_model_config, resolve_model_path  # noqa: E402

PORT = 8124
URL = f"http://127.0.0.1:{PORT}"


def post(path: str, body: dict, timeout: float = 600) -> tuple[int, str]:
    req = urllib.request.Request(URL + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def complete(model: str, max_tokens: int) -> int:
    return post("/v1/completions", {"model": model, "prompt": "def fibonacci(n):",
                                    "max_tokens": max_tokens, "temperature": 0})[0]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def used_blocks() -> float:
    with urllib.request.urlopen(URL + "/metrics", timeout=30) as r:
        m = re.search(r"^duet:kv_cache_used_blocks(?:\{[^}]*\})? (\S+)$", r.read().decode(),
                      re.M)
    return float(m.group(1)) if m else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--per-cycle", type=int, default=3, help="requests to `churn` a cycle")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lora-dtype", default="auto")
    ap.add_argument("--out", default="out/lora_churn.json")
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    cfg, tmp = load_model_config(model), tempfile.mkdtemp()
    a0, churn = (write_adapter(f"{tmp}/{n}", cfg, 16, i) for i, n in enumerate(("a0", "c")))
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "duet"), "serve", "--model", model,
         "--port", str(PORT), "--num-threads", "2", "--max-loras", "2", "--lora-modules",
         f"a0={a0}", "--lora-dtype", args.lora_dtype],
        stdout=open(f"{tmp}/server.log", "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(900):
            try:
                urllib.request.urlopen(URL + "/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(1)
        base = json.loads(urllib.request.urlopen(URL + "/v1/models").read())["data"][0]["id"]
        for m in (base, "a0", base, "a0"):                 # warm-up: a0 resident
            assert complete(m, args.max_tokens) == 200
        rss = {"warm": rss_mib(server.pid)}
        statuses: list[tuple[str, int]] = []
        lock = threading.Lock()

        def record(m: str) -> None:
            s = complete(m, args.max_tokens)
            with lock:
                statuses.append((m, s))

        def phase(name: str | None) -> None:
            """The clients' load while the main thread, --cycles times, sends --per-cycle
            requests to `churn` between its load and unload (name None: to a0, no churn:
            the control phase, the same traffic)."""
            stop = threading.Event()

            def client(k: int) -> None:
                i = k
                while not stop.is_set():
                    record((base, "a0")[i % 2])
                    i += 1

            threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
            for t in threads:
                t.start()
            target = name or "a0"
            for _ in range(args.cycles):
                if name:
                    loads.append(post("/v1/load_lora_adapter",
                                      {"lora_name": name, "lora_path": churn})[0])
                sent = [threading.Thread(target=record, args=(target,))
                        for _ in range(args.per_cycle - 1)]
                for t in sent:
                    t.start()
                record(target)                    # this one ends: the adapter is resident
                if name:
                    rss["churn resident"] = max(rss.get("churn resident", 0),
                                                rss_mib(server.pid))
                last = threading.Thread(target=record, args=(target,))
                last.start()                      # one more, unloaded while it may run
                if name:
                    loads.append(post("/v1/unload_lora_adapter", {"lora_name": name})[0])
                threads += sent + [last]
            stop.set()
            for t in threads:
                t.join()

        loads: list[int] = []
        phase(None)
        rss["after the control phase"] = rss_mib(server.pid)
        phase("churn")
        blocks = used_blocks()             # every answer is in: the requests have ended
        rss["after unloads, idle"] = rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    # a request naming `churn` that reached the server after the unload gets 404, as vLLM's
    # (the last of each cycle races the unload): not a failure
    failed = [(m, s) for m, s in statuses if s != 200 and not (m == "churn" and s == 404)]
    late = sum(1 for m, s in statuses if m == "churn" and s == 404)
    print(f"{os.path.basename(model)}, {args.clients} clients, {args.cycles} load/unload "
          f"cycles ({args.lora_dtype} weights)")
    print("| requests | failed | churn 404 after unload | load/unload answers | KV blocks "
          "used, idle | RSS MiB warm | after control | with churn | after unloads |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(statuses)} | {len(failed)} {failed[:3]} | {late} | {sorted(set(loads))} | "
          f"{blocks:.0f} | {rss['warm']:.0f} | {rss['after the control phase']:.0f} | "
          f"{rss['churn resident']:.0f} | "
          f"{rss['after unloads, idle']:.0f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": model, "cycles": args.cycles, "clients": args.clients,
                   "requests": len(statuses), "failed": failed, "churn_404": late,
                   "load_answers": loads,
                   "kv_used_blocks_idle": blocks, "rss_mib": rss}, f, indent=1)


if __name__ == "__main__":
    main()
