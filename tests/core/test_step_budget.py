"""The step token budget from a target step time (pure arithmetic)."""
from __future__ import annotations

import math

import pytest

from duetserve.core.step_budget import (CHUNK_EFFICIENCY, IDLE_BUDGET, MAX_BUDGET,
                                        MAX_GAP_FACTOR, MIN_CHUNK, STEP_FACTOR, StepBudget,
                                        StepCost,
                                        default_max_step_ms, derive_step_budget,
                                        efficient_chunk, token_budget)

# Shaped like the default model on a 2-core CPU: decode-only steps much cheaper than
# steps with prefill work, and attention over a cached context that matters.
MEASURED = StepCost(fixed_ms=20.0, per_token_ms=1.0, per_pair_ms=0.5e-3,
                    decode_fixed_ms=12.0, decode_per_seq_ms=2.0)
# ... and with the low-bit cliff: up to 16 rows the low-bit kernels, above dense GEMMs
# (the default model measured 8.2 + 1.07/token up to 16 rows, 22.6 + 0.72/token above)
CLIFF = StepCost(fixed_ms=40.0, per_token_ms=1.0, per_pair_ms=1e-3, decode_fixed_ms=4.0,
                 decode_per_seq_ms=1.5, lowbit_rows=16, lowbit_fixed_ms=8.0,
                 lowbit_per_token_ms=1.0)


def test_fit_is_the_line_through_two_steps() -> None:
    cost = StepCost.fit(16, 30.0, 256, 150.0)
    assert cost.per_token_ms == pytest.approx(0.5)
    assert cost.fixed_ms == pytest.approx(22.0)
    assert cost.step_ms(100) == pytest.approx(72.0)
    noisy = StepCost.fit(16, 50.0, 256, 40.0)      # noise cannot give a negative slope
    assert noisy.per_token_ms > 0 and noisy.fixed_ms >= 0


def test_step_time_model() -> None:
    # a step with prefill work: fixed + per token + per cached-context pair
    assert MEASURED.step_ms(24, 16 * 1000) == pytest.approx(20 + 24 + 8)
    # decode-only steps follow their own line; without one, the general line
    assert MEASURED.decode_ms(8) == pytest.approx(28.0)
    assert StepCost(20.0, 1.0).decode_ms(8) == pytest.approx(28.0)
    assert StepCost.from_json(MEASURED.to_json()) == MEASURED
    assert StepCost.from_json(CLIFF.to_json()) == CLIFF
    # the cliff: 16 rows on the low-bit piece, 17 on the dense line
    assert CLIFF.step_ms(16) == pytest.approx(24.0)
    assert CLIFF.step_ms(17) == pytest.approx(57.0)
    assert CLIFF.per_token_at(16) == CLIFF.per_token_at(17) == 1.0
    # decode-only steps above the low-bit rows run the dense modules too
    assert CLIFF.decode_ms(16) == pytest.approx(28.0)
    assert CLIFF.decode_ms(32) == pytest.approx(72.0)
    assert StepCost.from_json({"fixed_ms": 1, "per_token_ms": 2}) == StepCost(1.0, 2.0)
    with pytest.raises(KeyError):
        StepCost.from_json({"fixed_ms": 1})
    with pytest.raises(TypeError):
        StepCost.from_json([1, 2])


def test_budget_fills_the_target_step_time() -> None:
    cost = StepCost(fixed_ms=20.0, per_token_ms=0.25)
    # (100 - 20) / 0.25 = 320 tokens, a multiple of 16
    assert token_budget(cost, 100.0) == 320
    # rounded down to a multiple of 16: (90 - 20) / 0.25 = 280 -> 272
    assert token_budget(cost, 90.0) == 272
    assert token_budget(cost, 10.0) == MIN_CHUNK             # target below the overhead
    assert token_budget(cost, 1e9) == MAX_BUDGET
    assert token_budget(cost, 10.0, lo=8) == 8
    assert token_budget(cost, 20.0 + 0.25 * 50) == 50          # small budgets: not rounded


