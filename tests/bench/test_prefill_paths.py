"""benchmarks/prefill_paths.py's report and prompts (no model: the timing runs are the
lead's, on a quiet machine)."""
from __future__ import annotations

import pytest
from bench_scripts import import_benchmark


def _row(budget, tok_s: dict) -> dict:
    return {"budget": budget, "tok_s": {str(k): v for k, v in tok_s.items()},
            "few_row_limit": "unbounded", "max_num_batched_tokens": budget or 2048,
            "kernels": "weights ..."}


def test_report_compares_the_default_with_the_best_fixed_budget(capsys) -> None:
    bench = import_benchmark("prefill_paths")
    rows = [_row(None, {64: 150.0, 512: 60.0}), _row(64, {64: 140.0, 512: 170.0}),
            _row(128, {64: 100.0, 512: 50.0})]
    ratios = bench.report(rows, [64, 512])
    assert ratios["64"] == pytest.approx(150 / 140)
    assert ratios["512"] == pytest.approx(60 / 170)        # the issue-67 case: < 1
    out = capsys.readouterr().out
    assert "max_num_batched_tokens=64" in out and "default" in out


def test_every_run_gets_its_own_prompt() -> None:
    bench = import_benchmark("prefill_paths")
    a, b = bench._prompt(64, 1, 32000), bench._prompt(64, 2, 32000)
    assert len(a) == 64 and all(100 <= t < 32000 for t in a + b)
    assert a[:16] != b[:16]                 # no shared first block for the prefix cache
