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
no other request can hit KV that has not arrived. Pure bookkeeping; the Scheduler calls
it and owns every mutation of the requests and the block pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from duetserve.request import Request


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
