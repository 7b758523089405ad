"""The scheduler's side of prefill/decode disaggregation: which requests hold their
blocks for a transfer (producer) and which wait for their prompt's KV (consumer).

    producer:  RUNNING --first token, finish "length"--> held (blocks kept, not in
               self.requests) --free_held()--> blocks freed
    consumer:  WAITING --admit: blocks allocated, not cached--> loading
               --finish_load(ok)--> loaded (num_computed_tokens = num_external_tokens,
                                    blocks cached) --a running slot--> RUNNING, sent
                                    to the runner as a new request (fresh)
               --finish_load(failed)--> FINISHED_ERROR, blocks freed
               aborted while loading --> orphaned until the load ends (a reader thread
                                    may still be writing the blocks), then freed

NOTE: loads start whatever max_num_seqs says (only blocks bound them), so a prefill
instance's held blocks are read, and freed, as early as possible.
NOTE: a loading request's blocks are not in the prefix cache until the load is done, so
no other request can hit KV that has not arrived. The transitions above are RemoteKV's
methods: each moves requests between its own states and allocates or frees their blocks
through the KVCacheManager it is handed; the Scheduler calls them and keeps its own
queues and request table (each method says which of those it mutates).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from duetserve.core.kv_cache_manager import KVCacheManager
from duetserve.core.request_queue import RequestQueue
from duetserve.request import Request, RequestStatus


@dataclass
class RemoteKV:
    held: dict[str, Request] = field(default_factory=dict)
    loading: dict[str, Request] = field(default_factory=dict)
    loaded: dict[str, Request] = field(default_factory=dict)     # FIFO
    orphaned: dict[str, Request] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)        # loaded, runner not told yet
    # (req_id, block ids, num local prefix-hit tokens) admitted since the last take
    new_loads: list[tuple[str, list[int], int]] = field(default_factory=list)

    def take_new_loads(self) -> list[tuple[str, list[int], int]]:
        loads, self.new_loads = self.new_loads, []
        return loads

    @staticmethod
    def should_hold(request: Request, failed: bool) -> bool:
        return request.kv_hold and not failed and request.finish_reason == "length"

    @staticmethod
    def needs_load(request: Request) -> bool:
        return request.num_external_tokens > 0 and request.num_computed_tokens == 0

    def free_held(self, req_id: str, kv: KVCacheManager) -> bool:
        """Free a held producer's blocks (transferred, or timed out). Returns whether it
        was held. Mutates: the block pool, self.held."""
        request = self.held.pop(req_id, None)
        if request is not None:
            kv.free(request)
        return request is not None

    def finish_load(self, req_id: str, ok: bool, kv: KVCacheManager,
                    num_tokens: int | None = None) -> Request | None:
        """A consumer's load ended. ok: its counter jumps to num_external_tokens (or
        `num_tokens`, what a disk load verified: the blocks past it hold nothing and are
        computed later), its full blocks enter the prefix cache and it waits in `loaded`
        for a running slot.
        Failed: it finishes with "error", its blocks are freed and it is returned (the
        Scheduler forgets it, the engine reports it). A request aborted while loading
        only has its blocks freed now. Mutates: the request, the block pool, self."""
        orphan = self.orphaned.pop(req_id, None)
        if orphan is not None:
            kv.free(orphan, 0)
            return None
        request = self.loading.pop(req_id, None)
        if request is None:
            return None
        if not ok:
            request.set_finished("error")
            kv.free(request, request.num_computed_tokens)
            return request
        request.num_computed_tokens = request.num_external_tokens if num_tokens is None \
            else num_tokens
        request.num_external_tokens = 0
        kv.register_computed(request)
        self.loaded[req_id] = request      # runs when a running slot is free
        return None

    def run_loaded(self, running: list[Request], max_num_seqs: int) -> None:
        """Loaded consumers take free running slots (FIFO); the runner learns them as
        new requests in this step (`fresh`). Mutates: self.loaded, self.fresh, `running`,
        request.status."""
        while self.loaded and len(running) < max_num_seqs:
            req_id = next(iter(self.loaded))
            request = self.loaded.pop(req_id)
            request.status = RequestStatus.RUNNING
            running.append(request)
            self.fresh.add(req_id)

    def admit_load(self, request: Request, kv: KVCacheManager, waiting: RequestQueue,
                   disk: bool = False) -> bool:
        """Allocate blocks for the consumer at the head of `waiting` (its external tokens;
        local prefix hits kept, new blocks not cached), pop it and park it in `loading`.
        False (nothing changed) when the blocks do not fit. Mutates: the block pool,
        `waiting`, the request's counters, self.loading, self.new_loads (not for a load
        from the disk tier: core/disk_tier.py starts those)."""
        hit_blocks, num_hit = kv.get_computed_blocks(request,
                                                     max_tokens=request.num_external_tokens)
        if kv.allocate_slots(request, request.num_external_tokens - num_hit, hit_blocks,
                             register=False,
                             first_query=request.num_external_tokens) is None:
            return False
        waiting.pop()
        request.num_computed_tokens = num_hit
        self.loading[request.req_id] = request
        if not disk:
            self.new_loads.append((request.req_id, kv.get_block_ids(request.req_id),
                                   num_hit))
        return True
