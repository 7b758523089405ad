"""Reliability campaign for issue #11: start `duet serve` (default model, 127.0.0.1) and
run bounded scenarios against it; print a table and write JSON.

    python benchmarks/reliability/campaign.py [--out results.json] [--num-threads 2]

Scenarios (all counts bounded; nothing leaves 127.0.0.1):
  seeds      8 victim streams while bad seeds arrive: 400s, victims complete
  big_body   10 x 20 MB bodies (413) while /health is polled and a stream runs:
             worst /health latency, the stream's largest gap, server RSS before/after
  limits     n=10000 (400), completions without max_tokens (16 tokens)
  long_prompt  a 2,000-token prompt arrives while 8 streams decode: per stream, the
             largest inter-chunk gap over its median (the step budget at work)
  ttft       server-side TTFT (Prometheus sum/count) vs the client's, at concurrency
             1 and 64
  bench_ttft `duet bench serve` at --max-concurrency 1 (32 requests) and 64 (128):
             client TTFT p50 vs the server's, read per request from `server_timing`
  sigterm    SIGTERM with 20 in-flight 200-token streams (--shutdown-timeout 5): full
             outputs, error+[DONE] endings, 503s during the drain, exit code
Each scenario reports requests sent/completed/errored and KV blocks in use after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import psutil

PROMPT = "The sky is"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, threads: int) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "duetserve", "serve", "--port", str(self.port),
                     "--num-threads", str(threads), *args]

    def __enter__(self) -> "Server":
        self.log = open(f"/tmp/duet-reliability-{self.port}.log", "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("server not ready")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.base}/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                name = key.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def budget_line(self) -> str:
        with open(self.log.name) as f:
            return next((ln.strip() for ln in f if "step budget" in ln), "")


async def stream(ac: httpx.AsyncClient, base: str, body: dict) -> dict:
    """One streaming completion: chunk arrival times, text chunks, ending."""
    t0 = time.perf_counter()
    times, events, status = [], [], None
    try:
        async with ac.stream("POST", f"{base}/v1/completions",
                             json={**body, "stream": True}) as resp:
            status = resp.status_code
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if line[6:] != "[DONE]" and '"error"' not in line:
                        times.append(time.perf_counter())
    except httpx.HTTPError as e:
        return {"status": None, "error": repr(e), "times": [], "events": events, "t0": t0}
    errored = any('"error"' in e for e in events)
    return {"status": status, "times": times, "events": events, "t0": t0,
            "error": errored, "done": bool(events) and events[-1] == "[DONE]"}


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def kv_after(srv: Server) -> float:
    deadline = time.monotonic() + 30
    m = srv.metrics()
    while m.get("duet:kv_cache_used_blocks", 0) and time.monotonic() < deadline:
        time.sleep(0.2)
        m = srv.metrics()
    return m.get("duet:kv_cache_used_blocks", 0)


# -- scenarios -----------------------------------------------------------------------------

async def seeds(srv: Server) -> dict:
    victim = {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    bad = [(2**64, 1), (-(2**63) - 1, 1), (2**64 - 1, 2), (10**30, 1)] * 5
    async with httpx.AsyncClient(timeout=300) as ac:
        victims = [asyncio.create_task(stream(ac, srv.base, victim)) for _ in range(8)]
        await asyncio.sleep(0.5)
        codes = await asyncio.gather(*(ac.post(f"{srv.base}/v1/completions", json={
            "prompt": PROMPT, "seed": s, "n": n, "max_tokens": 4}) for s, n in bad))
        res = await asyncio.gather(*victims)
    return {"sent": 8 + len(bad), "bad_seed_400": sum(r.status_code == 400 for r in codes),
            "victims_completed": sum(r["done"] and not r["error"] for r in res),
            "victims_errored": sum(bool(r["error"]) for r in res), "kv_blocks_after":
            kv_after(srv)}


def _send_big_body(port: int, size: int) -> int | None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            chunk = b"a" * 2**20
            for _ in range(size // len(chunk)):
                s.sendall(chunk)
        except OSError:
            pass                                  # the server answered and closed
        try:
            answer = s.recv(200)
        except OSError:
            return None
    return int(answer.split()[1]) if answer.startswith(b"HTTP/1.1") else None


async def big_body(srv: Server) -> dict:
    rss_before = srv.rss_mb()
    health_ms: list[float] = []
    stop = False

    async def poll_health(ac: httpx.AsyncClient) -> None:
        while not stop:
            t = time.perf_counter()
            await ac.get(f"{srv.base}/health")
            health_ms.append((time.perf_counter() - t) * 1e3)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=300) as ac:
        poller = asyncio.create_task(poll_health(ac))
        st = asyncio.create_task(stream(ac, srv.base, {
            "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True, "temperature": 0}))
        codes = [await asyncio.to_thread(_send_big_body, srv.port, 20 * 2**20)
                 for _ in range(10)]
        res = await st
        stop = True
        await poller
    return {"sent": 10, "status_413": codes.count(413), "health_max_ms": max(health_ms),
            "stream_max_gap_s": max(gaps(res["times"]), default=0.0),
            "stream_completed": res["done"] and not res["error"],
            "rss_before_mb": rss_before, "rss_after_mb": srv.rss_mb(),
            "kv_blocks_after": kv_after(srv)}


def limits(srv: Server) -> dict:
    n = httpx.post(f"{srv.base}/v1/completions", json={"prompt": PROMPT, "n": 10000},
                   timeout=60)
    d = httpx.post(f"{srv.base}/v1/completions", json={"prompt": PROMPT, "temperature": 0,
                                                        "ignore_eos": True}, timeout=120)
    return {"n_10000_status": n.status_code, "n_10000_param": n.json()["error"]["param"],
            "default_max_tokens": d.json()["usage"]["completion_tokens"]}


async def long_prompt(srv: Server) -> dict:
    long_text = " ".join(f"w{i}" for i in range(520))           # about 2,000 tokens
    async with httpx.AsyncClient(timeout=600) as ac:
        body = {"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "temperature": 0}
        streams = [asyncio.create_task(stream(ac, srv.base, body)) for _ in range(8)]
        await asyncio.sleep(3.0)
        t = time.perf_counter()
        r = await ac.post(f"{srv.base}/v1/completions", json={
            "prompt": long_text, "max_tokens": 1})
        long_ttft = time.perf_counter() - t
        res = await asyncio.gather(*streams)
    ratios, worst = [], []
    for x in res:
        g = gaps(x["times"])
        if len(g) > 4:
            ratios.append(max(g) / statistics.median(g))
            i = g.index(max(g))              # when the worst gap ended, from the long send
            worst.append(round(x["times"][i + 1] - t, 3))
    return {"long_prompt_tokens": r.json()["usage"]["prompt_tokens"],
            "long_prompt_latency_s": long_ttft, "max_gap_over_median": max(ratios),
            "gap_ratio_per_stream": [round(x, 2) for x in ratios],
            "worst_gap_end_after_long_send_s": worst,
            "median_gap_s": statistics.median(statistics.median(gaps(x["times"]))
                                              for x in res),
            "budget": srv.budget_line(), "kv_blocks_after": kv_after(srv)}


async def ttft(srv: Server, concurrency: int, num: int) -> dict:
    before = srv.metrics()
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    sem = asyncio.Semaphore(concurrency)

    async def one(ac):
        async with sem:
            return await stream(ac, srv.base, body)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as ac:
        res = await asyncio.gather(*(one(ac) for _ in range(num)))
    after = srv.metrics()
    client = [r["times"][0] - r["t0"] for r in res if r["times"]]
    key = "duet:time_to_first_token_seconds"
    count = after[key + "_count"] - before.get(key + "_count", 0)
    server_mean = (after[key + "_sum"] - before.get(key + "_sum", 0)) / count
    return {"concurrency": concurrency, "requests": num, "client_ttft_p50_s":
            statistics.median(client), "client_ttft_mean_s": statistics.mean(client),
            "server_ttft_mean_s": server_mean,
            "server_vs_client_mean": server_mean / statistics.mean(client)}


def bench_ttft(srv: Server, concurrency: int, num: int) -> dict:
    """`duet bench serve` (short random prompts, 16 tokens) at `concurrency`: its client
    TTFT p50 next to the server's (read from each response's `server_timing`)."""
    out = f"/tmp/duet-reliability-bench-{srv.port}-{concurrency}.json"
    subprocess.run([sys.executable, "-m", "duetserve", "bench", "serve", "--base-url",
                    srv.base, "--num-prompts", str(num), "--input-len", "8",
                    "--output-len", "16", "--ignore-eos", "--request-rate", "inf",
                    "--max-concurrency", str(concurrency), "--percentiles", "50,90,99",
                    "--no-progress", "--output-json", out], check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        run = json.load(f)["runs"][0]
    s, recs = run["summary"], run["requests"]
    gap = sorted(r["ttft"] - r["server_ttft"] for r in recs if r["success"])
    return {"concurrency": concurrency, "requests": num, "completed": s["completed"],
            "client_ttft_p50_ms": s["ttft_ms"]["median"],
            "server_ttft_p50_ms": s["server_ttft_ms"]["median"],
            "server_vs_client_p50": s["server_vs_client_ttft_p50"],
            "client_minus_server_ms_p50": 1e3 * statistics.median(gap),
            "client_minus_server_ms_max": 1e3 * gap[-1]}


async def sigterm(threads: int) -> dict:
    with Server("--shutdown-timeout", "5", threads=threads) as srv:
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        async with httpx.AsyncClient(timeout=600) as ac:
            tasks = [asyncio.create_task(stream(ac, srv.base, body)) for _ in range(20)]
            while srv.metrics().get("duet:num_requests_running", 0) < 20:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
            srv.proc.send_signal(signal.SIGTERM)
            late = []
            for _ in range(5):
                await asyncio.sleep(0.3)
                try:
                    late.append((await ac.post(f"{srv.base}/v1/completions", json={
                        "prompt": PROMPT, "max_tokens": 2})).status_code)
                except httpx.HTTPError:
                    late.append(None)
            res = await asyncio.gather(*tasks)
        code = srv.proc.wait(120)
    full = sum(r["done"] and not r["error"] for r in res)
    cut = sum(r["done"] and bool(r["error"]) for r in res)
    return {"streams": 20, "full_output": full, "error_then_done": cut,
            "cut_without_done": 20 - full - cut, "late_requests_503": late.count(503),
            "late_requests": len(late), "exit_code": code}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/reliability/results.json")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--server-args", default="",
                   help="extra `duet serve` flags, one string (e.g. \"--trace-file t.json\")")
    args = p.parse_args()
    results: dict = {"machine": {"cpus": os.cpu_count()}}
    want = lambda name: args.only is None or name in args.only  # noqa: E731
    with Server(*args.server_args.split(), threads=args.num_threads) as srv:
        results["budget"] = srv.budget_line()
        if want("seeds"):
            results["seeds"] = asyncio.run(seeds(srv))
        if want("big_body"):
            results["big_body"] = asyncio.run(big_body(srv))
        if want("limits"):
            results["limits"] = limits(srv)
        if want("long_prompt"):
            results["long_prompt"] = asyncio.run(long_prompt(srv))
        if want("ttft"):
            results["ttft"] = [asyncio.run(ttft(srv, 1, 8)), asyncio.run(ttft(srv, 64, 64))]
        if want("bench_ttft"):
            bench_ttft(srv, 64, 64)                                 # warm-up
            results["bench_ttft"] = [bench_ttft(srv, 1, 32), bench_ttft(srv, 64, 128)]
    if want("sigterm"):
        results["sigterm"] = asyncio.run(sigterm(args.num_threads))
    print(json.dumps(results, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
