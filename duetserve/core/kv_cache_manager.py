"""KVCacheManager: per-request block tables on top of the BlockPool, plus prefix-cache
lookups and usage statistics.

A request's block table covers its computed tokens plus the ones scheduled this step:

    tokens:  [0 ........ num_computed ........ num_computed + num_new)
    blocks:  | b0 | b1 | b2 | ... | b_{k-1} |     k = ceil((num_computed + num_new) / B)
             |<- full blocks: registered in the cache ->| partial tail (no hash)

KV groups (config.ModelConfig.kv_groups): a model whose layers all attend to the whole
context has one group, and a request one table. A model with sliding-window layers
(Gemma 3) has several groups of layers, each with its own table per request, all tables
the same length, their blocks from the one pool. A sliding group's entries before the
window of the request's next query are released as soon as it moves past them and point
at the null block (never read: the attention kernels start at the window):

    sliding group, window W, next query at position p:
             | null | null | b5 | b6 | b7 |      blocks before (p - W + 1) // B released

`get_block_ids` interleaves the groups' tables (entry i * G + g is group g's block i), the
form the runner, the KV transfer and the isolation code keep (one list per request).

NOTE: a block is registered ("cached") as soon as allocate_slots knows it will be full
after this step's computation. A request scheduled later in the SAME step may hit it; that
is safe because the runner writes every token's K/V of a layer before any attention read
of that layer. This is how n>1 siblings share one prefill. Blocks of group g are cached
under (g, hash) (one key space per group); a sliding group's blocks are registered
without a parent (its table has holes), so for them the chain hash plus the block's own
tokens decide a hit.
"""
from __future__ import annotations

from collections.abc import Sequence

