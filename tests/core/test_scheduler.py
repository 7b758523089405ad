"""Scheduler driven by a fake runner: chunking, mixed steps, preemption, priority, stop
checks, the full-data-once protocol, prefix sharing and hash-collision safety."""
from __future__ import annotations

import pytest

from duetserve.core import hashing
from duetserve.errors import RequestError
from duetserve.outputs import ModelRunnerOutput
from duetserve.request import Request, RequestStatus
from duetserve.sampling_params import SamplingParams


def mk(req_id: str, tokens: list[int] | int, max_tokens: int | None = 16,
       priority: int = 0, **params: object) -> Request:
    if isinstance(tokens, int):
        seed = sum(map(ord, req_id))          # deterministic (str hash is salted)
        tokens = [(seed * 31 + i) % 1000 + 100 for i in range(tokens)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=params.pop("ignore_eos", True),
                        **params)
    return Request(req_id, tokens, sp, eos_token_ids=(0,), priority=priority)


def drain(scheduler, runner, step, max_steps: int = 10_000) -> list:
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outs
        outs.append(step(scheduler, runner)[0])
    raise AssertionError("requests did not finish")


def test_n4_siblings_share_one_prefill(make_scheduler) -> None:
    sched, runner = make_scheduler(block_size=16, num_blocks=64, max_num_batched_tokens=2048,
                                   max_model_len=1024)
    prompt = [(7 * i) % 997 for i in range(500)]
    reqs = [mk(f"r{i}", prompt) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    # 500 = 31 full blocks (496 tokens) + a 4-token tail. The first request computes all
    # 500 tokens in 32 blocks; each sibling hits the 31 full blocks (capped at
    # num_tokens - 1 = 499 -> 31 blocks = 496 tokens) and computes 4 tokens in its own tail.
    assert sched.kv_cache_manager.num_used_blocks == 31 + 1 + 3
    assert out.num_scheduled_tokens == {"r0": 500, "r1": 4, "r2": 4, "r3": 4}
    assert [r.num_computed_tokens for r in reqs] == [0, 496, 496, 496]
    # the prefix hits, as the engine learns them (its cached-token count)
    assert [d.num_computed_tokens for d in out.scheduled_new_reqs] == [0, 496, 496, 496]
    tables = [d.block_ids for d in out.scheduled_new_reqs]
    assert all(t[:31] == tables[0][:31] for t in tables)
    assert len({t[31] for t in tables}) == 4
    assert [d.num_computed_tokens for d in out.scheduled_new_reqs] == [0, 496, 496, 496]
    sched.update_from_output(out, runner.execute(out))   # the fake runner checks the KV
    sched.check_integrity()
    stats = sched.make_stats()
    assert stats.prefix_cache_queries == 2000 and stats.prefix_cache_hits == 3 * 496
    assert stats.num_prefill_tokens == 512 and stats.num_decode_tokens == 0


def test_long_prompt_is_chunked_while_decodes_run(make_scheduler, step) -> None:
    sched, runner = make_scheduler(max_num_batched_tokens=16)
    for rid in ("a", "b"):
        sched.add_request(mk(rid, 4, max_tokens=30))
    step(sched, runner)                                    # both prefills in one step
    sched.add_request(mk("long", 50, max_tokens=2))
    chunks = []
    while sched.requests["long"].num_computed_tokens < 50:
        out, _ = step(sched, runner)
        # Never a prefill-only stall: both decodes run in every step of the long prefill.
        assert out.num_scheduled_tokens["a"] == 1 and out.num_scheduled_tokens["b"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
        assert sched.make_stats().num_decode_tokens == 2
    assert chunks == [14, 14, 14, 8]
    assert sched.requests["long"].num_output_tokens == 1   # sampled after the last chunk
    drain(sched, runner, step)


def test_long_prefill_threshold_caps_chunks(make_scheduler, step) -> None:
    sched, runner = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    sched.add_request(mk("long", 25, max_tokens=1))
    sizes = [step(sched, runner)[0].num_scheduled_tokens["long"] for _ in range(3)]
    assert sizes == [10, 10, 5] and not sched.has_unfinished_requests()


def test_preemption_and_everyone_finishes(make_scheduler, step) -> None:
    # 10 blocks x 4 tokens; three requests that each grow to 8 + 20 = 28 tokens (7 blocks).
    sched, runner = make_scheduler(num_blocks=10, max_num_batched_tokens=32)
    reqs = [mk(f"r{i}", 8, max_tokens=20) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    outs = drain(sched, runner, step)
    preempted = [rid for o in outs for rid in o.preempted_req_ids]
    assert preempted and sched.num_preemptions == len(preempted)
    assert all(r.num_output_tokens == 20 and r.finish_reason == "length" for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == len(preempted)
    # A resumed request is sent in full again (NewRequestData with its outputs so far).
    resumed = {d.req_id for o in outs for d in o.scheduled_new_reqs if len(d.token_ids) > 8}
    assert resumed
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_preemption_victim_is_lowest_priority_then_newest(make_scheduler, step) -> None:
    sched, runner = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a, b, c = mk("A", 4, max_tokens=50), mk("B", 4, 50, priority=1), mk("C", 4, max_tokens=50)
    for r in (a, b, c):
        sched.add_request(r)
    first = step(sched, runner)[0]
    assert [d.req_id for d in first.scheduled_new_reqs] == ["A", "C", "B"]
    preempted = []
    while not preempted:
        preempted = list(step(sched, runner)[0].preempted_req_ids)
    assert preempted == ["B"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    # Next among equal priorities: the newest arrival (C) before A.
    while len(preempted) < 2:
        preempted += list(step(sched, runner)[0].preempted_req_ids)
    assert preempted[1] == "C"


def test_priority_orders_waiting_queue(make_scheduler, step) -> None:
    sched, runner = make_scheduler(max_num_seqs=1)
    for rid, prio in (("low", 5), ("high", -1), ("mid", 1), ("mid2", 1)):
        sched.add_request(mk(rid, 4, max_tokens=1, priority=prio))
    order = [step(sched, runner)[0].scheduled_new_reqs[0].req_id for _ in range(4)]
    assert order == ["high", "mid", "mid2", "low"]


def test_fcfs_blocked_head_is_not_jumped(make_scheduler, step) -> None:
    sched, runner = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    sched.add_request(mk("run", 20, max_tokens=30))         # 5 blocks, grows
    step(sched, runner)
    sched.add_request(mk("big", 16, max_tokens=1))          # needs 4 blocks: only 3 free
    sched.add_request(mk("small", 2, max_tokens=1))         # would fit, must wait
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"run"}
    assert sched.num_waiting == 2


def test_full_data_once_then_diffs(make_scheduler, step) -> None:
    sched, runner = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(mk("r", 6, max_tokens=8))
    out, _ = step(sched, runner)
    (new,) = out.scheduled_new_reqs
    assert new.block_ids == [0, 1] and len(new.token_ids) == 6 and new.num_prompt_tokens == 6
    new_ids = []
    for _ in range(7):
        out, _ = step(sched, runner)
        assert not out.scheduled_new_reqs
        (cached,) = out.scheduled_cached_reqs
        new_ids.append(cached.new_block_ids)
    # Decode step k computes position 5 + k: a new block when positions 8 and 12 start.
    assert new_ids == [[], [], [2], [], [], [], [3]]
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"r"}


def test_stop_checks(make_scheduler) -> None:
    sched, _ = make_scheduler()

    def feed(r: Request, tokens: list[int]) -> list[Request]:
        sched.add_request(r)
        out = sched.schedule()
        res = []
        for t in tokens:
            res = sched.update_from_output(
                out, ModelRunnerOutput([r.req_id], {r.req_id: [t]}))
            if r.is_finished:
                break
            out = sched.schedule()
        return res

    r = mk("stoptok", 4, max_tokens=10, stop_token_ids=[7])
    feed(r, [5, 7, 9])
    assert (r.finish_reason, r.stop_reason, r.output_token_ids) == ("stop", 7, [5, 7])
    r = mk("eos", 4, max_tokens=10, ignore_eos=False, min_tokens=2)
    feed(r, [0, 0, 3])
    assert (r.finish_reason, r.stop_reason, r.output_token_ids) == ("stop", None, [0, 0])
    r = mk("ign", 4, max_tokens=3, ignore_eos=True)
    assert feed(r, [0, 0, 0, 0]) == [r]
    assert (r.finish_reason, r.num_output_tokens) == ("length", 3)
    r = mk("maxlen", 250, max_tokens=None)
    feed(r, [1] * 20)
    assert r.finish_reason == "length" and r.num_tokens == 256
    assert sched.kv_cache_manager.num_used_blocks == 0
    with pytest.raises(RequestError, match="limit is 255") as e:
        sched.add_request(mk("too_long", 256))
    assert e.value.param == "prompt"


def test_abort_and_finish_requests(make_scheduler, step) -> None:
    sched, runner = make_scheduler(max_num_seqs=1)
    for rid in ("a", "b", "c"):
        sched.add_request(mk(rid, 5, max_tokens=10))
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"a"}
    sched.abort_requests(["a", "b", "unknown"])
    assert sched.num_running == 0 and sched.num_waiting == 1
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"a", "b"} and set(out.num_scheduled_tokens) == {"c"}
    (c,) = sched.finish_requests(["c"], "stop", stop_reason="STOP")
    assert (c.status, c.stop_reason) == (RequestStatus.FINISHED_STOPPED, "STOP")
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.num_used_blocks == 0


def test_results_of_aborted_request_are_dropped(make_scheduler) -> None:
    sched, runner = make_scheduler()
    r = mk("r", 4)
    sched.add_request(r)
    out = sched.schedule()
    result = runner.execute(out)
    sched.abort_requests("r")
    assert sched.update_from_output(out, result) == []
    assert r.num_output_tokens == 0 and r.finish_reason == "abort"


def test_hash_collision_never_gives_a_false_hit(make_scheduler, step, monkeypatch) -> None:
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda parent, tokens: b"same")
    sched, runner = make_scheduler(max_num_batched_tokens=64)
    a = mk("A", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1)
    sched.add_request(a)
    drain(sched, runner, step)
    expected = {"B": 0, "C": 4, "D": 4}
    for rid, tokens in (("B", [9, 9, 9, 9, 5, 6, 7, 8, 1]),
                        ("C", [1, 2, 3, 4, 9, 9, 9, 9, 1]),
                        ("D", [1, 2, 3, 4, 5, 6, 7, 8, 1])):
        r = mk(rid, tokens, max_tokens=1)
        sched.add_request(r)
        out, _ = step(sched, runner)            # the fake runner checks every KV slot read
        assert out.scheduled_new_reqs[0].num_computed_tokens == expected[rid], rid


