"""Goodput-first scheduling (core/slo.py): the step budget from the streams' TPOT slack,
admission bounded by the TPOT target, TTFT-deadline order. A fixed linear step-time
model (10 ms a step + 1 ms a row) makes every budget a hand computation; no clock is read:
the tests pass the time."""
from __future__ import annotations

import pytest

from duetserve.config import SchedulerConfig
from duetserve.core.scheduler import Scheduler
from duetserve.core.slo import SloPolicy, SloTargets
from duetserve.core.step_budget import StepBudget
from duetserve.core.step_time import Layout, StepShape, StepTime
from duetserve.outputs import ModelRunnerOutput, SchedulerOutput
from duetserve.request import Request
from duetserve.sampling_params import SamplingParams

# every step: 10 ms + 1 ms per row. StepBudget prices D decodes + c prompt tokens at
# 10 + D + c ms: a decode-only step of D streams 10 + D, its target 1.5x that.
LINE = StepTime.of(Layout(), many_step=0.010, many_row=0.001)
TARGETS = SloTargets(ttft_s=2.0, tpot_s=0.100)      # planned at 0.9: TPOT 90 ms


def policy() -> SloPolicy:
    return SloPolicy(StepBudget(LINE), TARGETS)


def stream(req_id: str, outputs: int, anchor: float, **params: object) -> Request:
    """A running stream with `outputs` tokens whose TPOT clock started at `anchor`."""
    r = Request(req_id, [1, 2, 3], SamplingParams(max_tokens=1000, **params))
    r.append_output_token_ids([7] * outputs)
    r.slo_anchor_time, r.slo_anchor_tokens = anchor, 1
    return r


def test_slack_is_the_streams_lead_over_its_planned_tpot() -> None:
    p = policy()
    assert p.banked_s(stream("a", 1, anchor=5.0), now=5.0) == pytest.approx(0.0)
    # 21 tokens in 1 s: 20 gaps of 50 ms against 90 planned -> 0.8 s ahead
    assert p.banked_s(stream("a", 21, anchor=5.0), now=6.0) == pytest.approx(0.8)
    # its own, looser target counts (200 ms planned at 180)
    assert p.banked_s(stream("a", 21, anchor=5.0, slo_tpot_ms=200.0), now=6.0) \
        == pytest.approx(2.6)
    # 6 tokens in 1 s: behind its target
    assert p.banked_s(stream("a", 6, anchor=5.0), now=6.0) == pytest.approx(-0.55)
    # no TPOT clock yet (no output): nothing banked
    assert p.banked_s(Request("w", [1], SamplingParams()), now=9.0) == 0.0


def prompt(num_tokens: int, arrival: float, **params: object) -> Request:
    return Request("p", list(range(1, num_tokens + 1)), SamplingParams(**params),
                   arrival_time=arrival)


