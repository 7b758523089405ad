"""Speculative decoding on the scheduler side, with a fake runner that checks every KV
slot it reads: drafts are scheduled ahead of num_computed_tokens, rejected ones are
subtracted, their slots are overwritten before anyone reads them, and blocks holding
unverified draft KV are never offered to the prefix cache."""
from __future__ import annotations

import random

import pytest

from duetserve.core.scheduler import Scheduler
from duetserve.core.spec_policy import SpecPolicy
from duetserve.core.step_time import Layout, StepTime


def roofline(mem_s: float, row_s: float) -> StepTime:
    """A step-time model shaped like a roofline: mem_s up to the ridge, row_s a row past
    it (the few-row kernels end at the ridge)."""
    return StepTime.of(Layout(few_rows=round(mem_s / row_s)), few_step=mem_s, many_row=row_s)


# 40 ms for one verify row and 6 ms more a row up to 5 rows, then past the few-row
# kernels the roofline through the fifth (12.8 ms a row)
MEASURED_5 = StepTime.of(Layout(few_rows=5), few_step=0.034, few_row=0.006,
                         many_row=0.0128)
from duetserve.outputs import ModelRunnerOutput, SchedulerOutput
from duetserve.request import Request
from duetserve.sampling_params import SamplingParams

from conftest import FakeRunner, make_config
from test_random_workload import EOS, check_finished, random_request


class SpecFakeRunner(FakeRunner):
    """FakeRunner plus drafts: draft positions get the fingerprint of the draft prefix (so
    a rejected draft's slot holds KV no true prefix matches); the 'target' accepts each
    draft with accept_prob; proposals are random, and a draft-model-like proposer writes
    its drafts' KV (into its own cache) within the request's allocated blocks."""

    def __init__(self, block_size: int, seed: int, vocab_size: int, accept_prob: float,
                 lookahead: bool) -> None:
        super().__init__(block_size, seed, vocab_size)
        self.accept_prob = accept_prob
        self.lookahead = lookahead

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        spec = out.scheduled_spec_token_ids
        self.apply_state(out)
        draft_fps: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():       # write phase
            req, drafts = self.reqs[req_id], spec.get(req_id, [])
            end = req.num_computed_tokens + num - len(drafts)
            assert end <= len(req.token_ids)
            if drafts:
                assert end == len(req.token_ids) and num == len(drafts) + 1
            assert len(req.block_ids) * self.block_size >= end + len(drafts)
            for pos in range(req.num_computed_tokens, end):
                self.slots[self._slot(req, pos)] = req.fingerprint(pos)
            prev, fps = req.fingerprint(end - 1), []
            for j, d in enumerate(drafts):
                prev = hash((prev, d))
                fps.append(prev)
                self.slots[self._slot(req, end + j)] = prev
            draft_fps[req_id] = fps
        sampled: dict[str, list[int]] = {}
        proposals: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():       # read phase
            req, drafts = self.reqs[req_id], spec.get(req_id, [])
            end = req.num_computed_tokens + num - len(drafts)
            for pos in range(end):
                assert self.slots.get(self._slot(req, pos)) == req.fingerprint(pos), (
                    f"{req_id}: wrong KV at position {pos}")
            for j, fp in enumerate(draft_fps[req_id]):
                assert self.slots.get(self._slot(req, end + j)) == fp
            req.num_computed_tokens = end
            if end < len(req.token_ids):
                sampled[req_id] = []
                continue
            kept = []
            for d in drafts:
                if self.rng.random() < self.accept_prob:
                    kept.append(d)
                    continue
                kept.append((d + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size)
                break
            else:
                kept.append(self.rng.randrange(self.vocab_size))
            req.num_computed_tokens += min(len(kept) - 1, len(drafts))
            req.token_ids.extend(kept)
            sampled[req_id] = kept
        for req_id, n in out.num_drafts_to_propose.items():
            req = self.reqs[req_id]
            if not sampled.get(req_id):
                continue
            if self.lookahead:   # the draft model writes KV up to position N + n - 2
                assert len(req.block_ids) * self.block_size >= len(req.token_ids) + n - 1
            proposals[req_id] = [self.rng.randrange(self.vocab_size) for _ in range(n)]
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens),
                                 sampled_token_ids=sampled, spec_token_ids=proposals)