def test_prefix_caching_disabled(make_scheduler, step) -> None:
    sched, runner = make_scheduler(enable_prefix_caching=False)
    for rid in ("a", "b"):
        sched.add_request(mk(rid, list(range(20)), max_tokens=2))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 20, "b": 20}
    assert sched.requests["a"].block_hashes == []
    stats = sched.make_stats()
    assert stats.prefix_cache_queries == 0 and stats.prefix_cache_hits == 0
    assert sched.kv_cache_manager.pool.num_cached_blocks == 0


def test_step_budget_widens_without_decodes(make_scheduler, step) -> None:
    """With a StepBudget, a prompt arriving to an idle engine prefills in one big step;
    once a stream is decoding, a later long prompt is cut to the decode-step budget."""
    from duetserve.core.step_budget import StepBudget
    from duetserve.core.step_time import Layout, StepTime
    # one decode: 1.5 x (10 + 1 x 1) = 16.5 ms -> 6 tokens -> the floor 1 + 15; 96 idle
    policy = StepBudget(StepTime.of(Layout(), many_step=0.010, many_row=0.001), min_chunk=15,
                        idle=96)
    sched, runner = make_scheduler(max_num_batched_tokens=96, step_budget=policy)
    sched.add_request(mk("a", 80, max_tokens=30))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 80}             # idle: one step
    sched.add_request(mk("long", 50, max_tokens=2))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "long": 15}  # one decode: 16 tokens
    drain(sched, runner, step)