def test_budget_sees_the_low_bit_cliff() -> None:
    """A target the dense line cannot meet above the low-bit rows is met on the low-bit
    piece (a 24-row step costs 64 ms, a 16-row one 24 ms); a target the dense line meets
    above them gets the larger dense budget."""
    assert token_budget(CLIFF, 30.0) == 16          # dense: (30 - 40) < 0; low-bit: 22 -> 16
    assert token_budget(CLIFF, 20.0) == 12          # low-bit: (20 - 8) / 1
    assert token_budget(CLIFF, 56.0) == 16          # dense would give 16 rows: not above R
    assert token_budget(CLIFF, 100.0) == 60         # dense: 60 rows (> 16)
    assert token_budget(CLIFF, 200.0) == 160        # rounded down to 16s
    for target in (10.0, 20.0, 30.0, 56.0, 57.0, 100.0, 200.0):
        b = token_budget(CLIFF, target, lo=1)
        assert CLIFF.step_ms(b) <= target or b == 1
        assert all(CLIFF.step_ms(t) > target for t in range(b + 1, b + 17)) or b >= 64


def test_a_step_with_decodes_fits_the_factor_of_their_decode_only_step() -> None:
    """The acceptance's arithmetic: with D streams decoding, a step that also carries a
    fresh prompt's chunk is modelled at most STEP_FACTOR x the decode-only step of those
    D streams (their median gap), unless even D + the floor's chunk cannot fit (then the
    floor: the prompt still progresses, in a chunk worth its step's overhead)."""
    for cost in (MEASURED, CLIFF):
        policy = StepBudget(cost)
        assert policy.for_step(0) == IDLE_BUDGET
        for d in (1, 4, 8, 16, 64, 256):
            budget = policy.for_step(d)
            target = STEP_FACTOR * cost.decode_ms(d)
            assert policy.target_ms(d) == pytest.approx(target)
            floor = d + max(MIN_CHUNK, policy.efficient_chunk(d))
            assert budget >= floor
            if budget > floor:
                assert cost.step_ms(budget) <= target + 1e-9
            else:   # the floor: a step of one more token would miss the target
                assert cost.step_ms(floor + 1) > target
    # 8 decodes: 1.5 x (12 + 16) = 42 ms -> (42 - 20) / 1 = 22 tokens
    assert StepBudget(MEASURED).for_step(8) == 22
    # with the cliff: 1.5 x (4 + 12) = 24 ms -> 16 rows on the low-bit piece: 8 for a
    # chunk (a 24-row step would cost 64 ms)
    assert StepBudget(CLIFF).for_step(8) == 16
    # 64 decodes: 1.5 x (12 + 128) = 210 ms -> 190 -> 176 tokens
    assert StepBudget(MEASURED).for_step(64) == 176
    fixed = StepBudget(StepCost(20.0, 0.25), max_step_ms=100.0)
    assert fixed.for_step(1) == fixed.for_step(64) == 320
    assert fixed.for_step(0) == IDLE_BUDGET


def test_a_chunk_beside_decodes_is_worth_its_step_overhead() -> None:
    """A step that carries prompt tokens beside D decodes costs an overhead F over their
    decode-only step; the floor chunk c is the least whose own cost takes
    CHUNK_EFFICIENCY of the time it adds (slope x c >= E x (F + slope x c)), so prefill
    beside a few streams is not done a token or two at a time at F a step."""
    e = CHUNK_EFFICIENCY
    # MEASURED beside one decode: F = 20 + 1 - 14 = 7 ms -> c >= e x 7 / ((1 - e) x 1)
    assert efficient_chunk(MEASURED, 1) == math.ceil(e * 7.0 / (1 - e) - 1e-9)
    assert StepBudget(MEASURED).for_step(1) == 1 + StepBudget(MEASURED).efficient_chunk(1)
    for cost in (MEASURED, CLIFF):
        for d in (1, 2, 4, 8, 12):
            c = efficient_chunk(cost, d)
            def worth(n: int) -> bool:     # the chunk's own cost >= e x what it adds
                added = cost.step_ms(d + n) - cost.decode_ms(d)
                return cost.per_token_at(d + n) * n >= e * added - 1e-9
            if cost.lowbit_rows and d + c == cost.lowbit_rows:   # capped at the rows
                assert c == cost.lowbit_rows - d
                continue
            assert worth(c)
            assert c == 1 or not worth(c - 1)
    # the cap: a chunk past the low-bit rows would jump onto the dense line's fixed cost
    # (one decode on CLIFF: F = 8 + 1 - 5.5 = 3.5 ms, so 0.9 wants 32 tokens: 15 fit)
    assert efficient_chunk(CLIFF, 1, efficiency=0.9) == 16 - 1
    assert efficient_chunk(CLIFF, 1, efficiency=0.8) == 14      # 0.8 x 3.5 / 0.2
    # a step with prompt tokens no dearer than the decodes' own: no floor beyond 1
    cheap = StepCost(fixed_ms=1.0, per_token_ms=1.0, decode_fixed_ms=2.0,
                     decode_per_seq_ms=1.0)
    assert efficient_chunk(cheap, 4) == 1
    # ... but the floor never models a step above MAX_GAP_FACTOR x the decode-only one
    # (MEASURED beside one decode: 2 x 14 = 28 ms holds 8 rows: 7 of the 28 tokens wanted)
    assert StepBudget(MEASURED, efficiency=0.8).efficient_chunk(1) == 7
    for cost in (MEASURED, CLIFF):
        policy = StepBudget(cost, efficiency=0.95)
        for d in (1, 2, 4, 8, 12, 64):
            c = policy.efficient_chunk(d)
            assert c <= efficient_chunk(cost, d, 0.95)
            assert c == 0 or cost.step_ms(d + c) <= MAX_GAP_FACTOR * cost.decode_ms(d) + 1e-9
    assert StepBudget(MEASURED, efficiency=0.0).for_step(1) == 1 + MIN_CHUNK
    assert StepBudget(MEASURED, efficiency=0.0).efficient_chunk(1) == 0
    # never past the idle budget
    assert efficient_chunk(MEASURED, 1, efficiency=0.9999, hi=64) == 64


