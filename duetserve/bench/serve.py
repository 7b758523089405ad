"""`duet bench serve`: load-test any OpenAI-compatible HTTP server (streaming only).

Sends a dataset (see datasets.py) at a request rate (Poisson or gamma arrivals), with an
optional concurrency cap, to /v1/completions or /v1/chat/completions with `stream: true`
and `stream_options.include_usage`, times every streamed chunk (see bench_metrics.py for
the TTFT / TPOT / ITL conventions), prints a summary table and optionally writes JSON.
A server that reports its own timing per request (duetserve's `server_timing` in the
final usage chunk: `first_chunk_s`, else `ttft_s`) gets its TTFT p50 printed next to the
client's, with the ratio.

HTTP only: this module imports nothing of the engine, so it can benchmark any server.
The client is aiohttp (as vLLM's serving benchmark): each request's clock starts right
before it is handed to the connection, and the client's own cost per chunk is small
(httpx's streaming added about 2 ms to every TTFT here, 0.5 ms more than aiohttp's).

Results JSON (--output-json), schema "duet-bench-serve/1"::

    {"schema", "label", "config": {every flag, "model", "url", "rates", "slo_ms", ...},
     "runs": [{"request_rate": float | "inf", "dataset_seed", "burstiness", "max_concurrency",
               "summary": bench_metrics.summarize(...),   # latencies in ms
               "requests": [RequestRecord.to_json(), ...]}]}  # times in s

One entry in "runs" per rate (--sweep-rates gives several). Each rate of a sweep sends
prompts of its own (dataset seed --seed + the rate's index) unless --sweep-prompts same:
resent prompts would be answered from the server's prefix cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import Any, AsyncIterator

import aiohttp
import httpx
from tqdm import tqdm

from duetserve.bench.bench_metrics import (SLO_KEYS, RequestRecord, compute_latencies, format_summary, summarize,
                                           write_json)
from duetserve.bench.datasets import Conversation, DatasetError, arrival_intervals, make_dataset

SCHEMA = "duet-bench-serve/1"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchError(Exception):
    """An error the user can fix; printed as one line, exit code 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `duet bench serve`."""
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    g.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions", help="API to call")
    g.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapter names the server serves: conversation i's requests name "
                        "adapter i mod their count (as `model`) instead of --model")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    add_load_arguments(p)
    add_dataset_arguments(p)
    p.add_argument("--sweep-prompts", choices=["fresh", "same"], default="fresh",
                   help="--sweep-rates: each rate gets its own prompts (dataset seed = --seed + "
                        "the rate's index; default), or every rate resends the first rate's, "
                        "which a server's prefix cache then answers")
    g = p.add_argument_group("request body")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM extension)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--no-continuous-usage", action="store_true",
                   help="do not ask for usage on every chunk (stream_options.continuous_usage_stats)")
    add_report_arguments(p)


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The arrival-process flags (shared with `duet simulate`)."""
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=100, help="requests (chat: conversations)")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, inf = all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    g.add_argument("--sweep-rates", default=None, help="comma list of rates run in turn, e.g. 1,2,4,inf")
    g.add_argument("--seed", type=int, default=0)


def add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    """The dataset flags (shared with `duet simulate`)."""
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=["random", "prefix", "jsonl", "chat"], default="random")
    g.add_argument("--dataset-path", default=None, help="JSONL of {prompt, output_len} for --dataset jsonl")
    g.add_argument("--input-len", default="256", help="approx prompt tokens: N or MIN:MAX (prefix: the suffix)")
    g.add_argument("--output-len", default="64", help="max_tokens: N or MIN:MAX")
    g.add_argument("--prefix-len", type=int, default=256, help="shared prefix (words) for --dataset prefix")
    g.add_argument("--num-turns", type=int, default=3, help="turns per conversation for --dataset chat")


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """The report flags (shared with `duet simulate`)."""
    g = p.add_argument_group("report")
    g.add_argument("--percentiles", default="90,99", help="comma list, e.g. 50,90,99,99.9")
    g.add_argument("--slo", nargs="*", default=[], metavar="KEY=MS", help="goodput SLOs: ttft= tpot= e2e= (ms)")
    g.add_argument("--label", default=None, help="name of this run in JSON and plots")
    g.add_argument("--output-json", default=None, help="write config, per-request records and summary")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def build_dataset(args: argparse.Namespace, seed: int | None = None) -> list[Conversation]:
    """The conversations the dataset flags describe, drawn with `seed` (default --seed);
    BenchError on a bad option."""
    try:
        return make_dataset(args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, prefix_len=args.prefix_len,
                            num_turns=args.num_turns, path=args.dataset_path,
                            seed=args.seed if seed is None else seed)
    except DatasetError as e:
        raise BenchError(str(e)) from None


