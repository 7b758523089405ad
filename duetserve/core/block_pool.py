"""BlockPool: a fixed set of KV blocks with reference counts, an LRU free queue and the
prefix cache (block hash -> cached block).

    free queue (OrderedDict, O(1) removal anywhere):
        front [ evicted first ............................ evicted last ] back
              ^ hashless blocks go here when freed   hashed blocks go here ^

A block is in exactly one of two states:
  - used:  ref_cnt > 0, not in the free queue;
  - free:  ref_cnt == 0, in the free queue. A free block may still be CACHED (it keeps its
           hash and content) and can be revived by a prefix hit (`touch`). Its hash entry is
           dropped only when the block is popped for reuse (lazy eviction).

A cached block remembers its token ids and its parent block (plus the parent's generation
at registration time); `get_cached_block` checks both, so a hash collision is a miss.

`reserved` leading block ids are not managed (the KV cache manager's null block, which
sliding-window tables point at for released positions): the pool holds ids
reserved .. reserved + num_blocks - 1. Each block carries the KV group it was allocated
for (`group`), and the pool counts used blocks per group.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass



@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: object | None = None          # its cache key (a BlockHash, or (group, hash)),
    #                                            set iff the block is in the cached map
    token_ids: tuple[int, ...] | None = None  # content, kept with the hash (collision check)
    parent: KVBlock | None = None             # the block before it when it was registered
    parent_gen: int = 0                       # parent.gen at registration
    gen: int = 0                              # bumped each time the block's content is reset
    group: int = 0                            # the KV group it holds (set at allocation)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, reserved: int = 0,
                 num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(reserved, reserved + num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[object, KVBlock] = {}     # BlockHash, or (group, hash) keys
        self.num_used_by_group = [0] * num_groups

    # --- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free blocks, including cached ones that can be evicted."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Block ids in eviction order (front first). For tests and debugging."""
        return list(self._free)

    # --- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int, group: int = 0) -> list[KVBlock]:
        """Pop `num_blocks` blocks from the front of the free queue for new content of KV
        group `group`.

        Mutates: the free queue; evicts each popped block's hash entry (lazy eviction),
        sets ref_cnt = 1 and the group. Raises ValueError when fewer blocks are free
        (callers check first).
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            block.group = group
            out.append(block)
        self.num_used_by_group[group] += num_blocks
        return out

    def _evict(self, block: KVBlock) -> None:
        """Forget a block's cached identity. Mutates: the cached map, the block."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
        block.token_ids = None
        block.parent = None
        block.gen += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block (a prefix hit). Mutates: ref_cnt; a free block
        leaves the free queue (O(1))."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self.num_used_by_group[block.group] += 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block, in the given order. A block reaching ref_cnt 0 joins
        the free queue: at the BACK if it is cached (evicted last, may get a prefix hit), at
        the FRONT if it holds nothing reusable. Callers pass a request's blocks tail first so
        the tail is evicted before the head. Mutates: ref_cnt, the free queue."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than taken"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                self.num_used_by_group[block.group] -= 1
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Drop the cached identity of each block (its KV is not trustworthy, e.g. a step
        failed before writing it). Blocks keep their references; a free one moves to the
        front of the free queue. Mutates: the cached map, the blocks, the free queue."""
        for block in blocks:
            if block.block_hash is None:
                continue
            self._evict(block)
            if block.ref_cnt == 0:
                self._free.move_to_end(block.block_id, last=False)

    # --- prefix cache -------------------------------------------------------------------
    def get_cached_block(self, block_hash: object, token_ids: Sequence[int],
                         parent: KVBlock | None) -> KVBlock | None:
        """The cached block holding exactly `token_ids` after `parent` (None for the first
        block), or None. Pure lookup: ref counts and the free queue are unchanged."""
        block = self._cached.get(block_hash)
        if block is None or block.parent is not parent or block.token_ids != tuple(token_ids):
            return None
        if parent is not None and block.parent_gen != parent.gen:
            return None  # the parent was evicted and reused since: its KV is a different prefix
        return block

    def cache_block(self, block: KVBlock, block_hash: object, token_ids: Sequence[int],
                    parent: KVBlock | None) -> bool:
        """Register a used block whose KV (after this step) holds `token_ids` after `parent`.

        Mutates: the cached map and the block. Returns False (nothing changed) when caching is
        off, the block is already cached, or another block already holds this hash (the
        duplicate just stays uncached).
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        existing = self._cached.get(block_hash)
        if existing is not None:
            if not self._is_stale(existing):
                return False
            # NOTE: a stale block is always free: whoever holds a cached block holds its
            # parent too (hits walk the chain), and a held parent is never evicted.
            self._evict(existing)
            self._free.move_to_end(existing.block_id, last=False)
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent = parent
        block.parent_gen = parent.gen if parent is not None else 0
        self._cached[block_hash] = block
        return True

    @staticmethod
    def _is_stale(block: KVBlock) -> bool:
        """True when the block's parent was evicted after registration (its KV belongs to a
        prefix that no longer exists in the cache, so it can never be hit)."""
        return block.parent is not None and block.parent.gen != block.parent_gen

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only when no block is used; returns whether it did."""
        if self.num_used_blocks:
            return False
        for block in list(self._cached.values()):
            self._evict(block)
        return True

    # --- invariants ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt} < 0"
        for block_id, b in self._free.items():
            assert b.block_id == block_id, f"free queue key {block_id} holds block {b.block_id}"
            assert b.ref_cnt == 0, f"free block {block_id} has ref_cnt {b.ref_cnt} != 0"
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert num_used + len(self._free) == self.num_blocks, (
            f"free ({len(self._free)}) + used ({num_used}) != total ({self.num_blocks})")
        for h, b in self._cached.items():
            assert b.block_hash == h, (
                f"cached map entry for block {b.block_id} disagrees with its stored hash")
            assert b.token_ids is not None, f"cached block {b.block_id} has no token ids"
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert num_hashed == len(self._cached), (
            f"{num_hashed} blocks carry a hash but the cached map has {len(self._cached)}")
        by_group = [0] * len(self.num_used_by_group)
        for b in self.blocks:
            if b.ref_cnt > 0:
                by_group[b.group] += 1
        assert by_group == self.num_used_by_group, (
            f"used blocks per group {by_group}, counted {self.num_used_by_group}")
