"""Metrics of `duet bench serve`: per-request latencies from streamed timestamps, and the
run summary (latency statistics, throughput, goodput).

Pure computation: no I/O, no engine imports. All times inside a record are seconds
measured from the moment its request was sent; the summary reports milliseconds.

One streamed request (chunk i carries k_i >= 1 real tokens)::

    send      chunk 0 (k0)    chunk 1 (k1=1)   chunk 2 (k2=2)        end of stream
    |---------|---------------|----------------|---------------------|
    0        ttft            t1               t2                    e2e
              <-- gap 1 ----> <------- gap 2 ------->

    ITL entries:  gap 1 (once), gap 2 / 2 (twice)   -> one entry per token after chunk 0
    TPOT       :  (e2e - ttft) / (output_tokens - 1)

NOTE (ITL convention): a chunk that carries k tokens contributes k ITL entries of
gap / k each, so ITL is per *token*, not per chunk, and speculative or batched
detokenized chunks do not look like one long inter-token gap. Tokens that arrive in the
first chunk produce no ITL entry (they are covered by TTFT). k comes from the growth of
`usage.completion_tokens` when the server streams usage on every chunk, else each chunk
with non-empty text counts as one token.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Valid once the stream has ended (or failed).

    token_source says where the token counts come from:
      "usage":       the server streamed usage on every chunk; totals and per-chunk
                     token counts (hence ITL) are the server's.
      "usage_final": totals from the final usage chunk; each chunk with text counted as
                     one token for ITL.
      "chunks":      no usage at all; output_tokens = chunks with text, prompt_tokens =
                     the dataset's approximate length.
    """

    req_id: str
    send_time: float = 0.0  # seconds from benchmark start to sending this request
    expected_output_len: int = 0  # max_tokens asked for
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    server_ttft: float | None = None  # the server's own TTFT (serve.server_ttft), if sent
    tpot: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""
    token_source: str = "usage"
    conversation_id: int = 0
    turn: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (floats kept in seconds)."""
        return asdict(self)


def compute_latencies(
    chunk_times: Sequence[float], chunk_tokens: Sequence[int], e2e: float, output_tokens: int
) -> tuple[float | None, float | None, list[float]]:
    """Return (ttft, tpot, itl) in seconds from the token-carrying chunks of one stream.

    chunk_times[i]: arrival of chunk i (seconds after send); chunk_tokens[i] >= 1 its
    tokens. TTFT is the first chunk; TPOT is None when fewer than two tokens came back.
    """
    if not chunk_times:
        return None, None, []
    ttft = chunk_times[0]
    itl: list[float] = []
    for i in range(1, len(chunk_times)):
        k = max(1, int(chunk_tokens[i]))
        itl.extend([(chunk_times[i] - chunk_times[i - 1]) / k] * k)
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return ttft, tpot, itl


def percentile_key(p: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


def stats_ms(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean / median / std / pXX of values given in seconds, returned in milliseconds.

    Percentiles use linear interpolation between closest ranks (numpy's default).
    All entries are None when there are no values.
    """
    keys = ["mean", "median", "std"] + [percentile_key(p) for p in percentiles]
    if len(values_s) == 0:
        return {k: None for k in keys}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
    }
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(ms, p))
    return out


def meets_slo(rec: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """True when a successful request meets every given SLO (milliseconds).

    A request with no TPOT (fewer than two output tokens) cannot violate a TPOT SLO.
    """
    if not rec.success:
        return False
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "e2e": rec.e2e}
    for key, limit in slo_ms.items():
        v = values[key]
        if v is None:
            if key == "tpot":
                continue
            return False
        if v * 1000.0 > limit:
            return False
    return True


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (90, 99),
    slo_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Aggregate a run. Throughputs divide by the wall-clock `duration_s` of the run;
    token totals count successful requests only. `goodput` (req/s meeting every SLO)
    is None when no SLO was given."""
    ok = [r for r in records if r.success]
    dur = max(duration_s, 1e-9)
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": n_in / dur,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
        "slo_ms": dict(slo_ms or {}),
        "good_requests": None,
        "goodput": None,
    }
    if slo_ms:
        good = sum(meets_slo(r, slo_ms) for r in records)
        summary["good_requests"] = good
        summary["goodput"] = good / dur
    summary["ttft_ms"] = stats_ms([r.ttft for r in ok if r.ttft is not None], percentiles)
    server = [r.server_ttft for r in ok if r.server_ttft is not None]
    if server:   # the server reported its TTFT: both p50s, over the same requests
        both = [r for r in ok if r.server_ttft is not None and r.ttft is not None]
        summary["server_ttft_ms"] = stats_ms(server, percentiles)
        client_p50 = float(np.median([r.ttft for r in both])) if both else 0.0
        summary["server_vs_client_ttft_p50"] = (
            float(np.median([r.server_ttft for r in both])) / client_p50 if client_p50 else None)
    summary["tpot_ms"] = stats_ms([r.tpot for r in ok if r.tpot is not None], percentiles)
    summary["itl_ms"] = stats_ms([x for r in ok for x in r.itl], percentiles)
    summary["e2el_ms"] = stats_ms([r.e2e for r in ok if r.e2e is not None], percentiles)
    return summary


def _fmt(v: float | int | None, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}f}"


def format_summary(summary: dict[str, Any], title: str = "duet bench serve") -> str:
    """A plain-text table of one run's summary, for stdout."""
    width = 64
    lines = [f" {title} ".center(width, "=")]
    rows = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Input token throughput (tok/s)", summary["input_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    if summary.get("goodput") is not None:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in summary["slo_ms"].items())
        rows.append((f"Goodput (req/s) [{slo}]", summary["goodput"]))
        rows.append(("Requests meeting SLO", summary["good_requests"]))
    for name, value in rows:
        lines.append(f"{name:<46}{_fmt(value):>18}")
    keys = [k for k in summary["ttft_ms"] if k != "std"]
    col = 10
    lines.append("-" * width)
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{k:>{col}}" for k in keys))
    for name, key in (("TTFT", "ttft_ms"), ("TTFT (server)", "server_ttft_ms"),
                      ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms")):
        stats = summary.get(key)
        if stats is not None:
            lines.append(f"{name:<14}" + "".join(f"{_fmt(stats[k]):>{col}}" for k in keys))
    if summary.get("server_vs_client_ttft_p50") is not None:
        lines.append(f"{'TTFT p50 server / client':<46}"
                     f"{_fmt(summary['server_vs_client_ttft_p50'], 3):>18}")
    lines.append("=" * width)
    return "\n".join(lines)


@dataclass(slots=True)
class TurnInFlight:
    """One request of a workload turn while it runs (replayed on an engine or simulated):
    its record and the times its tokens arrived. Mutated as tokens arrive."""

    conv: int
    turn: int
    prompt: list[int]
    record: RequestRecord
    send: float
    chunk_times: list[float] = field(default_factory=list)
    num_tokens: int = 0


def write_json(path: str, doc: dict) -> Path:
    """Writes `doc` (indented JSON) to `path`, creating its folder; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    return out
