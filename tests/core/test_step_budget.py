"""The step token budget from a target step time, priced by the step-time model."""
from __future__ import annotations

import math

import pytest

from duetserve.core.step_budget import (CHUNK_EFFICIENCY, IDLE_BUDGET, IDLE_PROBE,
                                        IDLE_PROMPT, MAX_GAP_FACTOR, MIN_CHUNK,
                                        STEP_FACTOR, StepBudget, default_max_step_ms,
                                        derive_step_budget, idle_chunk, prompt_seconds)
from duetserve.config import UNBOUNDED_ROWS
from duetserve.core.step_time import Layout, StepTime

# Shaped like the default model on a 2-core CPU: decode-only steps much cheaper than steps
# with prefill work (the native decode stack against the per-layer modules), attention
# over a cached context that matters. No chunks as decode rows, to keep the sums simple.
MEASURED = StepTime.of(Layout(few_rows=64), few_step=0.012, few_row=0.002,
                       mixed_step=0.020, mixed_row=0.001, many_step=0.020, many_row=0.001,
                       chunk_pair=0.5e-6)
# ... and with the cliff: up to 16 rows the few-row kernels, above them dense GEMMs
CLIFF = StepTime.of(Layout(few_rows=16), few_step=0.004, few_row=0.0015,
                    mixed_step=0.008, mixed_row=0.001, many_step=0.040, many_row=0.001,
                    chunk_pair=1e-6)


def test_prices_decodes_and_a_chunk_beside_them() -> None:
    b = StepBudget(MEASURED)
    assert b.decode_ms(8) == pytest.approx(12 + 16)
    assert b.step_ms(8, 16) == pytest.approx(20 + 24)               # the modules' line
    assert b.step_ms(8, 16, start=1000) == pytest.approx(44 + 0.5e-3 * (16000 + 136))
    c = StepBudget(CLIFF)
    assert c.step_ms(8, 8) == pytest.approx(8 + 16)                 # few rows: 16
    assert c.step_ms(8, 9) == pytest.approx(40 + 17 + 9 * 10 * 1e-3 / 2 * 0)  # the cliff
    assert c.decode_ms(32) == pytest.approx(40 + 32)               # dense above 16 rows


def test_budget_is_the_most_rows_that_fit_the_target() -> None:
    for model in (MEASURED, CLIFF):
        b = StepBudget(model)
        for d in (1, 4, 8):
            for target in (10.0, 20.0, 30.0, 56.0, 57.0, 100.0, 200.0):
                rows = b.token_budget(d, target)
                if rows > d:
                    assert b.step_ms(d, rows - d) <= target + 1e-9
                # no larger step fits (budgets from 64 rows up are rounded to 16s)
                for more in range(rows + 1, rows + 17):
                    assert b.step_ms(d, more - d) > target or rows >= 64 - 16
    # the cliff: a target the dense GEMMs cannot meet above 16 rows is met below them
    assert StepBudget(CLIFF).token_budget(8, 30.0) == 16
    assert StepBudget(CLIFF).token_budget(8, 100.0) == 60          # 40 + 60 rows
    assert StepBudget(CLIFF).token_budget(8, 200.0) == 160         # rounded down to 16s


def test_a_step_with_decodes_fits_the_factor_of_their_decode_only_step() -> None:
    """With D streams decoding, a step that also carries a fresh prompt's chunk is priced
    at most STEP_FACTOR x the decode-only step of those D streams, unless even D + the
    floor's chunk cannot fit (then the floor: the prompt still progresses)."""
    for model in (MEASURED, CLIFF):
        policy = StepBudget(model)
        assert policy.for_step(0) == IDLE_PROBE     # per-step costs: the biggest chunk
        for d in (1, 4, 8, 16, 64, 256):
            budget = policy.for_step(d)
            target = STEP_FACTOR * policy.decode_ms(d)
            assert policy.target_ms(d) == pytest.approx(target)
            floor = d + max(MIN_CHUNK, policy.efficient_chunk(d))
            assert budget >= floor
            if budget > floor:
                assert policy.step_ms(d, budget - d) <= target + 1e-9
            else:
                assert policy.step_ms(d, floor + 1 - d) > target
    assert StepBudget(MEASURED).for_step(8) == 22      # 1.5 x 28 = 42 ms = 20 + 22 rows
    assert StepBudget(CLIFF).for_step(8) == 16         # 1.5 x 16 = 24 ms: the few rows
    fixed = StepBudget(StepTime.of(Layout(), many_step=0.020, many_row=0.00025),
                       max_step_ms=100.0)
    assert fixed.for_step(1) == fixed.for_step(64) == 320
    assert fixed.for_step(0) == IDLE_PROBE
    assert default_max_step_ms(MEASURED, 8) == pytest.approx(42.0)