def _scheduler(seed: int, lookahead: bool, adaptive: bool = False, accept_prob: float = 0.6,
               **overrides) -> tuple[Scheduler, SpecFakeRunner]:
    model = roofline(0.01, 0.001) if adaptive else None
    policy = SpecPolicy(4, needs_lookahead=lookahead, adaptive=adaptive, step_time=model,
                        condition_on_streak=overrides.pop("condition_on_streak", False))
    config = make_config(spec_policy=policy, **overrides)
    return (Scheduler(config),
            SpecFakeRunner(config.block_size, seed, 30, accept_prob, lookahead))


def _step(sched: Scheduler, runner: SpecFakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    sched.update_from_output(out, runner.execute(out))
    sched.check_integrity()
    return out


@pytest.mark.parametrize("seed,lookahead,adaptive,overrides", [
    (0, False, False, {}),
    (1, True, False, {"long_prefill_token_threshold": 7}),
    (2, True, True, {}),
    (3, False, True, {"condition_on_streak": True}),
])
def test_random_workload_with_speculation(seed, lookahead, adaptive, overrides) -> None:
    rng = random.Random(seed)
    sched, runner = _scheduler(seed, lookahead, adaptive, num_blocks=40,
                               max_num_batched_tokens=24, max_num_seqs=5, max_model_len=96,
                               **overrides)
    prefixes = [[], [rng.randrange(1, 30) for _ in range(12)],
                [rng.randrange(1, 30) for _ in range(21)]]
    all_reqs: list[Request] = []
    for _ in range(1200):
        op = rng.random()
        if op < 0.25 or not sched.has_unfinished_requests():
            r = random_request(rng, len(all_reqs), prefixes)
            all_reqs.append(r)
            sched.add_request(r)
        elif op < 0.92:
            _step(sched, runner)
        elif op < 0.96:
            sched.abort_requests([rng.choice(all_reqs).req_id])
        else:
            sched.finish_requests([rng.choice(all_reqs).req_id], "stop", "engine")
    while sched.has_unfinished_requests():
        _step(sched, runner)
    pool = sched.kv_cache_manager.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks
    sched.check_integrity()
    for r in all_reqs:
        assert r.is_finished
        check_finished(r, sched.max_len)
    stats = sched.make_stats()
    spec = stats.spec
    assert spec.num_drafts > 50 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    assert all(a >= b for a, b in zip(spec.accepted_per_pos, spec.accepted_per_pos[1:]))
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


def test_counter_falls_back_by_the_rejected_drafts() -> None:
    sched, _ = _scheduler(0, lookahead=False, block_size=4)
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=50), eos_token_ids=(EOS,))
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_drafts_to_propose == {"a": 4}
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [7]},
                                                    spec_token_ids={"a": [8, 9, 10, 11]}))
    assert req.spec_token_ids == [8, 9, 10, 11] and req.num_computed_tokens == 6
    out = sched.schedule()
    # the last token plus 4 drafts: positions 6..10
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.scheduled_spec_token_ids == {"a": [8, 9, 10, 11]}
    assert sched.make_stats().num_decode_tokens == 5
    # two drafts accepted, then the target's own token
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [8, 9, 20]}))
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20]
    assert req.num_computed_tokens == 9          # 6 + 5 - 2 rejected
    # only blocks full of verified tokens are hashed: [1..4], [5, 6, 7, 8]
    assert len(req.block_hashes) == 2
    spec = sched.make_stats().spec
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 4, 2)
    assert spec.accepted_per_pos == [1, 1, 0, 0]
    assert (req.spec_num_accepted, req.spec_num_rejections) == (2, 1)