def test_light_load_prefills_in_the_largest_chunks_within_the_light_step() -> None:
    """One fresh stream, TPOT target 105 ms (94.5 planned): StepBudget's target (1.5 x
    11 ms) gives a 200-token prompt 5 tokens a 16 ms step, 640 ms in all, within the 1.8 s
    planned, so no deadline plan; with TPOT far under target the light plan takes the
    largest chunk whose step fits 0.3 x 94.5 = 28.35 ms (17 tokens, 28 ms), spread over
    the 12 steps it needs (17 tokens each, the last 13)."""
    p = SloPolicy(StepBudget(LINE), SloTargets(ttft_s=2.0, tpot_s=0.105))
    assert StepBudget(LINE).for_step(1, 1) == 6
    assert p.light_ms() == pytest.approx(28.35)
    a = stream("a", 1, anchor=0.0)
    assert p.plan(0.0, [a], prompt(200, 0.0), 6) == (12, 17)
    assert p.token_budget(0.0, [a], prompt(200, 0.0), 6) == 18
    assert p.plan(0.0, [a], prompt(30, 0.0), 6) == (2, 15)
    # 17 streams decode in 27 ms: a chunk of 1 fits 28.35 ms but is no faster than the
    # floor (StepBudget's 13 tokens beside them); 19 leave no light step at all
    many = [stream(f"s{i}", 1, anchor=0.0) for i in range(17)]
    assert p.plan(0.0, many, prompt(200, 0.0), 30) == (0, 0)
    assert p.plan(0.0, many + many[:2], prompt(200, 0.0), 32) == (0, 0)
    # a stream so far behind its TPOT target that its slack over the 12 steps is below
    # the light step gets none either: 2 gaps in 1 s, T(12) = 94.5 - 811 / 12 = 26.9 ms
    behind = stream("b", 3, anchor=0.0)
    assert p.plan(1.0, [behind], prompt(200, 1.0), 6) == (0, 0)
    # a pinned step target (--max-step-ms 20) bounds the light steps to 9 tokens (20
    # ms): no wider than StepBudget's own budget under that target, so nothing to add
    pinned = SloPolicy(StepBudget(LINE, max_step_ms=20.0), SloTargets(2.0, 0.105))
    assert pinned.light_ms() == 20.0
    assert pinned.budget.for_step(1, 1) == 10
    assert pinned.plan(0.0, [a], prompt(200, 0.0), 10) == (0, 0)
    assert pinned.plan(0.0, [a], prompt(200, 0.0), 6) == (23, 9)
    # a tighter TPOT target: light steps of 0.3 x 36 = 10.8 ms, not even one decode's
    tight = SloPolicy(StepBudget(LINE), SloTargets(ttft_s=2.0, tpot_s=0.040))
    assert tight.plan(0.0, [a], prompt(200, 0.0), 6) == (0, 0)


def test_a_prompt_that_would_miss_ttft_gets_the_least_widening_that_meets_it() -> None:
    """TTFT 0.31 s (279 ms planned): StepBudget's 40 steps of 16 ms miss it. Plans of N
    steps of ceil(200 / N) tokens, each step 11 + c ms within the fresh stream's 90 ms:
    N = 6 (34 tokens, 6 x 45 = 270 ms) is the most steps that still meet 279 ms
    (N = 7: 29 tokens, 280 ms); its chunk is larger than the light plan's (16 tokens:
    11 + 16 ms fit 0.3 x 90)."""
    p = SloPolicy(StepBudget(LINE), SloTargets(ttft_s=0.31, tpot_s=0.100))
    a = stream("a", 1, anchor=0.0)
    assert p.plan(0.0, [a], prompt(200, 0.0), 6) == (6, 34)
    assert p.token_budget(0.0, [a], prompt(200, 0.0), 6) == 35
    # TTFT 0.5 s, TPOT 105 ms: the deadline plan (N = 18 of 12 tokens, 414 ms) is
    # smaller than the light plan's chunk (17, the test above), which wins
    half = SloPolicy(StepBudget(LINE), SloTargets(ttft_s=0.5, tpot_s=0.105))
    assert half.plan(0.0, [a], prompt(200, 0.0), 6) == (12, 17)
    # 1 s already waited: late whatever happens, so the prefill ends soonest within the
    # stream's 90 ms steps: 3 steps of 67 tokens (78 ms, 234 ms in all; N = 2 would need
    # 111 ms steps, N = 4 takes 244 ms)
    assert half.plan(1.0, [stream("a", 1, anchor=1.0)], prompt(200, 0.0), 6) == (3, 67)


def test_when_no_plan_meets_the_deadline_the_prefill_ends_soonest() -> None:
    """2,000 tokens in 450 ms cannot be done within 90 ms steps (at most 79 tokens each);
    the soonest plan among those tried: 27 steps of 75 tokens (86 ms)."""
    p = SloPolicy(StepBudget(LINE), SloTargets(ttft_s=0.5, tpot_s=0.100))
    a = stream("a", 1, anchor=0.0)
    assert p.plan(0.0, [a], prompt(2000, 0.0), 6) == (27, 75)
    assert p.token_budget(0.0, [a], prompt(2000, 0.0), 6) == 76


