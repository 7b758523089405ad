"""The engine's start-up step-cost measurement: cached per model, dtype and threads; a
noisy measurement is not cached; a cached fit that a quick step shows to be inflated (it
was measured on a busy machine) is measured again. No timing: the probes are faked."""
from __future__ import annotations

import pytest

from duetserve.core.step_budget import StepCost
from duetserve.engine import step_cost

GOOD = StepCost(20.0, 0.5, 1e-4, 10.0, 1.0)


class FakeProbes:
    """Stands in for measure() and quick_step(): counts calls, returns set values."""

    def __init__(self, monkeypatch, cost: StepCost = GOOD, now_ms: float = 28.0,
                 noisy: int = 0) -> None:
        self.cost, self.now_ms, self.noisy = cost, now_ms, noisy
        self.measures = self.quick = 0
        monkeypatch.setattr(step_cost, "measure", self.measure)
        monkeypatch.setattr(step_cost, "quick_step", self.quick_step)

    def measure(self, runner, vocab_size, block_size, max_tokens, lowbit_rows) -> StepCost:
        self.measures += 1
        if self.noisy:
            self.noisy -= 1
            raise step_cost.NoisyMeasurement("repeats disagree", self.cost)
        return self.cost

    def quick_step(self, runner, vocab_size, block_size, max_tokens, lowbit_rows) -> float:
        self.quick += 1
        return self.now_ms


@pytest.fixture
def model(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x")
    return str(path)


def cost_for(model: str, threads: int = 2) -> tuple[StepCost, bool]:
    return step_cost.measured_step_cost(object(), model, "float32", threads, 300, 16, 4096)


def test_measurement_is_cached(model, monkeypatch) -> None:
    probes = FakeProbes(monkeypatch)
    assert cost_for(model) == (GOOD, False) and probes.measures == 1
    assert cost_for(model) == (GOOD, True) and probes.measures == 1   # from the cache
    assert probes.quick == 1                                          # after one check
    _, cached = cost_for(model, threads=4)
    assert not cached and probes.measures == 2          # threads are part of the key
    _, cached = step_cost.measured_step_cost(object(), model, "float32", 2, 300, 16, 4096,
                                             lowbit_rows=16)
    assert not cached and probes.measures == 3          # so are the low-bit rows


def test_an_inflated_cached_fit_is_measured_again(model, monkeypatch) -> None:
    """A fit cached from a busy machine predicts 916 ms for a decode step of 16 streams
    that takes 28 ms now: it is re-measured and replaced. One that predicts a little
    faster than now (the machine is busy now) is kept."""
    FakeProbes(monkeypatch, cost=StepCost(990.0, 0.625, 0.0, 900.0, 1.0))
    cost_for(model)
    probes = FakeProbes(monkeypatch, now_ms=28.0)
    assert cost_for(model) == (GOOD, False) and probes.measures == 1
    assert cost_for(model) == (GOOD, True)                            # replaced
    busy_now = FakeProbes(monkeypatch, now_ms=200.0)                  # 26 ms predicted
    assert cost_for(model) == (GOOD, True) and busy_now.measures == 0


def test_noisy_or_implausible_measurements_are_not_cached(model, monkeypatch) -> None:
    noisy = FakeProbes(monkeypatch, noisy=2)             # noisy twice: used, not cached
    assert cost_for(model) == (GOOD, False) and noisy.measures == 2
    once = FakeProbes(monkeypatch, noisy=1)              # noisy once, then clean: cached
    assert cost_for(model) == (GOOD, False) and once.measures == 2
    assert cost_for(model) == (GOOD, True)


def test_flat_fits_are_not_cached(model, monkeypatch, tmp_path) -> None:
    FakeProbes(monkeypatch, cost=StepCost(1800.0, 1e-6))
    _, cached = cost_for(model)
    assert not cached and not (tmp_path / "step_cost.json").exists()


def test_old_or_malformed_entries_are_measured_again(model, monkeypatch, tmp_path) -> None:
    """Entries without the decode line (the previous model) or not parseable are
    ignored, and the file is rewritten whole."""
    key = step_cost.cache_key(model, "float32", 2)
    (tmp_path / "step_cost.json").write_text(
        '{"%s": {"fixed_ms": 31.1, "per_token_ms": 0.83}, "other": "junk"}' % key)
    probes = FakeProbes(monkeypatch)
    assert cost_for(model) == (GOOD, False) and probes.measures == 1
    (tmp_path / "step_cost.json").write_text('[1, 2]')
    assert cost_for(model) == (GOOD, False) and probes.measures == 2
    assert cost_for(model) == (GOOD, True)


@pytest.mark.parametrize("lowbit_rows", [0, 8, 16, 32])
def test_an_ordinary_limit_is_measured(lowbit_rows) -> None:
    assert step_cost.probe_tokens(2047, lowbit_rows) <= 2047


def test_a_cache_too_small_for_the_probes_is_not_measured(model, monkeypatch) -> None:
    """A 16-token KV cache (tests' toy engines) cannot hold a probe: no measurement, no
    cache entry; the engine then schedules with the fixed fallback budget."""
    probes = FakeProbes(monkeypatch)
    assert step_cost.probe_tokens(16, 0) > 16
    assert step_cost.measured_step_cost(object(), model, "float32", 2, 300, 4, 16) == (
        None, False)
    assert probes.measures == probes.quick == 0
