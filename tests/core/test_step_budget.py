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


def test_step_budget_follows_the_running_decodes() -> None:
    """No decode running: the idle budget. Up to DECODE_REF_TOKENS decodes: the default
    target's budget. More decodes: a larger budget whose step still fits STEP_FACTOR x
    the decode-only step of those decodes. A fixed --max-step-ms target stays fixed."""
    from duetserve.core.step_budget import IDLE_BUDGET, StepBudget
    cost = StepCost(fixed_ms=20.0, per_token_ms=0.25)
    policy = StepBudget(cost)
    assert policy.for_step(0) == IDLE_BUDGET
    base = token_budget(cost, default_max_step_ms(cost))
    assert policy.for_step(1) == policy.for_step(DECODE_REF_TOKENS) == base
    # 1.5 x (20 + 0.25 x 64) = 54 ms -> (54 - 20) / 0.25 = 136 -> 128 tokens
    assert policy.for_step(64) == 128 > base
    for d in (1, 16, 64, 128):
        assert cost.step_ms(policy.for_step(d)) <= STEP_FACTOR * cost.step_ms(
            max(d, DECODE_REF_TOKENS)) + 1e-9
    fixed = StepBudget(cost, max_step_ms=100.0)
    assert fixed.for_step(1) == fixed.for_step(64) == 320
    assert fixed.for_step(0) == IDLE_BUDGET