def test_step_budget_does_not_cap_planned_drafts() -> None:
    """A StepBudget whose time target holds one decode and one more token (2 tokens)
    does not cut the policy's 4 drafts (rows are nearly free on the speculation's
    model), and a prompt arriving then still gets the chunk it would get without drafts;
    a fixed budget of 2 tokens caps the drafts at 1."""
    from duetserve.core.step_budget import StepBudget
    budget = StepBudget(StepTime.of(Layout(), many_step=0.010, many_row=0.005),
                        min_chunk=1, idle=64)
    assert budget.for_step(1, 0) == 2 and budget.for_step(1, 1) == 2
    model = roofline(0.01, 0.0001)

    def drafts_step(**config) -> SchedulerOutput:
        policy = SpecPolicy(4, needs_lookahead=False, adaptive=True, step_time=model)
        sched = Scheduler(make_config(spec_policy=policy, block_size=4, **config))
        req = Request("a", [1, 2], SamplingParams(max_tokens=50), eos_token_ids=(EOS,))
        req.spec_num_accepted = 20               # acceptance 21 / 22: gains 0.95 .. 0.83
        sched.add_request(req)
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [7]},
                                                        spec_token_ids={"a": [8, 9, 10, 11]}))
        sched.add_request(Request("b", list(range(1, 21)), SamplingParams(max_tokens=5),
                                  eos_token_ids=(EOS,)))
        return sched.schedule()

    out = drafts_step(max_num_batched_tokens=64, step_budget=budget)
    assert out.scheduled_spec_token_ids == {"a": [8, 9, 10, 11]}
    assert out.num_scheduled_tokens == {"a": 5, "b": 1}
    out = drafts_step(max_num_batched_tokens=2)
    assert out.scheduled_spec_token_ids == {"a": [8]}
    assert out.num_scheduled_tokens == {"a": 2}


def test_drafts_respect_max_tokens_and_preemption_drops_them() -> None:
    sched, _ = _scheduler(0, lookahead=True, block_size=4)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=3), eos_token_ids=(EOS,))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [7]},
                                                    spec_token_ids={"a": [8, 9, 10, 11]}))
    out = sched.schedule()
    # 1 output so far, max 3: at most 1 draft (+ the target's token) is worth verifying
    assert out.scheduled_spec_token_ids == {"a": [8]}
    sched._preempt(req, type("S", (), {"remove": lambda *a: None, "preempted": set()})())
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0


def test_adaptive_plan_turns_off_when_compute_bound() -> None:
    policy = SpecPolicy(4, needs_lookahead=False, adaptive=True,
                        step_time=roofline(0.010, 0.001))     # ridge at 10 rows
    good, bad = ("good", 4, 0.9), ("bad", 4, 0.2)
    plan = policy.plan([good, bad], base_rows=2, base_tokens=2)
    assert plan["good"] == 4 and plan.get("bad", 0) == 1    # 0.2^2 < min_gain
    assert sum(plan.values()) + 2 <= 10                      # stays left of the ridge
    # a step already at the ridge: no drafts, and none proposed for the next step
    assert policy.plan([good], base_rows=10, base_tokens=10) == {}
    assert not policy.has_room(10) and policy.has_room(2)
    assert policy.num_to_propose(0.9) == 4 and policy.num_to_propose(0.3) == 1
    fixed = SpecPolicy(3, needs_lookahead=False, adaptive=False)
    assert fixed.plan([good, bad], base_rows=100, base_tokens=100) == {"good": 3, "bad": 3}


