"""KVCacheManager: per-request block tables on top of the BlockPool, plus prefix-cache
lookups and usage statistics.

A request's block table covers its computed tokens plus the ones scheduled this step:

    tokens:  [0 ........ num_computed ........ num_computed + num_new)
    blocks:  | b0 | b1 | b2 | ... | b_{k-1} |     k = ceil((num_computed + num_new) / B)
             |<- full blocks: registered in the cache ->| partial tail (no hash)

NOTE: a block is registered ("cached") as soon as allocate_slots knows it will be full
after this step's computation. A request scheduled later in the SAME step may hit it; that
is safe because the runner writes every token's K/V of a layer before any attention read
of that layer. This is how n>1 siblings share one prefill.
"""
from __future__ import annotations

from collections.abc import Sequence

from duetserve.core.block_pool import BlockPool, KVBlock
from duetserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request were already offered to the cache.
        self._num_registered: dict[str, int] = {}
        self.prefix_cache_queries = 0   # tokens looked up (cumulative)
        self.prefix_cache_hits = 0      # tokens found (cumulative)

    # --- stats ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table (a copy); empty when it holds no blocks."""
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    # --- prefix cache ---------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request: (blocks, num_hit_tokens).

        The hit is capped so at least one token is computed (the last token's logits are
        needed): it covers at most num_tokens - 1 tokens, rounded down to whole blocks.
        Pure: no ref count, queue or stat changes (allocate_slots takes the references and
        records the stats). Valid until the next allocate_slots/free on this manager.
        Requires request.block_hashes to be up to date (the scheduler keeps them so).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # NOTE: prompt logprobs need every prompt position computed: no hits.
            return [], 0
        bs = self.block_size
        max_blocks = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        tokens = request.all_token_ids
        hits: list[KVBlock] = []
        parent: KVBlock | None = None
        for i in range(max_blocks):
            block = self.pool.get_cached_block(
                request.block_hashes[i], tokens[i * bs:(i + 1) * bs], parent)
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits, len(hits) * bs

    # --- allocation -----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (),
                       register: bool = True) -> list[int] | None:
        """Make room for `num_new_tokens` tokens after the request's computed ones.

        `new_computed_blocks` are prefix hits from get_computed_blocks (only when the request
        holds no blocks yet); their tokens count as computed, i.e. the slots cover
        [request.num_computed_tokens + hit_tokens, ... + num_new_tokens).
        Returns the ids of the newly allocated blocks (hits not included), or None when they
        do not fit; nothing changes then. On success mutates: ref counts and free queue,
        the request's block table, the cached map (blocks full after this step), and the
        prefix-cache stats when this is the request's first allocation.
        Does NOT change request.num_computed_tokens (the scheduler does).
        `register=False`: the new blocks are not offered to the cache (their KV arrives
        from another instance later; register_computed offers them once it has).
        """
        blocks = self.req_to_blocks.get(request.req_id)
        if blocks is not None and not new_computed_blocks and self._fits_held(
                request, blocks, request.num_computed_tokens + num_new_tokens, register):
            return []
        first_alloc = blocks is None
        if new_computed_blocks and not first_alloc:
            raise ValueError(f"{request.req_id}: prefix hits only on the first allocation")
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        num_total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_held = 0 if blocks is None else len(blocks)
        num_new_blocks = max(0, cdiv(num_total_tokens, self.block_size)
                             - num_held - len(new_computed_blocks))
        # Hits sitting in the free queue leave it when touched: they use free capacity too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None

        if first_alloc:
            blocks = self.req_to_blocks[request.req_id] = []
            self._num_registered[request.req_id] = 0
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit_tokens
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._num_registered[request.req_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching and register:
            self._register_full_blocks(request, blocks, num_total_tokens)
        return [b.block_id for b in new_blocks]

    def _fits_held(self, request: Request, blocks: list[KVBlock], num_total_tokens: int,
                   register: bool) -> bool:
        """Whether the blocks held already cover `num_total_tokens` and none of them gets
        full for the cache by then: allocate_slots has nothing to do (most decodes, 15 of
        16 steps at 16-token blocks). Mutates nothing."""
        bs = self.block_size
        if num_total_tokens > len(blocks) * bs:
            return False
        return not (self.enable_caching and register
                    and self._num_full(request, num_total_tokens)
                    > self._num_registered[request.req_id])

    def _num_full(self, request: Request, num_tokens: int) -> int:
        """How many of the request's blocks can be offered to the cache once `num_tokens`
        tokens are computed: the full ones whose hash is known. Mutates nothing."""
        return min(num_tokens // self.block_size, len(request.block_hashes))

    def register_computed(self, request: Request) -> None:
        """Offer the request's blocks that are full of computed tokens to the cache (after
        allocate_slots(register=False) and a load). Mutates: the cached map."""
        blocks = self.req_to_blocks.get(request.req_id)
        if self.enable_caching and blocks:
            self._register_full_blocks(request, blocks, request.num_computed_tokens)

    def _register_full_blocks(self, request: Request, blocks: list[KVBlock],
                              num_tokens: int) -> None:
        """Offer each block that is full once `num_tokens` tokens are computed to the cache.
        Mutates: the cached map, self._num_registered."""
        bs = self.block_size
        start = self._num_registered[request.req_id]
        end = self._num_full(request, num_tokens)
        tokens = request.all_token_ids
        for i in range(start, end):
            parent = blocks[i - 1] if i > 0 else None
            self.pool.cache_block(blocks[i], request.block_hashes[i],
                                  tokens[i * bs:(i + 1) * bs], parent)
        if end > start:
            self._num_registered[request.req_id] = end

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release all of the request's blocks, tail first (so the tail is evicted before
        the head). Mutates: ref counts, free queue, the block table (removed). Cached blocks
        keep their content and can still be hit. Unknown requests are ignored.

        `num_valid_tokens`: only the KV of positions [0, num_valid_tokens) was written (a
        step failed for this request); blocks from index num_valid_tokens // block_size on
        were registered in the cache ahead of being computed, so their hashes are dropped
        (shared with other requests or not) before the blocks are released."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self._num_registered.pop(request.req_id, None)
        if blocks and num_valid_tokens is not None:
            self.pool.uncache(blocks[num_valid_tokens // self.block_size:])
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def unverified_block_ids(self, request: Request) -> list[int]:
        """Ids of the request's blocks at or past its computed prefix (their KV is being
        written by the current step). Mutates nothing."""
        blocks = self.req_to_blocks.get(request.req_id, [])
        return [b.block_id for b in blocks[request.num_computed_tokens // self.block_size:]]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks if no block is in use; returns whether it did."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus: each block's ref_cnt equals the number of tables holding it."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] += 1
        for b in self.pool.blocks:
            assert holders[b.block_id] == b.ref_cnt, (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {holders[b.block_id]} "
                "block tables")