def test_a_chunk_deep_in_a_context_is_charged_for_its_attention() -> None:
    """A chunk after s cached tokens costs per_pair_ms x s per token on top of
    per_token_ms: charged (1 + s x per_pair / per_token) budget tokens per token, so the
    modelled step of the chunk stays within what its budget tokens were worth."""
    policy = StepBudget(MEASURED)
    assert policy.chunk_cost(16, 0, 64) == 16
    assert policy.chunk_cost(16, 1000, 64) == 24                  # 16 x 1.5
    assert policy.chunk_cost(10, 3, 64) == 11                     # rounded up
    for start in (0, 100, 1000, 1900, 4000):
        for left in (1, 16, 40, 100, 1000):
            c = policy.max_chunk(left, start, 5000, 1000)
            assert 1 <= c <= left
            if c > MIN_CHUNK:            # above the floor: it fits what was left
                assert policy.chunk_cost(c, start, 1000) <= left
                # worth: c rows plus c x start pairs cost no more than `left` rows
                assert (MEASURED.per_token_ms * c + MEASURED.per_pair_ms * c * start
                        <= MEASURED.per_token_ms * left + 1e-9)
                assert policy.chunk_cost(c + 1, start, 1000) > left
            else:
                assert c == min(MIN_CHUNK, left)
    assert policy.max_chunk(100, 0, 30, 100) == 30                # never more than wanted
    assert policy.max_chunk(100, 2000, 5000, 100) == 50           # 100 / (1 + 2000 x 0.5e-3)
    # the slope of the budget's piece converts pairs to tokens
    cliff = StepBudget(CLIFF)
    assert cliff.chunk_cost(4, 1000, 16) == 8                     # 4 x (1 + 1000 x 1e-3 / 1)


def test_derived_budget_and_fallback() -> None:
    budget, policy = derive_step_budget(MEASURED, None, 256)
    assert policy == StepBudget(MEASURED) and budget == IDLE_BUDGET
    budget, policy = derive_step_budget(StepCost(1800.0, 1e-6), None, 256)   # flat: noise
    assert policy is None and budget == 512
    assert default_max_step_ms(MEASURED, 8) == pytest.approx(42.0)


def test_a_burst_of_prompts_gets_a_token_each_per_step() -> None:
    """However small the target, each request with prompt tokens to compute gets budget
    for at least min_chunk tokens a step, as each decode gets its token: a burst of new
    requests is admitted at the streams' pace, not one token a step for all of them."""
    policy = StepBudget(CLIFF)
    assert policy.for_step(8, 1) == policy.for_step(8) == 16
    assert policy.for_step(8, 40) == 8 + 40
    assert policy.for_step(1, 5000) == 1 + 5000 > IDLE_BUDGET    # hi follows lo
    assert policy.for_step(0, 40) == IDLE_BUDGET