from duetserve.core.block_pool import BlockPool, KVBlock
from duetserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: Sequence[int | None] = (None,)) -> None:
        """`windows`: each KV group's sliding window (None: full attention); the default,
        one full group, is a plain paged cache. With a sliding group one block id (0) is
        reserved as the null block."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        hybrid = any(w is not None for w in self.windows)
        if hybrid and num_blocks < 2:
            raise ValueError("a cache with sliding-window groups needs >= 2 blocks")
        self.pool = BlockPool(num_blocks - hybrid, enable_caching, reserved=int(hybrid),
                              num_groups=self.num_groups)
        # NOTE: block 0, reserved; released sliding entries point here and no one reads it
        self.null_block = KVBlock(0) if hybrid else None
        self.req_to_blocks: dict[str, list[list[KVBlock]]] = {}   # per request, per group
        # How many leading blocks of each request were already offered to the cache.
        self._num_registered: dict[str, int] = {}
        # Per request and sliding group, how many leading entries are released (null).
        self._num_released: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0   # tokens looked up (cumulative)
        self.prefix_cache_hits = 0      # tokens found (cumulative)

    # --- stats ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks requests can use (the null block not counted)."""
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

    def used_blocks_by_kind(self) -> dict[str, int]:
        """Blocks held by requests per attention kind ("full", "sliding"). Mutates
        nothing."""
        out: dict[str, int] = {}
        for w, n in zip(self.windows, self.pool.num_used_by_group):
            kind = "full" if w is None else "sliding"
            out[kind] = out.get(kind, 0) + n
        return out

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block tables, interleaved (entry i * G + g is group g's block i;
        with one group, the table), a copy; empty when it holds no blocks."""
        tables = self.req_to_blocks.get(req_id)
        if not tables:
            return []
        if self.num_groups == 1:
            return [b.block_id for b in tables[0]]
        return [t[i].block_id for i in range(len(tables[0])) for t in tables]

    def max_request_tokens(self, chunk: int) -> int:
        """The longest request whose blocks fit the whole pool when prefilled in chunks of
        at most `chunk` tokens: every full group holds all of its tokens' blocks, a sliding
        group at most the window plus one chunk. Mutates nothing."""
        bs, n = self.block_size, self.num_blocks

        def blocks(tokens: int) -> int:
            full = cdiv(tokens, bs)
            return sum(full if w is None else min(full, cdiv(w + chunk, bs) + 1)
                       for w in self.windows)
        lo, hi = 0, n * bs
        while lo < hi:                 # the largest token count whose blocks fit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks(mid) <= n else (lo, mid - 1)
        return lo

    # --- prefix cache ---------------------------------------------------------------------
    def get_computed_blocks(self, request: Request, max_tokens: int | None = None
                            ) -> tuple[list[list[KVBlock]], int]:
        """Longest cached prefix of the request: (hit, num_hit_tokens), hit holding one
        list of blocks per group (empty list: no hit).

        The hit is capped so at least one token is computed (the last token's logits are
        needed): it covers at most num_tokens - 1 tokens (and `max_tokens`), rounded down to
        whole blocks. A full group needs every block of the prefix cached; a sliding group
        only those within the window of the first token to compute (its entries before
        are the null block). Pure: no ref count, queue or stat changes (allocate_slots
        takes the references and records the stats). Valid until the next
        allocate_slots/free on this manager. Requires request.block_hashes to be up to
        date (the scheduler keeps them so).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # NOTE: prompt logprobs need every prompt position computed: no hits.
            return [], 0
        bs = self.block_size
        h = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        if max_tokens is not None:
            h = min(h, max_tokens // bs)
        found: list[list[KVBlock | None]] = []
        for g, w in enumerate(self.windows):
            if w is None:
                found.append(self._full_prefix(request, g, h))
                h = min(h, len(found[-1]))
            else:
                found.append(self._cached_blocks(request, g, h))
        changed = True
        while changed and h:
            changed = False
            for g, w in enumerate(self.windows):
                if w is not None:
                    fit = self._sliding_hit(found[g], h, w)
                    changed |= fit < h
                    h = fit
        if h == 0:
            return [], 0
        hit = [blocks[:h] if w is None else
               [self.null_block] * self._first_needed(h * bs, w)
               + blocks[self._first_needed(h * bs, w):h]
               for blocks, w in zip(found, self.windows)]
        return hit, h * bs

    def _key(self, g: int, block_hash: bytes) -> object:
        return block_hash if self.num_groups == 1 else (g, block_hash)

    def _full_prefix(self, request: Request, g: int, max_blocks: int) -> list[KVBlock]:
        """Group g's cached blocks of the request's prefix, from block 0 until a miss."""
        bs, tokens, hits = self.block_size, request.all_token_ids, []
        parent: KVBlock | None = None
        for i in range(max_blocks):
            block = self.pool.get_cached_block(self._key(g, request.block_hashes[i]),
                                               tokens[i * bs:(i + 1) * bs], parent)
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    def _cached_blocks(self, request: Request, g: int, max_blocks: int
                       ) -> list[KVBlock | None]:
        """Sliding group g's cached block for each of the first max_blocks (None: not
        cached); registered without parents, so looked up without one."""
        bs, tokens = self.block_size, request.all_token_ids
        return [self.pool.get_cached_block(self._key(g, request.block_hashes[i]),
                                           tokens[i * bs:(i + 1) * bs], None)
                for i in range(max_blocks)]

    def _first_needed(self, first_query: int, window: int) -> int:
        """Index of the first block a sliding group needs for queries from `first_query`
        on (the block holding position first_query - window + 1)."""
        return max(0, first_query - window + 1) // self.block_size

    def _sliding_hit(self, cached: list[KVBlock | None], h: int, window: int) -> int:
        """The largest hit of at most h blocks whose window blocks are all cached."""
        run = 0                          # cached blocks ending at index i - 1
        runs = [0] * (h + 1)
        for i in range(h):
            run = run + 1 if cached[i] is not None else 0
            runs[i + 1] = run
        for cand in range(h, 0, -1):
            if runs[cand] >= cand - self._first_needed(cand * self.block_size, window):
                return cand
        return 0

    # --- allocation -----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[KVBlock]] = (),
                       register: bool = True,
                       first_query: int | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` tokens after the request's computed ones.

        `new_computed_blocks` is a prefix hit from get_computed_blocks (only when the
        request holds no blocks yet); its tokens count as computed, i.e. the slots cover
        [request.num_computed_tokens + hit_tokens, ... + num_new_tokens).
        `first_query`: the first position whose attention runs on this instance (default:
        the first new token); sliding groups release and skip blocks before its window
        (a KV load passes the prompt length: only the last window arrives).
        Returns the ids of the newly allocated blocks (hits not included; interleaved per
        group), or None when they do not fit; nothing changes then, except that sliding
        entries behind the window may have been released. On success mutates: ref counts
        and free queue, the request's block tables, the cached map (blocks full after this
        step), and the prefix-cache stats when this is the request's first allocation.
        Does NOT change request.num_computed_tokens (the scheduler does).
        `register=False`: the new blocks are not offered to the cache (their KV arrives
        from another instance later; register_computed offers them once it has).
        """
        tables = self.req_to_blocks.get(request.req_id)
        hit = new_computed_blocks
        if hit and tables is not None:
            raise ValueError(f"{request.req_id}: prefix hits only on the first allocation")
        num_hit_blocks = len(hit[0]) if hit else 0
        start = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_total_tokens = start + num_new_tokens
        first_query = start if first_query is None else first_query
        if tables is not None:
            self._release(request, tables, first_query)
            if self._fits_held(request, tables, num_total_tokens, register):
                return []
        num_held = len(tables[0]) if tables is not None else 0
        num_blocks = cdiv(num_total_tokens, self.block_size)
        new_index = range(num_held + num_hit_blocks, num_blocks)
        num_needed = sum(1 for w in self.windows for i in new_index
                         if w is None or i >= self._first_needed(first_query, w))
        # Hits sitting in the free queue leave it when touched: they use free capacity too.
        num_revived = len({b.block_id for blocks in hit for b in blocks
                           if b is not self.null_block and b.ref_cnt == 0})
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        if tables is None:
            tables = self.req_to_blocks[request.req_id] = [[] for _ in self.windows]
            self._num_registered[request.req_id] = 0
            self._num_released[request.req_id] = [0] * self.num_groups
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit_blocks * self.block_size
        if hit:
            self._take_hit(request, tables, hit)
        new_ids = self._extend(request, tables, new_index, first_query)
        if self.enable_caching and register:
            self._register_full_blocks(request, tables, num_total_tokens)
        return new_ids

    def _take_hit(self, request: Request, tables: list[list[KVBlock]],
                  hit: Sequence[Sequence[KVBlock]]) -> None:
        """Reference a prefix hit's blocks and start the tables with it. Mutates: ref
        counts, free queue, the tables, the request's registered and released counts."""
        for g, blocks in enumerate(hit):
            real = [b for b in blocks if b is not self.null_block]
            self.pool.touch(real)
            tables[g].extend(blocks)
            self._num_released[request.req_id][g] = len(blocks) - len(real)
        self._num_registered[request.req_id] = len(hit[0])

    def _extend(self, request: Request, tables: list[list[KVBlock]], new_index: range,
                first_query: int) -> list[int]:
        """Append blocks for indices `new_index` to every group's table (the null block
        where a sliding group's window starts later); returns the new ids interleaved."""
        per_group = []
        for g, w in enumerate(self.windows):
            skip = 0 if w is None else max(0, self._first_needed(first_query, w)
                                           - new_index.start)
            skip = min(skip, len(new_index))
            blocks = [self.null_block] * skip + self.pool.get_new_blocks(
                len(new_index) - skip, g)
            if skip and self._num_released[request.req_id][g] == len(tables[g]):
                self._num_released[request.req_id][g] += skip
            tables[g].extend(blocks)
            per_group.append(blocks)
        if self.num_groups == 1:
            return [b.block_id for b in per_group[0]]
        return [blocks[i].block_id for i in range(len(new_index)) for blocks in per_group]

    def _release(self, request: Request, tables: list[list[KVBlock]],
                 first_query: int) -> None:
        """Release each sliding group's blocks before the window of `first_query`
        (offered to the prefix cache first when they are full of known tokens). Mutates:
        the tables (entries become the null block), ref counts, the free queue."""
        released = self._num_released[request.req_id]
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            cut = min(self._first_needed(first_query, w), len(tables[g]))
            if cut <= released[g]:
                continue
            blocks = tables[g][released[g]:cut]
            if self.enable_caching:
                self._register_group(request, g, tables[g], released[g], cut)
            self.pool.free_blocks(b for b in blocks if b is not self.null_block)
            tables[g][released[g]:cut] = [self.null_block] * len(blocks)
            released[g] = cut

    def _fits_held(self, request: Request, tables: list[list[KVBlock]],
                   num_total_tokens: int, register: bool) -> bool:
        """Whether the blocks held already cover `num_total_tokens` and none of them gets
        full for the cache by then: allocate_slots has nothing to do (most decodes, 15 of
        16 steps at 16-token blocks). Mutates nothing."""
        if num_total_tokens > len(tables[0]) * self.block_size:
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
        tables = self.req_to_blocks.get(request.req_id)
        if self.enable_caching and tables:
            self._register_full_blocks(request, tables, request.num_computed_tokens)

    def _register_full_blocks(self, request: Request, tables: list[list[KVBlock]],
                              num_tokens: int) -> None:
        """Offer each block that is full once `num_tokens` tokens are computed to the cache.
        Mutates: the cached map, self._num_registered."""
        start = self._num_registered[request.req_id]
        end = self._num_full(request, num_tokens)
        if end <= start:
            return
        for g in range(self.num_groups):
            self._register_group(request, g, tables[g], start, end)
        self._num_registered[request.req_id] = end

    def _register_group(self, request: Request, g: int, blocks: list[KVBlock], start: int,
                        end: int) -> None:
        """Offer group g's blocks [start, end) (full of known tokens) to the cache; null
        entries and blocks cached already are skipped. Mutates: the cached map."""
        bs, tokens = self.block_size, request.all_token_ids
        end = min(end, len(request.block_hashes))
        for i in range(start, end):
            block = blocks[i]
            if block is self.null_block:
                continue
            parent = blocks[i - 1] if i > 0 and self.windows[g] is None else None
            self.pool.cache_block(block, self._key(g, request.block_hashes[i]),
                                  tokens[i * bs:(i + 1) * bs], parent)

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release all of the request's blocks, tail first (so the tail is evicted before
        the head). Mutates: ref counts, free queue, the block tables (removed). Cached
        blocks keep their content and can still be hit. Unknown requests are ignored.

        `num_valid_tokens`: only the KV of positions [0, num_valid_tokens) was written (a
        step failed for this request); blocks from index num_valid_tokens // block_size on
        were registered in the cache ahead of being computed, so their hashes are dropped
        (shared with other requests or not) before the blocks are released."""
        tables = self.req_to_blocks.pop(request.req_id, None)
        self._num_registered.pop(request.req_id, None)
        self._num_released.pop(request.req_id, None)
        for blocks in tables or ():
            real = [b for b in blocks if b is not self.null_block]
            if num_valid_tokens is not None:
                self.pool.uncache(b for b in blocks[num_valid_tokens // self.block_size:]
                                  if b is not self.null_block)
            self.pool.free_blocks(reversed(real))

    def unverified_block_ids(self, request: Request) -> list[int]:
        """Ids of the request's blocks at or past its computed prefix (their KV is being
        written by the current step). Mutates nothing."""
        first = request.num_computed_tokens // self.block_size
        return [b.block_id for blocks in self.req_to_blocks.get(request.req_id, ())
                for b in blocks[first:] if b is not self.null_block]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks if no block is in use; returns whether it did."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus: each block's ref_cnt equals the number of tables holding
        it, and every block sits in tables of the group it was allocated for."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for req_id, tables in self.req_to_blocks.items():
            assert len({len(t) for t in tables}) == 1, f"{req_id}: group tables differ in length"
            for g, blocks in enumerate(tables):
                for b in blocks:
                    if b is self.null_block:
                        continue
                    assert b.group == g, f"block {b.block_id} of group {b.group} in group {g}"
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert holders.get(b.block_id, 0) == b.ref_cnt, (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by "
                f"{holders.get(b.block_id, 0)} block tables")
