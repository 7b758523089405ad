"""The scheduler's side of the prefix cache's disk tier: which blocks of a prompt to read
back from the store at admission, which newly computed blocks to write. The bytes move
in kv_transfer/disk_io.py; the files are kv_transfer/disk_store.py's.

    admission, after an in-memory hit of h blocks:
        blocks h, h+1, ... whose hashes the store's index holds: d blocks
        d > 0: the request loads like a remote KV consumer (core/remote_kv.py): blocks
               allocated (not cached), a reader thread fills blocks h .. h+d-1, then
               finish_load(num_tokens = what it verified): the counter jumps there, the
               blocks enter the prefix cache, the rest of the prompt is computed
    after each step: full prompt blocks computed since the last offer, not in the
        store -> BlockWrite (the engine copies their bytes and queues them)

A load never fails a request: a block that is missing or does not verify ends the load
there (the rest is computed). Only models with one KV group (every layer attends to the
whole context) use the tier (the engine refuses others).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from duetserve.core.block_pool import KVBlock
from duetserve.request import Request


@dataclass(slots=True)
class BlockWrite:
    """One block to read from or write to the store."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class DiskLoad:
    req_id: str
    base_tokens: int                 # tokens already here (the in-memory hit)
    blocks: list[BlockWrite]         # to read, in order, into their block ids


@dataclass
class DiskTier:
    contains: Callable[[bytes], bool]     # the store's index (any thread)
    block_size: int
    hits: int = 0                         # tokens loaded from disk (cumulative)
    loads: list[DiskLoad] = field(default_factory=list)     # admitted, not started
    writes: list[BlockWrite] = field(default_factory=list)  # offered, not queued
    _offered: dict[str, int] = field(default_factory=dict)  # req_id -> blocks offered

    def num_blocks_on_disk(self, request: Request, first: int) -> int:
        """How many consecutive blocks from index `first` the store's index holds, leaving
        at least one prompt token to compute (its logits are needed); 0 for requests that
        need every prompt position computed (prompt logprobs). Mutates nothing."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0
        last = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        n = first
        while n < last and self.contains(request.block_hashes[n]):
            n += 1
        return n - first

    def _block(self, request: Request, i: int, block_id: int) -> BlockWrite:
        bs, hashes = self.block_size, request.block_hashes
        return BlockWrite(block_id, hashes[i], hashes[i - 1] if i else None,
                          tuple(request.all_token_ids[i * bs:(i + 1) * bs]))

    def add_load(self, request: Request, block_ids: list[int], base_tokens: int) -> None:
        """A request admitted to load blocks base_tokens / B .. num_external_tokens / B
        into `block_ids` (its table). Mutates self.loads."""
        first, end = base_tokens // self.block_size, \
            request.num_external_tokens // self.block_size
        self.loads.append(DiskLoad(request.req_id, base_tokens, [
            self._block(request, i, block_ids[i]) for i in range(first, end)]))

    def offer(self, request: Request, tables: Sequence[Sequence[KVBlock]] | None) -> None:
        """The request's full prompt blocks computed since its last offer, and not in
        the store, become writes (a block loaded from disk is in the store; one that
        failed verification was dropped from it and is written again once computed).
        `tables`: its block tables (KVCacheManager's; one KV group). O(1) unless a block
        filled. Mutates self.writes."""
        bs = self.block_size
        start = self._offered.get(request.req_id, 0)
        end = min(request.num_computed_tokens, request.num_prompt_tokens) // bs
        if end <= start or not tables:
            return
        end = min(end, len(request.block_hashes), len(tables[0]))
        for i in range(start, end):
            if not self.contains(request.block_hashes[i]):
                self.writes.append(self._block(request, i, tables[0][i].block_id))
        self._offered[request.req_id] = max(start, end)

    def forget(self, req_id: str) -> None:
        self._offered.pop(req_id, None)

    def take_loads(self) -> list[DiskLoad]:
        loads, self.loads = self.loads, []
        return loads

    def take_writes(self) -> list[BlockWrite]:
        writes, self.writes = self.writes, []
        return writes