def test_idle_steps_cut_a_lone_prompt_into_whole_idle_chunks(make_scheduler, step) -> None:
    """With no decode running, a long prompt's chunks after cached context are not
    charged their attention: a 2,000-token prompt alone runs in idle-chunk steps (512,
    512, 512, 464), not in chunks that shrink with the context and leave a short tail
    step (the model priced the idle chunk with its attention: prompt_seconds). Once a
    decode runs, the next prompt's chunks are charged again."""
    from duetserve.core.step_budget import StepBudget
    from duetserve.core.step_time import Layout, StepTime
    cost = StepTime.of(Layout(few_rows=64), few_step=0.010, few_row=0.005, mixed_step=0.020,
                       mixed_row=0.001, many_step=0.020, many_row=0.001, chunk_pair=1e-6)
    policy = StepBudget(cost, min_chunk=4, idle=512)
    assert policy.for_step(0, 1) == 512 and policy.chunk_cost(512, 512, 512) > 512
    sched, runner = make_scheduler(max_num_batched_tokens=512, step_budget=policy,
                                   num_blocks=1024, max_model_len=4096, max_num_seqs=16)
    sched.add_request(mk("alone", 2000, max_tokens=3))
    chunks = []
    while sched.requests["alone"].num_computed_tokens < 2000:
        out, _ = step(sched, runner)
        chunks.append(out.num_scheduled_tokens["alone"])
    assert chunks == [512, 512, 512, 464]
    sched.add_request(mk("next", 1000, max_tokens=1))   # "alone" now decodes
    step(sched, runner)
    out, _ = step(sched, runner)
    start = sched.requests["next"].num_computed_tokens - out.num_scheduled_tokens["next"]
    assert start > 0 and out.num_scheduled_tokens["next"] < policy.for_step(1, 1) - 1
    drain(sched, runner, step)