def test_banked_slack_is_spread_and_a_step_is_never_past_the_ttft_share() -> None:
    """A stream 16 s ahead allows T(N) = 90 + 16,000 / N ms, capped at half the TTFT
    target (250 ms): the soonest plan is 10 steps of 200 tokens (211 ms), not one step of
    2,000 (2,011 ms, which the slack alone would allow)."""
    p = SloPolicy(StepBudget(LINE), SloTargets(ttft_s=0.5, tpot_s=0.100))
    rich = stream("r", 201, anchor=0.0)                 # 200 x 90 ms - 2 s: 16 s ahead
    assert p.cap_ms() == pytest.approx(250.0)
    assert p.step_ms(2.0, [rich], 1) == pytest.approx(250.0)
    assert p.step_ms(2.0, [rich], 1000) == pytest.approx(106.0)
    assert p.plan(2.0, [rich], prompt(2000, 2.0), 6) == (10, 200)


def test_heavy_load_keeps_the_step_budget() -> None:
    """80 streams decode in 90 ms: no plan fits their slack, so the scheduler keeps
    StepBudget's budget; streams behind their target even more so."""
    p = SloPolicy(StepBudget(LINE), SloTargets(ttft_s=0.5, tpot_s=0.100))
    busy = [stream(f"s{i}", 11, anchor=0.0) for i in range(80)]   # 10 gaps in 0.9 s
    assert p.plan(0.9, busy, prompt(200, 0.9), 112) == (0, 0)
    assert p.token_budget(0.9, busy, prompt(200, 0.9), 112) == 112
    behind = [stream(f"s{i}", 6, anchor=0.0) for i in range(8)]   # 5 gaps in 1 s
    assert p.step_ms(1.0, behind, 18) < 90.0


def test_admission_stops_where_decodes_would_miss_tpot() -> None:
    p = policy()
    assert p.admits(0)
    assert p.admits(79)              # 80 streams: 90 ms decode steps
    assert not p.admits(80)          # 81: 91 ms
    assert "admission stops at 80 running streams" in p.describe()


def test_admission_widens_for_a_request_late_on_its_ttft() -> None:
    """First in line for 1 s of its 2 s TTFT target (LATE_SHARE 0.5): TTFT is at risk, so
    admission spends TPOT slack, up to decode steps of 3 x 90 ms (260 streams)."""
    p = policy()
    fresh, late = prompt(16, arrival=9.5), prompt(16, arrival=9.0)
    assert not p.admits(80, fresh, now=10.0)        # waited 0.5 s: the TPOT bound holds
    assert p.admits(80, late, now=10.0)
    assert p.admits(259, late, now=10.0)            # 260 streams: 270 ms decode steps
    assert not p.admits(260, late, now=10.0)
    assert not p.admits(80, late)                   # without the time: the TPOT bound
    # its own looser TTFT target (4 s) makes 1 s of waiting not late yet
    assert not p.admits(80, prompt(16, arrival=9.0, slo_ttft_ms=4000.0), now=10.0)
    assert "at 260 while the request first in line has waited 0.5" in p.describe()


# --- the scheduler with the policy -----------------------------------------------------
def scheduler(slo: bool, targets: SloTargets = TARGETS) -> Scheduler:
    budget = StepBudget(LINE)
    return Scheduler(SchedulerConfig(
        max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096, block_size=16,
        num_blocks=2048, step_budget=budget,
        slo=SloPolicy(budget, targets) if slo else None))


def run(sched: Scheduler, now: float) -> tuple[SchedulerOutput, float]:
    """One step from `now`, as long as LINE prices it (the simulator's way): every slice
    that reaches its end samples token 5. Returns the output and the step's end."""
    out = sched.schedule(now)
    end = now + LINE.seconds(StepShape.of_slices(out.slices(), LINE.layout))
    sampled = {r: [5] if r in out.sampled_req_ids else [] for r in out.num_scheduled_tokens}
    sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens),
                                                    sampled), now=end)
    sched.check_integrity()
    return out, end


