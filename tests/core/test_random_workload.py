"""A seeded random workload: adds with shared prefixes, steps with a fake runner that
checks every KV slot it reads, aborts and engine-side finishes. Integrity after every
operation; every block free at the end."""
from __future__ import annotations

import random

import pytest

from duetserve.request import Request
from duetserve.sampling_params import SamplingParams

EOS = 0
STOP = 5


def random_request(rng: random.Random, i: int, prefixes: list[list[int]]) -> Request:
    prompt = list(rng.choice(prefixes)) + [rng.randrange(1, 30) for _ in range(rng.randint(1, 30))]
    max_tokens = rng.choice([None, rng.randint(1, 25)])
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5,
                            min_tokens=min(rng.randint(0, 3), max_tokens or 3),
                            stop_token_ids=(STOP,) if rng.random() < 0.3 else ())
    return Request(f"r{i}", prompt, params, eos_token_ids=(EOS,), priority=rng.choice([0, 0, 1]))


def check_finished(r: Request, max_len: int) -> None:
    sp = r.sampling_params
    if r.finish_reason == "length":
        assert r.num_output_tokens == r.max_tokens or r.num_tokens == max_len, r.req_id
    elif r.finish_reason == "stop" and r.stop_reason != "engine":
        last = r.output_token_ids[-1]
        assert r.num_output_tokens >= sp.min_tokens
        assert last in sp.stop_token_ids or (last == EOS and not sp.ignore_eos), r.req_id
        assert r.stop_reason == (last if last in sp.stop_token_ids else None)
    assert r.max_tokens is None or r.num_output_tokens <= r.max_tokens
    assert r.num_tokens <= max_len


@pytest.mark.parametrize("seed,overrides", [
    (0, {}),
    (1, {"enable_prefix_caching": False, "long_prefill_token_threshold": 7}),
])
def test_random_workload(make_scheduler, step, seed: int, overrides: dict) -> None:
    rng = random.Random(seed)
    sched, runner = make_scheduler(seed=seed, vocab_size=30, num_blocks=40,
                                   max_num_batched_tokens=24, max_num_seqs=5,
                                   max_model_len=96, **overrides)
    prefixes = [[], [rng.randrange(1, 30) for _ in range(12)],
                [rng.randrange(1, 30) for _ in range(21)]]
    all_reqs: list[Request] = []
    num_ops = num_steps = 0
    while num_ops < 1500:
        num_ops += 1
        op = rng.random()
        if op < 0.25 or not sched.has_unfinished_requests():
            r = random_request(rng, len(all_reqs), prefixes)
            all_reqs.append(r)
            sched.add_request(r)
        elif op < 0.9:
            out, touched = step(sched, runner)
            num_steps += 1
            assert all(t.req_id in out.num_scheduled_tokens for t in touched)
        elif op < 0.95:
            sched.abort_requests([rng.choice(all_reqs).req_id])
        else:
            sched.finish_requests([rng.choice(all_reqs).req_id], "stop", "engine")
        sched.check_integrity()
    while sched.has_unfinished_requests():
        step(sched, runner)
    pool = sched.kv_cache_manager.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks
    for r in all_reqs:
        assert r.is_finished
        check_finished(r, sched.max_len)
    stats = sched.make_stats()
    assert stats.num_preemptions > 0            # the pool is small enough to force it
    assert num_steps > 500
    if sched.enable_caching:
        assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