def parse_slo(items: list[str]) -> dict[str, float]:
    """['ttft=200', 'tpot=50'] -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SLO_KEYS:
            raise BenchError(f"--slo {item!r}: expected KEY=MS with KEY in {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise BenchError(f"--slo {item!r}: {value!r} is not a number of ms") from None
    return slo


def parse_floats(text: str, flag: str) -> list[float]:
    """'1,2,inf' -> [1.0, 2.0, inf]."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{flag} {text!r}: expected comma-separated numbers") from None


def build_body(args: argparse.Namespace, model: str, payload: str | list[dict], max_tokens: int) -> dict[str, Any]:
    """The JSON body of one streaming request; payload is a prompt or a message list."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    body["messages" if args.endpoint == "chat" else "prompt"] = payload
    if not args.no_continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.extra_body:
        body.update(json.loads(args.extra_body))
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def server_ttft(timing: dict[str, Any]) -> float | None:
    """The server's TTFT for a streamed request, from its `server_timing`: arrival to the
    first chunk handed to the HTTP server (`first_chunk_s`), the server-side end of the
    span the client times (its first chunk received); the engine's own first-token
    stamp (`ttft_s`, about a millisecond earlier: the hand-off to the event loop and the
    chunk's encoding) where no chunk time is reported."""
    for key in ("first_chunk_s", "ttft_s"):
        if isinstance(timing.get(key), (int, float)):
            return float(timing[key])
    return None


async def _sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines as they arrive (no line-length limit, unlike readline)."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode(errors="replace").rstrip("\r")
    if buf:
        yield buf.decode(errors="replace")


async def send_request(client: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: RequestRecord,
                       approx_prompt: int) -> str:
    """Send one streaming request and fill `rec` (mutated in place). Returns the reply
    text. Never raises for HTTP or stream errors: they land in rec.error."""
    chunk_times: list[float] = []
    chunk_tokens: list[int] = []
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    per_chunk_usage, last_n = False, 0
    start = time.perf_counter()
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                rec.error = f"HTTP {resp.status}: {text[:300]}"
                return ""
            async for line in _sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - start
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return ""
                usage = obj.get("usage") or usage
                timing = obj.get("server_timing")      # duetserve's extension (others: absent)
                if isinstance(timing, dict):
                    rec.server_ttft = server_ttft(timing)
                choices = obj.get("choices") or []
                if not choices:
                    continue  # the final usage-only chunk carries no tokens
                text = "".join(_chunk_text(c) for c in choices)
                parts.append(text)
                u = obj.get("usage") or {}
                if u.get("completion_tokens") is not None:
                    per_chunk_usage = True
                    k, last_n = u["completion_tokens"] - last_n, u["completion_tokens"]
                else:
                    k = 1 if text else 0
                if k > 0:
                    chunk_times.append(now)
                    chunk_tokens.append(k)
        e2e = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 -- any failure of one request is recorded, never fatal
        rec.error = f"{type(e).__name__}: {e}"
        return ""
    counted = sum(chunk_tokens)
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = int(usage.get("prompt_tokens") or approx_prompt)
        rec.token_source = "usage" if per_chunk_usage else "usage_final"
    else:
        rec.output_tokens, rec.prompt_tokens, rec.token_source = counted, approx_prompt, "chunks"
    rec.e2e = e2e
    rec.ttft, rec.tpot, rec.itl = compute_latencies(chunk_times, chunk_tokens, e2e, rec.output_tokens)
    rec.success = True
    return "".join(parts)


async def run_once(args: argparse.Namespace, model: str, convs: list[Conversation], rate: float,
                   ) -> tuple[list[RequestRecord], float]:
    """Run the whole dataset once at `rate`; returns (records, duration in seconds).

    Conversation i starts at the i-th arrival time; its turns run one after another,
    each resending the earlier user messages and the server's actual replies.
    `--max-concurrency` caps in-flight requests (later arrivals wait for a slot).
    """
    url = args.base_url.rstrip("/") + ENDPOINTS[args.endpoint]
    offsets = arrival_intervals(len(convs), rate, args.burstiness, args.seed).cumsum()
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    total = sum(len(c) for c in convs)
    records: list[RequestRecord] = []
    pbar = tqdm(total=total, disable=args.no_progress, desc=f"rate {rate:g}", unit="req", file=sys.stderr)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or total)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=args.request_timeout)

    def model_of(cid: int) -> str:
        return args.lora_modules[cid % len(args.lora_modules)] if args.lora_modules else model

    async def one_conversation(cid: int, conv: Conversation, client: aiohttp.ClientSession, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + float(offsets[cid]) - time.perf_counter()))
        history: list[dict[str, str]] = []
        prompt_words, prev_ok = 0, True
        for turn, item in enumerate(conv):
            rec = RequestRecord(req_id=f"{cid}-{turn}", expected_output_len=item.output_len,
                                conversation_id=cid, turn=turn)
            records.append(rec)
            if not prev_ok:
                rec.error = "skipped: an earlier turn of this conversation failed"
                pbar.update(1)
                continue
            history.append({"role": "user", "content": item.prompt})
            prompt_words += item.input_len
            payload = list(history) if args.endpoint == "chat" else item.prompt
            body = build_body(args, model_of(cid), payload, item.output_len)
            if sem is not None:
                await sem.acquire()
            try:
                rec.send_time = time.perf_counter() - t0
                reply = await send_request(client, url, body, rec, prompt_words)
            finally:
                if sem is not None:
                    sem.release()
            prev_ok = rec.success
            history.append({"role": "assistant", "content": reply})
            prompt_words += rec.output_tokens
            pbar.update(1)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_conversation(i, c, client, t0) for i, c in enumerate(convs)))
        duration = time.perf_counter() - t0
    pbar.close()
    records.sort(key=lambda r: (r.conversation_id, r.turn))
    return records, duration