def test_a_chunk_beside_decodes_is_worth_its_step_overhead() -> None:
    """The floor chunk c beside D decodes is the least whose own rows take
    CHUNK_EFFICIENCY of the time it adds to their decode-only step, so prefill beside a
    few streams is not done a token or two at a time at the overhead's price."""
    e = CHUNK_EFFICIENCY
    policy = StepBudget(MEASURED, efficiency=e)
    # one decode: a chunk adds 20 + 2 - 14 = 8 ms of overhead beside 1 ms a token of its
    # own, so 0.8 wants 32 tokens; a step within 2 x 14 ms holds only 7 of them
    assert policy._efficient_chunk(1) == min(math.ceil(e * 8.0 / (1 - e) - 1e-9), 7) == 7
    for model in (MEASURED, CLIFF):
        b = StepBudget(model, efficiency=0.6)
        for d in (1, 2, 4, 8, 12):
            c = b.efficient_chunk(d)
            row = model.row_seconds("mixed") * 1e3

            def worth(n: int) -> bool:
                return row * n >= 0.6 * (b.step_ms(d, n) - b.decode_ms(d)) - 1e-9
            gap = MAX_GAP_FACTOR * b.decode_ms(d)
            assert c == 0 or b.step_ms(d, c) <= gap + 1e-9
            # (one token would run as a decode row: the floor is judged on chunks of 2+)
            if d + c < model.layout.few_rows and b.step_ms(d, c + 1) <= gap:
                assert worth(max(c, 2)) and (c <= 2 or not worth(c - 1))
    assert StepBudget(MEASURED, efficiency=0.0).efficient_chunk(1) == 0
    assert StepBudget(MEASURED, efficiency=0.0).for_step(1) == 1 + MIN_CHUNK
    cheap = StepTime.of(Layout(few_rows=64), few_step=0.002, few_row=0.001,
                        mixed_step=0.001, mixed_row=0.001)
    assert StepBudget(cheap).efficient_chunk(4) == 1      # no overhead: no floor past 1


def test_a_chunk_deep_in_a_context_is_charged_for_its_attention() -> None:
    policy = StepBudget(MEASURED)
    assert policy.chunk_cost(16, 0, 64) == 16
    # 16 x 1000 + 136 pairs (the context's and its own) at 0.5 us, in rows of 1 ms
    assert policy.chunk_cost(16, 1000, 64) == 16 + math.ceil(16.136 * 0.5)
    for start in (0, 100, 1000, 1900, 4000):
        for left in (1, 16, 40, 100, 1000):
            c = policy.max_chunk(left, start, 5000, 1000)
            assert 1 <= c <= left
            if c > MIN_CHUNK:
                assert policy.chunk_cost(c, start, 1000) <= left
                assert c == left or policy.chunk_cost(c + 1, start, 1000) > left
    assert policy.max_chunk(100, 0, 30, 100) == 30                # never more than wanted
    # n + 0.5e-3 x (2000 n + n(n+1)/2) <= 100: 49 (50 would be charged 101)
    assert policy.max_chunk(100, 2000, 5000, 100) == 49


def test_derived_budget_and_fallback() -> None:
    budget, policy = derive_step_budget(MEASURED, None, 256)
    assert policy is not None and policy.for_step(8) == 22 and budget == IDLE_BUDGET
    flat = StepTime.of(Layout(), many_step=1.8)                  # rows free: noise
    assert derive_step_budget(flat, None, 256) == (512, None)


