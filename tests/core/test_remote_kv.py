"""The scheduler's side of disaggregation (core/remote_kv.py) with the fake runner:
producers hold their blocks after the first token; consumers allocate blocks that stay
out of the prefix cache until their KV has arrived, then run from the first token."""
from __future__ import annotations

from conftest import _RunnerReq
from test_scheduler import mk

from duetserve.core import hashing
from duetserve.request import RequestStatus


def _consumer(req_id: str, prompt: list[int], first: int = 7, max_tokens: int = 4):
    req = mk(req_id, prompt, max_tokens=max_tokens)
    req.append_output_token_ids(first)
    req.num_external_tokens = len(prompt)
    return req


def _deliver(runner, scheduler, req, block_ids) -> None:
    """What a transfer does: the prompt's KV (fingerprints) lands in the blocks."""
    bs = scheduler.block_size
    fake = _RunnerReq(list(req.all_token_ids), list(block_ids), 0)
    for pos in range(req.num_prompt_tokens):
        runner.slots[(block_ids[pos // bs], pos % bs)] = fake.fingerprint(pos)


def test_producer_holds_blocks_until_freed(make_scheduler, step) -> None:
    scheduler, runner = make_scheduler()
    req = mk("p", 10, max_tokens=1)
    req.kv_hold = True
    scheduler.add_request(req)
    step(scheduler, runner)
    assert req.finish_reason == "length" and "p" in scheduler.remote.held
    assert scheduler.kv_cache_manager.num_used_blocks == 3     # 10 tokens, block size 4
    assert not scheduler.has_unfinished_requests()
    assert scheduler.free_held("p") and not scheduler.free_held("p")
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    scheduler.check_integrity()


def test_consumer_loads_then_decodes(make_scheduler, step) -> None:
    scheduler, runner = make_scheduler(max_num_seqs=1)
    prompt = list(range(100, 110))
    busy = mk("busy", 3, max_tokens=3)                # holds the only running slot
    scheduler.add_request(busy)
    step(scheduler, runner)
    req = _consumer("c", prompt)
    scheduler.add_request(req)
    out, _ = step(scheduler, runner)
    assert "c" not in out.num_scheduled_tokens          # loading does not compute
    (req_id, block_ids, num_hit), = scheduler.remote.take_new_loads()
    assert (req_id, num_hit, len(block_ids)) == ("c", 0, 3)
    # A request with the same prompt cannot hit blocks whose KV has not arrived.
    twin = mk("twin", prompt, max_tokens=2)
    hashing.update_block_hashes(twin, scheduler.block_size)
    assert scheduler.kv_cache_manager.get_computed_blocks(twin) == ([], 0)
    _deliver(runner, scheduler, req, block_ids)
    assert scheduler.finish_load("c", True) is None
    assert req.num_computed_tokens == 10 and req.num_external_tokens == 0
    assert scheduler.kv_cache_manager.get_computed_blocks(twin)[1] == 8   # cached now
    outs = [step(scheduler, runner)[0] for _ in range(8) if scheduler.has_unfinished_requests()]
    first_c = next(o for o in outs if "c" in o.num_scheduled_tokens)
    new, = [n for n in first_c.scheduled_new_reqs if n.req_id == "c"]
    assert new.num_computed_tokens == 10 and first_c.num_scheduled_tokens["c"] == 1
    assert req.is_finished and req.num_output_tokens == 4
    assert scheduler.kv_cache_manager.num_used_blocks == 0


def test_failed_and_aborted_loads_free_their_blocks(make_scheduler, step) -> None:
    scheduler, runner = make_scheduler()
    a, b = _consumer("a", list(range(9))), _consumer("b", list(range(50, 59)))
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, runner)
    assert len(scheduler.remote.take_new_loads()) == 2
    failed = scheduler.finish_load("a", False)
    assert failed is a and a.status == RequestStatus.FINISHED_ERROR
    scheduler.abort_requests("b")            # its reader may still write: blocks kept
    assert scheduler.kv_cache_manager.num_used_blocks == 3
    assert scheduler.finish_load("b", True) is None
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    assert not scheduler.has_unfinished_requests()
    scheduler.check_integrity()