def resolve_model(base_url: str, timeout: float = 30.0) -> str:
    """The first model id listed by GET /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, timeout=timeout)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"could not list models at {url} ({e}); pass --model") from None


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def format_sweep(runs: list[dict[str, Any]]) -> str:
    """The goodput curve of a sweep as a table."""
    head = f"{'rate':>8}{'req/s':>9}{'goodput':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
    lines = [" rate sweep (latencies in ms) ".center(len(head), "="), head]
    for run in runs:
        s = run["summary"]
        cells = [s["request_throughput"], s["goodput"], s["ttft_ms"]["median"], s["ttft_ms"].get("p99"),
                 s["tpot_ms"]["median"], s["tpot_ms"].get("p99")]
        rate = run["request_rate"]
        lines.append(f"{rate if isinstance(rate, str) else format(rate, 'g'):>8}" + "".join(
            f"{'-' if v is None else format(v, '.2f'):>{9 if i < 2 else 10}}" for i, v in enumerate(cells)))
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every requested rate; returns the full results document (see module doc)."""
    slo = parse_slo(args.slo)
    percentiles = parse_floats(args.percentiles, "--percentiles")
    rates = parse_floats(args.sweep_rates, "--sweep-rates") if args.sweep_rates else [args.request_rate]
    if args.dataset == "chat" and args.endpoint != "chat":
        raise BenchError("--dataset chat needs --endpoint chat")
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            raise BenchError("--extra-body must be a JSON object")
    convs = build_dataset(args)
    model = args.model or resolve_model(args.base_url)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"}
    config.update(model=model, request_rate=rate_json(args.request_rate), rates=[rate_json(r) for r in rates],
                  url=args.base_url.rstrip("/") + ENDPOINTS[args.endpoint], percentiles=percentiles, slo_ms=slo)
    runs = []
    for i, rate in enumerate(rates):
        # A sweep's later rates get prompts of their own: resent prompts would be answered
        # by the server's prefix cache, and a rate's figures would depend on the rates
        # before it (a JSONL dataset's prompts are its file's whatever the seed).
        data_seed = args.seed + i if args.sweep_prompts == "fresh" else args.seed
        if data_seed != args.seed:
            convs = build_dataset(args, data_seed)
        records, duration = asyncio.run(run_once(args, model, convs, rate))
        summary = summarize(records, duration, percentiles, slo)
        print(format_summary(summary, f"{args.label or 'duet bench serve'} @ {rate:g} req/s"))
        failed = [r for r in records if not r.success]
        if failed:
            print(f"first error ({len(failed)} failed): {failed[0].error}")
            if len(failed) == len(records) and "HTTP 4" in failed[0].error and not args.no_continuous_usage:
                print("hint: a strict server may reject stream_options.continuous_usage_stats; "
                      "retry with --no-continuous-usage")
        runs.append({"request_rate": rate_json(rate), "dataset_seed": data_seed,
                     "burstiness": args.burstiness,
                     "max_concurrency": args.max_concurrency, "summary": summary,
                     "requests": [r.to_json() for r in records]})
    if len(runs) > 1:
        print(format_sweep(runs))
    return {"schema": SCHEMA, "label": args.label, "config": config, "runs": runs}


def main(args: argparse.Namespace) -> int:
    """Entry point of `duet bench serve`. Returns 0, or 1 when every request failed."""
    try:
        result = run_benchmark(args)
    except BenchError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    if args.output_json:
        print(f"wrote {write_json(args.output_json, result)}")
    all_failed = all(run["summary"]["completed"] == 0 for run in result["runs"])
    return 1 if all_failed else 0
