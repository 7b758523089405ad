"""LoRA in the scheduler (no model): block hashes rooted at the adapter, at most max_loras
distinct adapters running at once, the adapter handed to the runner with the request."""
from __future__ import annotations

from duetserve.core import hashing
from duetserve.request import LoRARequest, Request
from duetserve.sampling_params import SamplingParams

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")


def _req(req_id: str, lora: LoRARequest | None, tokens: list[int] | None = None) -> Request:
    return Request(req_id, tokens or list(range(100, 140)), SamplingParams(max_tokens=4),
                   eos_token_ids=(0,), lora_request=lora)


def test_block_hashes_are_rooted_at_the_adapter() -> None:
    assert hashing.root_hash(None) is None
    roots = {hashing.root_hash(x) for x in (A, B, LoRARequest("a", 1, "/elsewhere"),
                                             LoRARequest("a", 3, "/adapters/a"))}
    assert len(roots) == 4                      # id, name and folder all count
    assert hashing.root_hash(A) == hashing.root_hash(LoRARequest("a", 1, "/adapters/a"))
    chains = []
    for lora in (None, A, B):
        r = _req("x", lora)
        hashing.update_block_hashes(r, 16)
        chains.append(r.block_hashes)
    assert all(len(c) == 2 for c in chains)
    assert len({h for c in chains for h in c}) == 6   # no block shared by two roots


def test_at_most_max_loras_adapters_run_at_once(make_scheduler, step) -> None:
    sched, runner = make_scheduler(block_size=16, num_blocks=64, max_num_batched_tokens=512,
                                   max_model_len=256, max_loras=1)
    reqs = [_req("r0", A), _req("r1", None), _req("r2", A), _req("r3", B), _req("r4", A)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, runner)
    # the base and a second request of A join A; B waits (FCFS: so does r4 behind it)
    assert set(out.num_scheduled_tokens) == {"r0", "r1", "r2"}
    assert {d.req_id: d.lora_request for d in out.scheduled_new_reqs} == {
        "r0": A, "r1": None, "r2": A}
    # same prompts: r2 hits r0's two full blocks (same adapter), the base's r1 none
    assert {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs} == {
        "r0": 0, "r1": 0, "r2": 32}
    seen = set()
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        loras = {r.lora_request.lora_int_id for r in sched.running if r.lora_request}
        assert len(loras) <= 1
        seen |= loras
    assert seen == {1, 2}


def test_request_waits_for_its_adapter_without_blocking_others(make_scheduler, step) -> None:
    """lora_ready says B's adapter is not resident (being read): its requests are
    skipped, the ones behind them admitted, and the queue is not schedulable while only
    they wait; once ready, B's requests are admitted ahead of later arrivals."""
    sched, runner = make_scheduler(block_size=16, num_blocks=64, max_num_batched_tokens=512,
                                   max_model_len=256, max_loras=2)
    resident, asked = {1}, []

    def ready(lora: LoRARequest, used: set[int]) -> bool:
        asked.append((lora.lora_int_id, set(used)))
        return lora.lora_int_id in resident
    sched.lora_ready = ready
    for r in (_req("b0", B), _req("r1", None), _req("b2", B), _req("a3", A)):
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r1", "a3"}
    assert [r.req_id for r in sched.waiting] == ["b0", "b2"]        # order kept
    assert (1, set()) in asked and all(i == 2 for i, _ in asked[:-1])
    while sched.running:
        step(sched, runner)
    assert not sched.has_schedulable_requests() and sched.has_unfinished_requests()
    sched.add_request(_req("r4", None))
    assert sched.has_schedulable_requests()          # a newcomer is looked at
    resident.add(2)
    out, _ = step(sched, runner)
    assert [d.req_id for d in out.scheduled_new_reqs] == ["b0", "b2", "r4"]
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_kv_loads_wait_for_their_adapter_and_count_in_max_loras(make_scheduler,
                                                                  step) -> None:
    """Disaggregation's consumers (KV loaded from a prefill instance) are admitted to
    load only when their adapter is resident, and count against max_loras while they
    load: a request of another adapter waits meanwhile."""
    from test_remote_kv import _deliver
    sched, runner = make_scheduler(block_size=16, num_blocks=64, max_num_batched_tokens=512,
                                   max_model_len=256, max_loras=1)
    resident: set[int] = set()
    sched.lora_ready = lambda lora, used: lora.lora_int_id in resident
    consumer = _req("c0", A)
    consumer.append_output_token_ids(7)           # the prefill instance's first token
    consumer.num_external_tokens = consumer.num_prompt_tokens
    sched.add_request(consumer)
    sched.add_request(_req("b1", B))
    step(sched, runner)
    assert not sched.remote.loading and [r.req_id for r in sched.waiting] == ["c0", "b1"]
    resident.update({1, 2})
    out, _ = step(sched, runner)
    assert list(sched.remote.loading) == ["c0"] and not out.num_scheduled_tokens
    assert [r.req_id for r in sched.waiting] == ["b1"]      # A's load fills max_loras
    (_, block_ids, _), = sched.remote.take_new_loads()
    _deliver(runner, sched, consumer, block_ids)
    assert sched.finish_load("c0", True) is None
    out, _ = step(sched, runner)
    assert [d.req_id for d in out.scheduled_new_reqs] == ["c0"]
    assert [d.lora_request for d in out.scheduled_new_reqs] == [A]
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert consumer.is_finished and sched.kv_cache_manager.num_used_blocks == 0
