"""The step token budget from a target step time (pure arithmetic)."""
from __future__ import annotations

import pytest

from duetserve.core.step_budget import (DECODE_REF_TOKENS, MAX_BUDGET, MIN_BUDGET,
                                        STEP_FACTOR, StepCost, default_max_step_ms,
                                        token_budget)


def test_fit_is_the_line_through_two_steps() -> None:
    cost = StepCost.fit(16, 30.0, 256, 150.0)
    assert cost.per_token_ms == pytest.approx(0.5)
    assert cost.fixed_ms == pytest.approx(22.0)
    assert cost.step_ms(100) == pytest.approx(72.0)
    noisy = StepCost.fit(16, 50.0, 256, 40.0)      # noise cannot give a negative slope
    assert noisy.per_token_ms > 0 and noisy.fixed_ms >= 0


def test_budget_fills_the_target_step_time() -> None:
    cost = StepCost(fixed_ms=20.0, per_token_ms=0.25)
    # (100 - 20) / 0.25 = 320 tokens, a multiple of 16
    assert token_budget(cost, 100.0) == 320
    # rounded down to a multiple of 16: (90 - 20) / 0.25 = 280 -> 272
    assert token_budget(cost, 90.0) == 272
    assert token_budget(cost, 10.0) == MIN_BUDGET            # target below the overhead
    assert token_budget(cost, 1e9) == MAX_BUDGET
    assert token_budget(cost, 10.0, lo=8) == 8


def test_default_target_bounds_a_chunked_step_to_the_factor_of_a_decode_step() -> None:
    """With the default target, a step carrying a full budget of prefill tokens takes
    at most STEP_FACTOR x a decode step of DECODE_REF_TOKENS streams (the gap ratio the
    issue's acceptance measures in the benchmark)."""
    for cost in (StepCost(20.0, 0.25), StepCost(200.0, 7.0), StepCost(5.0, 0.01)):
        target = default_max_step_ms(cost)
        decode_step = cost.step_ms(DECODE_REF_TOKENS)
        assert target == pytest.approx(STEP_FACTOR * decode_step)
        budget = token_budget(cost, target, lo=1)
        assert cost.step_ms(budget) <= target + 1e-9
        assert cost.step_ms(budget + 16) > target or budget == MAX_BUDGET