def test_step_times_and_draft_cost() -> None:
    """On 40 ms for one verify row and 6 ms more a row (12.8 ms a row past 5 rows, the
    few-row kernels' end) there is room for drafts until a sure draft would no longer
    raise tokens per second. A draft model's proposals are counted: cheap drafts and high
    acceptance propose all k, poor acceptance fewer, a draft that costs as much as the
    target step none; a free proposer (n-gram) proposes every draft above min_gain."""
    policy = SpecPolicy(4, needs_lookahead=True, adaptive=True, step_time=MEASURED_5,
                        draft_seconds=0.010)
    assert policy.step_seconds(1, 3) == pytest.approx(0.052)
    assert policy.step_seconds(1, 10) == pytest.approx(0.128)
    assert policy.has_room(1) and policy.has_room(4) and not policy.has_room(5)
    assert policy.num_to_propose(0.9) == 4
    assert policy.num_to_propose(0.5) == 1       # 1.5 / 56 ms beats 1.75 / 72 ms
    assert policy.num_to_propose(0.9, next_rows=8) == 0   # past the few rows: rows cost
    costly = SpecPolicy(4, needs_lookahead=True, adaptive=True, step_time=MEASURED_5,
                        draft_seconds=0.040)
    assert costly.num_to_propose(0.5) == 0
    assert costly.num_to_propose(0.5, probe=True) == 1   # measured again now and then
    assert policy.num_to_propose(0.9, probe=True) == 4
    free = SpecPolicy(4, needs_lookahead=False, adaptive=True, step_time=MEASURED_5)
    assert free.num_to_propose(0.9) == 4 and free.num_to_propose(0.3) == 1


def test_several_requests_verify_where_rows_are_cheap() -> None:
    """Four decodes verifying 3 drafts each: on the few-row kernels up to 16 rows an extra
    row costs 0.5 ms beside a 4 ms step, so every draft with gain 0.9 pays; past 16 rows
    a row costs as much as the step's average row, and the plan stops at the 16th row."""
    model = StepTime.of(Layout(few_rows=16), few_step=0.004, few_row=0.0005,
                        many_row=0.0015)
    cands = [(f"r{i}", 3, 0.9) for i in range(4)]
    policy = SpecPolicy(3, needs_lookahead=False, adaptive=True, step_time=model)
    plan = policy.plan(cands, base_rows=4, base_tokens=4)
    assert sum(plan.values()) == 12 and policy.has_room(4)
    more = [(f"r{i}", 3, 0.9) for i in range(8)]
    plan = policy.plan(more, base_rows=8, base_tokens=8)
    assert sum(plan.values()) == 16 - 8              # the rows left on the few-row kernels
    assert not policy.has_room(16)


def test_draft_model_probes_after_choosing_no_drafts() -> None:
    """A draft model whose request's estimate fell so low that the policy proposes none
    still proposes one draft every PROBE_EVERY-th output token, so the estimate can
    recover; on the other steps none."""
    from duetserve.core.spec_schedule import PROBE_EVERY, num_to_propose
    from duetserve.core.step_plan import StepPlan
    policy = SpecPolicy(4, needs_lookahead=True, adaptive=True, step_time=MEASURED_5,
                        draft_seconds=0.040)
    req = Request("r", list(range(10)), SamplingParams(temperature=0.0, max_tokens=100))
    req.spec_num_rejections = 5
    step = StepPlan(budget=100)
    step.spec_open, step.spec_next_rows = True, 1
    got = []
    for out in range(1, 2 * PROBE_EVERY + 1):
        req.append_output_token_ids(1)
        got.append(num_to_propose(policy, req, req.num_tokens - 1, 1, 0, step, 1000))
    assert sum(got) == 2 and got[PROBE_EVERY - 1] == 1 and got[-1] == 1, got


# A verify step of 1..4 rows on the few-row kernels (39, 44, 49, 54 ms), past them on the
# dense ones (70, 72, 74 ms for 5, 6, 7 rows): not convex at the cliff.
STEP_CLIFF = StepTime.of(Layout(few_rows=4), few_step=0.034, few_row=0.005,
                         many_step=0.060, many_row=0.002)


