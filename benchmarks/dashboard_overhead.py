"""Serving throughput with the dashboard open and polling against it closed: paired runs
of `duet bench serve` against one `duet serve` (issue 66's acceptance item).

    flock -x /tmp/duet-bench.lock .venv/bin/python benchmarks/dashboard_overhead.py \\
        [--base-url URL | --serve-args "--num-threads 2"] [--pairs 6] \\
        [--num-prompts 64] [--request-rate inf] [--input-len 128] [--output-len 128] \\
        [--poll-interval 1.0] [--output-json benchmarks/results/dashboard_overhead.json]

Arms. "closed": nobody polls, so the server records no steps (metrics/live.py records
only while a page polled in the last 30 s). "open": a client polls /dashboard/data?since=
SEQ every --poll-interval s for the whole run, exactly as the page does (the same URL,
the same cursor), so the server records every step and serialises them each second.
Each pair runs both arms back to back, the order alternating from pair to pair (open
first in odd pairs), so a drift of the machine falls on both alike; before each run the
server idles past the recorder's watch window, so a "closed" run after an "open" one
really records nothing. The workload and its seed are the same in every run.

Prints each run's output tok/s, TTFT p50 and TPOT p50, and per pair the ratio open /
closed; then the mean, min and max of the ratios. "Within noise" means the mean ratio of
output tok/s is within the spread of the closed runs (reported as closed CV). Writes
every run's `duet bench serve` summary and the ratios as JSON.

Needs a quiet machine: timings on a shared one measure the neighbours.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PY = sys.executable
WATCH_GAP_S = 32.0       # > LiveRecorder.watch_s (30 s): the recorder stops recording


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Poller:
    """Polls /dashboard/data like an open dashboard page, on a thread."""

    def __init__(self, base: str, interval: float) -> None:
        self.base, self.interval = base, interval
        self.polls = self.steps = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        since = 0
        with httpx.Client(base_url=self.base, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    data = client.get(f"/dashboard/data?since={since}").json()
                    since = data["seq"]
                    self.steps += len(data["steps"])
                    self.polls += 1
                except (httpx.HTTPError, ValueError, KeyError):
                    self.errors += 1
                self._stop.wait(self.interval)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def start_server(serve_args: str, ready_s: float = 600) -> tuple[subprocess.Popen, str]:
    """`duet serve --port P SERVE_ARGS` on a free port, once /health answers 200 (within
    `ready_s`): (process, base URL). Also used by kv_store_restart.py."""
    port = free_port()
    proc = subprocess.Popen([PY, "-m", "duetserve", "serve", "--port", str(port),
                             *shlex.split(serve_args)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"duet serve exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("duet serve did not become ready")


def bench_serve(args: argparse.Namespace, base: str, label: str) -> dict:
    """One `duet bench serve` run; its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [PY, "-m", "duetserve", "bench", "serve", "--base-url", base,
               "--num-prompts", str(args.num_prompts),
               "--request-rate", str(args.request_rate),
               "--input-len", args.input_len, "--output-len", args.output_len,
               "--ignore-eos", "--seed", str(args.seed), "--percentiles", "50,90,99",
               "--label", label, "--no-progress", "--output-json", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())["runs"][0]["summary"]


def one_run(args: argparse.Namespace, base: str, arm: str, pair: int) -> dict:
    time.sleep(WATCH_GAP_S)            # idle past the watch window (and cool down)
    if arm == "open":
        with Poller(base, args.poll_interval) as poller:
            summary = bench_serve(args, base, f"open-{pair}")
        extra = {"polls": poller.polls, "steps_polled": poller.steps,
                 "poll_errors": poller.errors}
    else:
        summary = bench_serve(args, base, f"closed-{pair}")
        extra = {}
    row = {"pair": pair, "arm": arm, "output_tok_s": summary["output_throughput"],
           "ttft_p50_ms": summary["ttft_ms"]["median"],
           "tpot_p50_ms": summary["tpot_ms"]["median"], "failed": summary["failed"], **extra}
    print(f"pair {pair} {arm:6} output {row['output_tok_s']:8.2f} tok/s  TTFT p50 "
          f"{row['ttft_p50_ms']:8.1f} ms  TPOT p50 {row['tpot_p50_ms']:7.2f} ms"
          + (f"  ({extra['polls']} polls, {extra['steps_polled']} steps)" if extra else ""),
          flush=True)
    return {**row, "summary": summary}


def report(runs: list[dict]) -> dict:
    """Per-pair ratios open / closed and their mean, min, max; printed as a table."""
    keys = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")
    pairs = sorted({r["pair"] for r in runs})
    ratios = {k: [] for k in keys}
    for p in pairs:
        arms = {r["arm"]: r for r in runs if r["pair"] == p}
        for k in keys:
            ratios[k].append(arms["open"][k] / arms["closed"][k])
    closed = [r["output_tok_s"] for r in runs if r["arm"] == "closed"]
    cv = statistics.pstdev(closed) / statistics.mean(closed) if len(closed) > 1 else None
    print(f"\n{'open / closed':16} {'mean':>8} {'min':>8} {'max':>8}")
    out = {}
    for k in keys:
        v = ratios[k]
        out[k] = {"ratios": v, "mean": statistics.mean(v), "min": min(v), "max": max(v)}
        print(f"{k:16} {out[k]['mean']:8.4f} {out[k]['min']:8.4f} {out[k]['max']:8.4f}")
    if cv is not None:
        print(f"closed runs' output tok/s: CV {cv:.2%} (the noise the mean ratio is judged "
              f"against: within noise when |mean - 1| <= CV)")
    out["closed_output_cv"] = cv
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None,
                   help="a running duet serve (default: start one)")
    p.add_argument("--serve-args", default="--num-threads 2",
                   help="flags of the duet serve started here (default %(default)s)")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", default="128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds between polls of the open arm (the page polls every 1 s)")
    p.add_argument("--output-json", default="benchmarks/results/dashboard_overhead.json")
    args = p.parse_args()
    proc, base = (None, args.base_url) if args.base_url else start_server(args.serve_args)
    try:
        bench_serve(args, base, "warmup")
        runs = []
        for pair in range(1, args.pairs + 1):
            order = ("open", "closed") if pair % 2 else ("closed", "open")
            runs += [one_run(args, base, arm, pair) for arm in order]
        ratios = report(runs)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "runs": runs, "ratios": ratios},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
