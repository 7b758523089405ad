"""benchmarks/dashboard_overhead.py's report: paired ratios open / closed (no server)."""
from __future__ import annotations

import pytest
from bench_scripts import import_benchmark


def test_report_pairs_the_arms() -> None:
    bench = import_benchmark("dashboard_overhead")
    runs = []
    for pair, (open_tps, closed_tps) in enumerate([(99.0, 100.0), (102.0, 100.0)], start=1):
        runs.append({"pair": pair, "arm": "open", "output_tok_s": open_tps,
                     "ttft_p50_ms": 20.0, "tpot_p50_ms": 10.0})
        runs.append({"pair": pair, "arm": "closed", "output_tok_s": closed_tps,
                     "ttft_p50_ms": 10.0, "tpot_p50_ms": 10.0})
    out = bench.report(runs)
    assert out["output_tok_s"]["ratios"] == [0.99, 1.02]
    assert out["output_tok_s"]["mean"] == pytest.approx(1.005)
    assert out["ttft_p50_ms"]["min"] == 2.0 and out["tpot_p50_ms"]["max"] == 1.0
    assert out["closed_output_cv"] == 0.0
