"""The engine's start-up step-cost measurement is cached per model, dtype, threads."""
from __future__ import annotations


def test_measurement_is_cached(tmp_path, monkeypatch) -> None:
    from duetserve.engine import step_cost

    from duetserve.core.step_budget import StepCost

    class CountingRunner:
        def __init__(self) -> None:
            self.num_calls = 0

    def fake_measure(runner, vocab_size, block_size, max_tokens):   # no timing in tests
        runner.num_calls += 1
        return StepCost(20.0, 0.5)

    monkeypatch.setattr(step_cost, "measure", fake_measure)
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x")
    runner = CountingRunner()
    cost, cached = step_cost.measured_step_cost(runner, str(model), "float32", 2, 300, 16,
                                                4096)
    assert not cached and runner.num_calls == 1 and cost == StepCost(20.0, 0.5)
    calls = runner.num_calls
    again, cached = step_cost.measured_step_cost(runner, str(model), "float32", 2, 300,
                                                 16, 4096)
    assert cached and again == cost and runner.num_calls == calls
    _, cached = step_cost.measured_step_cost(runner, str(model), "float32", 4, 300, 16,
                                             4096)
    assert not cached                                   # threads are part of the key


def test_implausible_measurement_is_not_cached(tmp_path, monkeypatch) -> None:
    from duetserve.core.step_budget import StepCost
    from duetserve.engine import step_cost

    monkeypatch.setattr(step_cost, "measure", lambda *a: StepCost(1800.0, 1e-6))
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    _, cached = step_cost.measured_step_cost(object(), "m", "float32", 2, 300, 16, 4096)
    assert not cached and not (tmp_path / "step_cost.json").exists()
