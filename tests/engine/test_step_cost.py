"""The engine's start-up step-cost measurement is cached per model, dtype, threads."""
from __future__ import annotations


def test_measurement_is_cached(tmp_path, monkeypatch) -> None:
    from duetserve.engine import step_cost

    class CountingRunner:
        def __init__(self) -> None:
            self.num_calls = 0

        def execute_model(self, so):
            self.num_calls += 1

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x")
    runner = CountingRunner()
    cost, cached = step_cost.measured_step_cost(runner, str(model), "float32", 2, 300, 16,
                                                4096)
    assert not cached and runner.num_calls > 0
    assert cost.per_token_ms > 0 and cost.fixed_ms >= 0
    calls = runner.num_calls
    again, cached = step_cost.measured_step_cost(runner, str(model), "float32", 2, 300,
                                                 16, 4096)
    assert cached and again == cost and runner.num_calls == calls
    _, cached = step_cost.measured_step_cost(runner, str(model), "float32", 4, 300, 16,
                                             4096)
    assert not cached                                   # threads are part of the key
