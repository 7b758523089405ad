"""The scheduler's side of the prefix cache's disk tier (core/disk_tier.py) with the fake
runner and a dict as the store: computed prompt blocks are offered for writing once; after
a "restart" (a new scheduler and runner), a prompt sharing the prefix loads it like a
remote KV consumer, runs from what was verified (a partial load computes the rest) and
every position it attends to holds its own prefix's KV (the fake runner checks)."""
from __future__ import annotations

from test_scheduler import mk

from duetserve.core.disk_tier import DiskTier

BS = 4
PROMPT = [(13 * i) % 97 + 100 for i in range(18)]      # 4 full blocks + 2 tokens


def attach(scheduler, disk: dict) -> DiskTier:
    scheduler.disk = DiskTier(disk.__contains__, scheduler.block_size)
    return scheduler.disk


def run(scheduler, runner, step, disk: dict, loads=None) -> list:
    """Steps until done; writes land in `disk` (the blocks' fingerprints) after each step;
    loads are served by `loads(load)` -> blocks verified."""
    outs = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            return outs
        out, _ = step(scheduler, runner)
        outs.append(out)
        for w in scheduler.disk.take_writes():
            assert w.block_hash not in disk, "a block offered twice"
            disk[w.block_hash] = [runner.slots[(w.block_id, j)] for j in range(BS)]
        for load in scheduler.disk.take_loads():
            n = loads(load)
            for w in load.blocks[:n]:
                for j, fp in enumerate(disk[w.block_hash]):
                    runner.slots[(w.block_id, j)] = fp
            scheduler.finish_disk_load(load.req_id, load.base_tokens + n * BS)
    raise AssertionError("requests did not finish")


def test_blocks_written_once_then_loaded_after_a_restart(make_scheduler, step) -> None:
    disk: dict = {}
    s1, r1 = make_scheduler(max_num_batched_tokens=8)       # the prompt in 3 chunks
    attach(s1, disk)
    s1.add_request(mk("a", PROMPT, max_tokens=6))
    run(s1, r1, step, disk)
    assert len(disk) == len(PROMPT) // BS                    # prompt blocks only
    s2, r2 = make_scheduler()                                # a restart: memory empty
    tier = attach(s2, disk)
    b = mk("b", PROMPT[:16] + [5, 6, 7], max_tokens=3)
    s2.add_request(b)
    seen = []
    outs = run(s2, r2, step, disk, loads=lambda load: seen.append(load) or len(load.blocks))
    (load,) = seen
    assert load.base_tokens == 0 and len(load.blocks) == 4
    first = next(o for o in outs if "b" in o.num_scheduled_tokens)
    (new,) = first.scheduled_new_reqs
    assert new.num_computed_tokens == 16 and first.num_scheduled_tokens["b"] == 3
    assert tier.hits == 16 and s2.make_stats().prefix_cache_disk_hits == 16
    assert b.is_finished and len(disk) == 4                  # nothing new to write


def test_partial_load_after_a_memory_hit(make_scheduler, step) -> None:
    disk: dict = {}
    s1, r1 = make_scheduler()
    attach(s1, disk)
    s1.add_request(mk("a", PROMPT, max_tokens=2))
    run(s1, r1, step, disk)
    s2, r2 = make_scheduler()
    tier = attach(s2, {})                       # the first request computes block 0 ...
    s2.add_request(mk("m", PROMPT[:5], max_tokens=1))
    run(s2, r2, step, {})
    tier.contains = disk.__contains__           # ... then the store holds blocks 0-3
    c = mk("c", PROMPT + [1], max_tokens=2)
    s2.add_request(c)
    # block 1 verifies, block 2 does not: the load stops there, the rest is computed
    outs = run(s2, r2, step, disk, loads=lambda load: 1)
    first = next(o for o in outs if "c" in o.num_scheduled_tokens)
    (new,) = first.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and tier.hits == 4
    assert s2.kv_cache_manager.prefix_cache_hits == 4        # block 0 from memory
    assert c.is_finished


def test_aborted_while_loading_frees_blocks_when_the_load_ends(make_scheduler, step) -> None:
    disk: dict = {}
    s1, r1 = make_scheduler()
    attach(s1, disk)
    s1.add_request(mk("a", PROMPT, max_tokens=1))
    run(s1, r1, step, disk)
    s2, r2 = make_scheduler()
    tier = attach(s2, disk)
    s2.add_request(mk("b", PROMPT, max_tokens=1))
    step(s2, r2)
    (load,) = tier.take_loads()
    s2.abort_requests("b")                                   # the reader still writes
    assert s2.kv_cache_manager.num_used_blocks == 4
    s2.finish_disk_load("b", load.base_tokens + 4 * BS)
    assert s2.kv_cache_manager.num_used_blocks == 0 and tier.hits == 0
    s2.check_integrity()


def test_prompt_logprobs_never_load(make_scheduler) -> None:
    s, _ = make_scheduler()
    tier = attach(s, {})
    r = mk("p", PROMPT, prompt_logprobs=1)
    tier.contains = lambda h: True
    s.add_request(r)
    assert tier.num_blocks_on_disk(r, 0) == 0
    r2 = mk("q", PROMPT)
    s.add_request(r2)
    assert tier.num_blocks_on_disk(r2, 0) == 4              # one token left to compute


def test_loads_count_against_max_num_seqs(make_scheduler, step) -> None:
    disk: dict = {}
    s1, r1 = make_scheduler()
    attach(s1, disk)
    s1.add_request(mk("a", PROMPT, max_tokens=1))
    run(s1, r1, step, disk)
    s2, r2 = make_scheduler(max_num_seqs=2)
    tier = attach(s2, disk)
    for i in range(3):
        s2.add_request(mk(f"b{i}", PROMPT + [i], max_tokens=1))
    step(s2, r2)
    assert [load.req_id for load in tier.take_loads()] == ["b0", "b1"]   # b2 waits
    assert s2.num_waiting == 1