def test_step_budget_shrinks_chunks_deep_in_a_long_context(make_scheduler, step) -> None:
    """With a StepBudget whose cost has a context term, a long prompt arriving beside 8
    decodes is cut into chunks that shrink as its cached context grows: each chunk's
    charge (its tokens plus its attention over the context, in budget tokens) fits the
    budget left beside the decodes, down to the floor of min_chunk tokens."""
    from duetserve.core.step_budget import StepBudget
    from duetserve.core.step_time import Layout, StepTime
    # decode-only steps 10 + 5 ms a stream; with prompt work 20 + 1 ms a row, and 1 us a
    # (query, key) pair of a chunk after context (its own pairs cost nothing fresh)
    cost = StepTime.of(Layout(few_rows=64), few_step=0.010, few_row=0.005, mixed_step=0.020,
                       mixed_row=0.001, many_step=0.020, many_row=0.001, chunk_pair=1e-6)
    policy = StepBudget(cost, min_chunk=4, idle=512)
    # 8 decodes: 1.5 x (10 + 40) = 75 ms -> (75 - 20) / 1 = 55 tokens: 47 for a chunk
    assert policy.for_step(8) == 55
    sched, runner = make_scheduler(max_num_batched_tokens=512, step_budget=policy,
                                   num_blocks=1024, max_model_len=1024, max_num_seqs=16)
    for i in range(8):
        sched.add_request(mk(f"s{i}", 5, max_tokens=400))
    step(sched, runner)                      # idle: all 8 prompts in one step
    sched.add_request(mk("long", 600, max_tokens=1))
    chunks = []
    while "long" in sched.requests and sched.requests["long"].num_computed_tokens < 600:
        start = sched.requests["long"].num_computed_tokens
        out, _ = step(sched, runner)
        n = out.num_scheduled_tokens["long"]
        assert sum(v for k, v in out.num_scheduled_tokens.items() if k != "long") == 8
        # the most tokens whose rows plus attention (n x start + n(n+1)/2 pairs) are
        # charged at most the 47 budget tokens left beside the decodes
        fits = max(k for k in range(1, 48) if policy.chunk_cost(k, start, 55) <= 47)
        assert n == min(600 - start, max(4, fits if start else 47))
        chunks.append(n)
    assert chunks[0] == 47 and chunks[-2] < chunks[0] and sum(chunks) == 600
    drain(sched, runner, step)
