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


def test_alternated_configurations_take_turns_in_a_rotating_order(monkeypatch) -> None:
    """--alternate: each round runs every prompt length once on every configuration, the
    configuration that goes first rotating from round to round; each row gets its own
    runs (one per round and length) and its median."""
    bench = import_benchmark("prefill_paths")
    calls = []

    class FakeLLM:
        def __init__(self, budget):
            self.budget = budget

    monkeypatch.setattr(bench, "_build", lambda model, threads, b, *a, **k: (FakeLLM(b), 1.0))
    monkeypatch.setattr(bench, "_row", lambda llm, b, amx, load_s, runs: {"budget": b,
                                                                          "runs": runs})

    def tok_s(llm, n, seed):
        calls.append((llm.budget, n, seed))
        return float(len(calls))
    monkeypatch.setattr(bench, "_tok_s", tok_s)
    rows = bench.bench_alternated("m", 2, [None, 64, 128], [64, 512], 3, "auto", "auto")
    assert [c[0] for c in calls[:3]] == [None, 64, 128]          # round 0, 64 tokens
    assert [c[0] for c in calls[6:9]] == [64, 128, None]         # round 1 starts one later
    assert [c[0] for c in calls[12:15]] == [128, None, 64]
    assert len({c[2] for c in calls}) == len(calls)               # a fresh prompt each run
    assert [r["budget"] for r in rows] == [None, 64, 128]
    for r in rows:
        assert {k: len(v) for k, v in r["runs"].items()} == {"64": 3, "512": 3}
    assert rows[0]["runs"]["64"] == [1.0, 9.0, 14.0]


def test_alternated_report_pairs_each_round(capsys) -> None:
    """Rounds that took turns are also compared pair by pair: a round where the whole
    machine ran slower moves both sides of its pair, not the medians' ratio."""
    bench = import_benchmark("prefill_paths")
    rows = [dict(_row(None, {512: 150.0}), runs={"512": [200.0, 100.0, 150.0]}),
            dict(_row(256, {512: 160.0}), runs={"512": [190.0, 110.0, 160.0]})]
    ratios = bench.report(rows, [512], alternated=True)
    assert ratios["512"] == pytest.approx(150 / 160)
    assert ratios["512_paired"] == pytest.approx(150 / 160)     # median of 1.05, 0.91, 0.94
    assert "round by round 1.05, 0.91, 0.94" in capsys.readouterr().out
    assert "512_paired" not in bench.report(rows, [512])