def req(req_id: str, num_prompt: int, arrival: float, **params: object) -> Request:
    return Request(req_id, [100 + (i * 7 + len(req_id)) % 900 for i in range(num_prompt)],
                   SamplingParams(max_tokens=50, ignore_eos=True, **params),
                   arrival_time=arrival)


@pytest.mark.parametrize("slo", [False, True])
def test_new_prompt_beside_one_stream(slo: bool) -> None:
    """TTFT target 0.5 s: without the policy the prompt gets 5 tokens a 16 ms step and
    its first token comes after 40 steps, past the target; with it, the prefill is
    planned in light steps (TPOT 105 ms: first chunk 17 tokens, see the plan tests),
    re-planned every step, and the stream stays within its planned TPOT."""
    sched = scheduler(slo, SloTargets(ttft_s=0.5, tpot_s=0.105))
    sched.add_request(req("a", 8, 0.0))
    _, now = run(sched, 0.0)                            # a's prefill: 18 ms
    assert sched.requests["a"].slo_anchor_time == pytest.approx(0.018)
    assert sched.requests["a"].slo_anchor_tokens == 1
    sched.add_request(req("b", 200, now))
    got = []
    while sched.requests["b"].num_output_tokens == 0:
        out, now = run(sched, now)
        assert out.num_scheduled_tokens["a"] == 1       # the stream runs every step
        got.append(out.num_scheduled_tokens["b"])
    ttft = now - sched.requests["b"].arrival_time
    a = sched.requests["a"]
    tpot = (now - a.slo_anchor_time) / (a.num_output_tokens - 1)
    if slo:
        assert got[0] == 17 and sum(got) == 200
        assert ttft <= 0.450 and tpot <= 0.090
    else:
        assert got == [5] * 40 and ttft == pytest.approx(0.640)


def test_admission_is_bounded_by_the_tpot_target() -> None:
    sched = scheduler(True)
    for i in range(85):
        sched.add_request(req(f"r{i}", 4, 0.0))
    _, now = run(sched, 0.0)
    assert sched.num_running == 80 and sched.num_waiting == 5
    out, now = run(sched, now)                          # 80 decodes, nobody admitted
    assert len(out.num_scheduled_tokens) == 80 and sched.num_waiting == 5
    while now < 1.0:                                    # the 5 wait half their 2 s target
        out, now = run(sched, now)
        assert sched.num_waiting == 5
    run(sched, now)                                     # late: admitted within 3 x TPOT
    assert sched.num_running == 85 and sched.num_waiting == 0
    fcfs = scheduler(False)
    for i in range(85):
        fcfs.add_request(req(f"r{i}", 4, 0.0))
    run(fcfs, 0.0)
    assert fcfs.num_running == 85


def test_waiting_order_is_the_ttft_deadline() -> None:
    sched = scheduler(True)
    sched.add_request(req("batch", 4, 0.0, slo_ttft_ms=60_000.0))  # due at 60 s
    sched.add_request(req("chat", 4, 1.0))                          # due at 3 s
    assert [r.req_id for r in sched.waiting] == ["chat", "batch"]
    fcfs = scheduler(False)
    fcfs.add_request(req("batch", 4, 0.0, slo_ttft_ms=60_000.0))
    fcfs.add_request(req("chat", 4, 1.0))
    assert [r.req_id for r in fcfs.waiting] == ["batch", "chat"]


def test_without_the_time_the_budget_is_the_step_budgets() -> None:
    sched = scheduler(True)
    sched.add_request(req("a", 8, 0.0))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": [5]}))
    assert sched.requests["a"].slo_anchor_time is None    # no clock: none started
    sched.add_request(req("b", 200, 0.0))
    assert sched.schedule().num_scheduled_tokens == {"a": 1, "b": 5}
