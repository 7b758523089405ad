"""Metric computation of `duet bench serve` on synthetic timestamp traces.
Expected values are computed by hand in the comments."""
from __future__ import annotations

import pytest

from duetserve.bench.bench_metrics import (
    RequestRecord,
    compute_latencies,
    format_summary,
    meets_slo,
    stats_ms,
    summarize,
)


def test_latencies_one_token_per_chunk() -> None:
    # chunks at 0.10, 0.15, 0.25, 0.30 s, one token each; stream ends at 0.40 s.
    # TTFT = 0.10; ITL = [0.05, 0.10, 0.05]; TPOT = (0.40 - 0.10) / (4 - 1) = 0.10
    ttft, tpot, itl = compute_latencies([0.10, 0.15, 0.25, 0.30], [1, 1, 1, 1], e2e=0.40, output_tokens=4)
    assert ttft == pytest.approx(0.10)
    assert tpot == pytest.approx(0.10)
    assert itl == pytest.approx([0.05, 0.10, 0.05])


def test_latencies_multi_token_chunks_split_gap() -> None:
    # chunk0 at 0.2 s with 2 tokens, chunk1 at 0.5 s with 3 tokens, chunk2 at 0.6 s with 1.
    # chunk0's second token gets no ITL entry (covered by TTFT).
    # chunk1: gap 0.3 split over 3 tokens -> 0.1, 0.1, 0.1; chunk2: gap 0.1 -> 0.1
    # ITL = [0.1] * 4 (6 tokens - 2 in the first chunk); TPOT = (0.6 - 0.2) / 5 = 0.08
    ttft, tpot, itl = compute_latencies([0.2, 0.5, 0.6], [2, 3, 1], e2e=0.6, output_tokens=6)
    assert ttft == pytest.approx(0.2)
    assert tpot == pytest.approx(0.08)
    assert itl == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_latencies_degenerate() -> None:
    assert compute_latencies([], [], e2e=1.0, output_tokens=0) == (None, None, [])
    # one token: TTFT only, TPOT undefined
    ttft, tpot, itl = compute_latencies([0.3], [1], e2e=0.35, output_tokens=1)
    assert (ttft, tpot, itl) == (pytest.approx(0.3), None, [])


def test_stats_percentiles_linear_interpolation() -> None:
    # values 1..10 ms (given in s). mean 5.5, median 5.5,
    # p90: rank 0.9 * 9 = 8.1 -> 9 + 0.1 * (10 - 9) = 9.1
    # p99: rank 0.99 * 9 = 8.91 -> 9.91; p50 = 5.5
    s = stats_ms([i / 1000 for i in range(1, 11)], [50, 90, 99])
    assert s["mean"] == pytest.approx(5.5)
    assert s["median"] == pytest.approx(5.5)
    assert s["p50"] == pytest.approx(5.5)
    assert s["p90"] == pytest.approx(9.1)
    assert s["p99"] == pytest.approx(9.91)
    assert stats_ms([], [99]) == {"mean": None, "median": None, "std": None, "p99": None}


def _rec(i: int, ttft: float, tpot: float | None, e2e: float, n_in: int, n_out: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(req_id=str(i), ttft=ttft, tpot=tpot, e2e=e2e, prompt_tokens=n_in,
                         output_tokens=n_out, success=ok, itl=[tpot] * (n_out - 1) if tpot else [])


def test_summary_throughput_and_goodput() -> None:
    recs = [
        _rec(0, ttft=0.1, tpot=0.02, e2e=0.5, n_in=100, n_out=21),   # meets all
        _rec(1, ttft=0.3, tpot=0.02, e2e=0.7, n_in=50, n_out=21),    # TTFT 300 ms > 200
        _rec(2, ttft=0.1, tpot=0.06, e2e=1.3, n_in=10, n_out=21),    # TPOT 60 ms > 50
        _rec(3, ttft=0.15, tpot=None, e2e=0.15, n_in=40, n_out=1),   # 1 token: TPOT n/a -> meets
        _rec(4, ttft=0.0, tpot=None, e2e=0.0, n_in=999, n_out=0, ok=False),  # failed
    ]
    s = summarize(recs, duration_s=2.0, percentiles=[50], slo_ms={"ttft": 200, "tpot": 50})
    # successful: 4; input 100+50+10+40 = 200; output 21*3+1 = 64; over 2 s
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_input_tokens"] == 200 and s["total_output_tokens"] == 64
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["input_throughput"] == pytest.approx(100.0)
    assert s["output_throughput"] == pytest.approx(32.0)
    assert s["total_token_throughput"] == pytest.approx(132.0)
    # good: requests 0 and 3 -> 2 / 2 s = 1 req/s
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    # TTFT over successes: 100, 300, 100, 150 ms -> mean 162.5, median 125
    assert s["ttft_ms"]["mean"] == pytest.approx(162.5)
    assert s["ttft_ms"]["median"] == pytest.approx(125.0)
    # TPOT over 3 defined values: 20, 20, 60 -> mean 33.33, p50 20
    assert s["tpot_ms"]["mean"] == pytest.approx(100 / 3)
    assert s["tpot_ms"]["p50"] == pytest.approx(20.0)
    # ITL: 20 entries each of 20, 20, 60 ms -> mean 33.33
    assert s["itl_ms"]["mean"] == pytest.approx(100 / 3)
    # E2E: 500, 700, 1300, 150 -> mean 662.5
    assert s["e2el_ms"]["mean"] == pytest.approx(662.5)
    table = format_summary(s)
    assert "Goodput" in table and "TTFT" in table and "p50" in table


def test_goodput_e2e_slo_and_no_slo() -> None:
    r = _rec(0, ttft=0.1, tpot=0.01, e2e=1.2, n_in=1, n_out=2)
    assert meets_slo(r, {"e2e": 1500}) and not meets_slo(r, {"e2e": 1000})
    assert meets_slo(r, {})  # no SLO: every success is good
    s = summarize([r], duration_s=1.0)
    assert s["goodput"] is None and s["good_requests"] is None


def test_server_ttft_next_to_the_clients() -> None:
    """Requests that carried the server's TTFT: its stats and the ratio of the p50s over
    those requests; none carried: no server entry."""
    recs = [RequestRecord(req_id=str(i), success=True, ttft=t, server_ttft=s, e2e=1.0,
                          output_tokens=2)
            for i, (t, s) in enumerate([(0.10, 0.09), (0.20, 0.19), (0.40, 0.38)])]
    summary = summarize(recs, 1.0)
    assert summary["server_ttft_ms"]["median"] == pytest.approx(190.0)
    assert summary["server_vs_client_ttft_p50"] == pytest.approx(0.19 / 0.20)
    assert "TTFT (server)" in format_summary(summary)
    plain = summarize([RequestRecord(req_id="a", success=True, ttft=0.1, e2e=1.0)], 1.0)
    assert "server_ttft_ms" not in plain and "TTFT (server)" not in format_summary(plain)
