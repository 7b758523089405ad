"""`duet plan` search logic and the `duet simulate` / `duet plan` command lines."""
from __future__ import annotations

import json

import pytest

from duetserve.entrypoints.cli import main as cli_main
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.plan import SLO, Candidate, Evaluation, Planner, candidates


class StepPlanner(Planner):
    """A planner whose attainment is a known step function of the rate."""

    def __init__(self, threshold: float) -> None:
        self.threshold, self.slo, self.rel_tol, self.progress = threshold, SLO(1, 1), 0.01, None
        self.calls: list[float] = []

    def evaluate(self, cand: Candidate, rate: float) -> Evaluation:
        self.calls.append(rate)
        return Evaluation(rate, 1.0 if rate <= self.threshold else 0.5, None, None)


@pytest.mark.parametrize("threshold", [0.013, 3.7, 50.0])
def test_max_rate_brackets_then_bisects(threshold: float) -> None:
    planner = StepPlanner(threshold)
    res = planner.max_rate(Candidate(ClusterSpec(2), 512))
    assert threshold / 1.01 <= res.max_rate <= threshold
    assert res.goodput_per_gpu == pytest.approx(res.max_rate / 2)
    assert len(planner.calls) < 25


def test_max_rate_is_zero_when_nothing_holds() -> None:
    res = StepPlanner(0.0).max_rate(Candidate(ClusterSpec(1), 512))
    assert res.max_rate == 0.0


def test_candidates_enumerate_colocated_and_every_split() -> None:
    cands = candidates(3, [1, 2, 4], [256, 1024], 8192, ClusterSpec(1))
    names = [c.name for c in cands]
    assert names == ["1x chunk 256", "1x chunk 1024", "2x chunk 256", "2x chunk 1024",
                     "1P1D", "1P2D", "2P1D"]
    assert [c.cluster.num_gpus for c in cands] == [1, 1, 2, 2, 2, 3, 3]


def test_simulate_cli_gpu_profile_json(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    rc = cli_main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3-8b",
                   "--num-prompts", "12", "--request-rate", "4", "--input-len", "256:512",
                   "--output-len", "8:16", "--pd", "1P1D", "--link", "ib-ndr",
                   "--slo", "ttft=500", "--output-json", str(out),
                   "--write-profile", str(tmp_path / "gpu.json")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "duet-bench-serve/1" and doc["config"]["simulated"]
    (run,) = doc["runs"]
    assert run["summary"]["completed"] == 12
    assert run["sim"]["kv_transfer"]["bytes"] > 0
    assert [i["role"] for i in run["sim"]["instances"]] == ["prefill", "decode"]
    assert "TTFT" in capsys.readouterr().out
    # the written profile reproduces the same run
    rc = cli_main(["simulate", "--profile", str(tmp_path / "gpu.json"), "--num-prompts", "12",
                   "--request-rate", "4", "--input-len", "256:512", "--output-len", "8:16",
                   "--pd", "1P1D", "--link", "ib-ndr", "--output-json", str(out)])
    assert rc == 0
    again = json.loads(out.read_text())["runs"][0]["summary"]
    assert again["ttft_ms"] == run["summary"]["ttft_ms"]


def test_simulate_cli_user_errors(tmp_path, capsys) -> None:
    assert cli_main(["simulate", "--profile", str(tmp_path / "none.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    assert cli_main(["simulate", "--hardware", "h100-sxm", "--pd", "2X"]) == 2
    assert cli_main(["simulate", "--hardware", "tpu"]) == 2
    assert "unknown hardware" in capsys.readouterr().err
    # --max-step-ms needs the engine's step time, which a GPU profile does not carry
    assert cli_main(["simulate", "--hardware", "h100-sxm", "--max-step-ms", "50"]) == 2
    assert "max_step_ms needs" in capsys.readouterr().err


def test_plan_cli_prints_both_modes(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", "--model", "llama-3-8b", "--hardware", "h100-sxm",
                   "--workload", "prefill-heavy", "--num-prompts", "24", "--max-gpus", "2",
                   "--colocated-instances", "1", "--chunks", "2048", "--rel-tol", "0.2",
                   "--no-progress", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "best colocated: 1x chunk 2048" in text and "best disaggregated: 1P1D" in text
    doc = json.loads(out.read_text())
    assert {r["mode"] for r in doc["results"]} == {"colocated", "disaggregated"}
    assert all(r["max_rate"] > 0 for r in doc["results"])