def test_a_burst_of_prompts_gets_a_token_each_per_step() -> None:
    """However small the target, each request with prompt tokens to compute gets budget
    for at least min_chunk tokens a step, as each decode gets its token."""
    policy = StepBudget(CLIFF)
    assert policy.for_step(8, 1) == policy.for_step(8) == 16
    assert policy.for_step(8, 40) == 8 + 40
    assert policy.for_step(1, 5000) == 1 + 5000 > IDLE_BUDGET    # hi follows lo
    assert policy.for_step(0, 40) == IDLE_PROBE
    assert policy.for_step(0, 600) == 600                          # a token each


def test_a_budget_over_the_few_row_kernels_at_every_size() -> None:
    """The low-bit kernels won at every row count (UNBOUNDED_ROWS): every step is priced
    on the few and mixed paths; budgets, floors and chunk charges stay the largest that
    fit, as on MEASURED's few-row side."""
    every = StepTime.of(Layout(few_rows=UNBOUNDED_ROWS), few_step=0.012, few_row=0.002,
                        mixed_step=0.020, mixed_row=0.001, chunk_pair=0.5e-6)
    budget, policy = derive_step_budget(every, None, 256)
    assert policy is not None and budget == IDLE_BUDGET
    for d in (1, 8, 64, 256):
        rows = policy.token_budget(d, policy.target_ms(d))
        assert d < rows < 10_000
        assert policy.step_ms(d, rows - d) <= policy.target_ms(d) + 1e-9
        assert policy.step_ms(d, rows - d + 16) > policy.target_ms(d)
        assert 1 <= policy.efficient_chunk(d) <= policy.for_step(d) - d
    assert policy.token_budget(8, 30.0) == 8 + 2      # 20 ms + 10 rows of 1 ms: 30 ms
    # a chunk after 1,000 cached tokens is charged in rows of the mixed path (1 ms)
    assert policy.chunk_cost(16, 1000, 2048) == 16 + math.ceil(16.136 * 0.5)
    assert "at every step size" in every.describe()


def test_a_lone_prompt_runs_in_the_chunks_priced_fastest() -> None:
    """With no decode running, the budget is the chunk size that prefills a long prompt
    fastest by the model (issue 67: 2,048-token steps ran 0.66x the speed of 64-token
    chunks on the native decode stack): never a size whose steps cost more per token than
    smaller chunks, never past the largest probed prefill (IDLE_PROBE)."""
    # chunks of up to 64 tokens run as decode rows on the stack, cheaper per row than the
    # per-layer modules' rows, and fresh prefills pay their flash attention
    stack = StepTime.of(Layout(few_rows=UNBOUNDED_ROWS, chunk_rows=64), few_step=0.018,
                        few_row=0.0025, mixed_row=0.0040, decode_kv=1.8e-6,
                        decode_kv_reread=1.8e-6, fresh_pair=1.3e-6, chunk_pair=1.1e-6)
    assert idle_chunk(stack) == 64 and StepBudget(stack).for_step(0) == 64
    t64 = prompt_seconds(stack, IDLE_PROMPT, 64)
    assert all(t64 < prompt_seconds(stack, IDLE_PROMPT, c) for c in (16, 128, 256, 512))
    # the same rows on the modules as cheap as on the stack: the step overheads decide
    flat = StepTime.of(Layout(few_rows=UNBOUNDED_ROWS, chunk_rows=64), few_step=0.018,
                       few_row=0.0025, mixed_step=0.018, mixed_row=0.0025,
                       decode_kv=1.3e-6, decode_kv_reread=1.3e-6, fresh_pair=1.3e-6,
                       chunk_pair=1.3e-6)
    assert idle_chunk(flat) == IDLE_PROBE
    assert idle_chunk(flat, most=128) == 128                       # never past the cap
    # dense GEMMs above 16 rows with a big fixed cost: a big chunk amortizes it
    assert idle_chunk(CLIFF) == IDLE_PROBE
    # a budget fixed by the model's fit stays the largest step: derive_step_budget's cap
    assert derive_step_budget(stack, None, 256)[0] == IDLE_BUDGET