def test_plan_takes_the_best_prefix_over_the_cliff() -> None:
    """Tokens per second for one request with acceptance 0.95: 1, 1.95, 2.85, 3.71, 4.52,
    5.30, 6.03 tokens over 39 .. 74 ms peak at 7 rows (6 drafts), although a 4th draft
    alone lowers them (3.71 / 54 ms > 4.52 / 70 ms)."""
    policy = SpecPolicy(6, needs_lookahead=False, adaptive=True, step_time=STEP_CLIFF)
    assert policy.plan([("a", 6, 0.95)], base_rows=1, base_tokens=1) == {"a": 6}
    assert policy.plan([("a", 3, 0.95)], base_rows=1, base_tokens=1) == {"a": 3}
    # 0.23: one draft (1.23 / 44 ms), a second lowers the rate and no later one pays
    assert policy.plan([("a", 6, 0.23)], base_rows=1, base_tokens=1) == {"a": 1}


def test_acceptance_is_estimated_apart_after_a_fully_kept_verify() -> None:
    """count_spec keeps the verify steps that follow a step which kept all its drafts
    (a streak) apart; a step without drafts or a rejection ends the streak; with
    condition_on_streak the estimate is the state's, otherwise one for all."""
    from duetserve.core.spec_schedule import acceptance_of, count_spec
    from duetserve.outputs import SpecDecodeStats
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    stats = SpecDecodeStats()
    count_spec(stats, req, 4, 4)        # after a step without a streak: counted as fresh
    assert req.spec_streak and (req.spec_streak_accepted, req.spec_streak_rejections) == (0, 0)
    count_spec(stats, req, 4, 4)
    count_spec(stats, req, 4, 1)        # in the streak: counted there, ends it
    assert not req.spec_streak and (req.spec_streak_accepted, req.spec_streak_rejections) == (5, 1)
    count_spec(stats, req, 3, 0)
    count_spec(stats, req, 0, 0)        # no drafts: nothing counted
    assert (req.spec_num_accepted, req.spec_num_rejections) == (9, 2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 15, 9)
    count_spec(stats, req, 2, 2)
    count_spec(stats, req, 0, 0)
    assert not req.spec_streak
    streak = SpecPolicy(4, needs_lookahead=False, condition_on_streak=True)
    assert acceptance_of(streak, req, True) == pytest.approx((5 + 1) / (5 + 1 + 2))
    assert acceptance_of(streak, req, False) == pytest.approx((6 + 1) / (6 + 1 + 2))
    assert acceptance_of(streak, req) == acceptance_of(streak, req, False)
    plain = SpecPolicy(4, needs_lookahead=False)
    assert acceptance_of(plain, req) == pytest.approx((11 + 1) / (11 + 2 + 2))


def test_scheduler_plans_with_the_streak_state() -> None:
    """A request whose verifies go well inside a streak and badly otherwise: after a step
    without drafts it verifies one draft, after a fully kept verify six; the runner is
    asked for what the better state would use (the next verify's outcome is not known
    when the step is scheduled)."""
    policy = SpecPolicy(6, needs_lookahead=False, adaptive=True,
                        step_time=STEP_CLIFF, condition_on_streak=True)
    sched = Scheduler(make_config(spec_policy=policy, block_size=4))
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=100), eos_token_ids=(EOS,))
    req.spec_num_accepted, req.spec_num_rejections = 40, 10
    req.spec_streak_accepted, req.spec_streak_rejections = 38, 1   # 0.95 vs 3/13 fresh
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_drafts_to_propose == {"a": 6}
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [7]},
                                                    spec_token_ids={"a": [8, 9, 10, 11, 12, 13]}))
    out = sched.schedule()                          # the prefill had no drafts: fresh
    assert out.scheduled_spec_token_ids == {"a": [8]}
    assert out.num_drafts_to_propose == {"a": 6}
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [8, 20]},
                                                    spec_token_ids={"a": [21, 22, 23, 24, 25, 26]}))
    assert req.spec_streak
    out = sched.schedule()
    assert out.scheduled_spec_token_ids == {"a": [21, 22, 23, 24, 25, 26]}
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [21, 22, 30]},
                                                    spec_token_ids={"a": [31, 32]}))
    assert not req.spec_streak
    assert sched.schedule().scheduled_spec_token_ids == {"a": [31]}
