"""Block pool and KV cache manager: exact block ids, eviction order, prefix hits."""
from __future__ import annotations

import pytest

from duetserve.core import hashing
from duetserve.core.block_pool import BlockPool
from duetserve.core.kv_cache_manager import KVCacheManager
from duetserve.request import Request

BS = 4


def req(req_id: str, tokens: list[int]) -> Request:
    r = Request(req_id, tokens)
    hashing.update_block_hashes(r, BS)
    return r


def admit(kv: KVCacheManager, r: Request) -> list[int] | None:
    """First allocation of a whole prompt, with prefix hits, like the scheduler does."""
    hits, num_hit = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
    if ids is not None:
        r.num_computed_tokens = num_hit
    return ids


def test_scripted_allocate_free_hit_evict() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    pool = kv.pool
    a = req("A", list(range(10)))             # 2 full blocks + 2-token tail
    b = req("B", list(range(100, 108)))       # 2 full blocks
    assert admit(kv, a) == [0, 1, 2]
    assert admit(kv, b) == [3, 4]
    assert pool.free_block_ids() == [5, 6, 7]
    assert pool.num_cached_blocks == 4        # A's 2 full blocks, B's 2

    # Free A tail first: the hashless partial tail goes to the front, then the full blocks
    # in reverse, so A's second block is evicted before its first.
    kv.free(a)
    assert pool.free_block_ids() == [2, 5, 6, 7, 1, 0]
    pool.check_integrity()

    # C shares A's first block; the last token is never served from the cache.
    c = req("C", [0, 1, 2, 3, 50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(c)
    assert [b.block_id for b in hits[0]] == [0] and num_hit == 4
    assert kv.allocate_slots(c, 3, hits) == [2]
    assert kv.get_block_ids("C") == [0, 2]
    assert pool.free_block_ids() == [5, 6, 7, 1]

    # D takes every free block: A's tail block 1 is evicted (lazily, on reuse).
    d = req("D", list(range(200, 216)))
    assert admit(kv, d) == [5, 6, 7, 1]
    assert pool.free_block_ids() == []
    probe = req("P", list(range(10)))
    assert [b.block_id for b in kv.get_computed_blocks(probe)[0][0]] == [0]

    # Nothing fits: None and nothing changed.
    e = req("E", [7, 7, 7])
    assert admit(kv, e) is None
    assert "E" not in kv.req_to_blocks

    kv.free(b)
    assert pool.free_block_ids() == [4, 3]
    # G hits B's two blocks (both free) and needs one more: 3 > 2 free -> None, unchanged.
    g = req("G", list(range(100, 108)) + [9])
    hits, num_hit = kv.get_computed_blocks(g)
    assert [b.block_id for b in hits[0]] == [3, 4] and num_hit == 8
    assert kv.allocate_slots(g, 1, hits) is None
    assert pool.free_block_ids() == [4, 3] and pool.blocks[3].ref_cnt == 0

    kv.free(c)                                # C's partial tail (2) to the front, 0 to the back
    assert pool.free_block_ids() == [2, 4, 3, 0]
    assert kv.allocate_slots(g, 1, hits) == [2]
    assert kv.get_block_ids("G") == [3, 4, 2]
    assert pool.free_block_ids() == [0]
    kv.check_integrity()
    for r in (d, g):
        kv.free(r)
    assert kv.num_used_blocks == 0
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    kv.check_integrity()


def test_last_prompt_token_never_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("A", list(range(8)))
    admit(kv, a)
    kv.free(a)
    same = req("S", list(range(8)))
    assert kv.get_computed_blocks(same)[1] == 4   # at most 7 tokens -> 1 whole block
    longer = req("L", list(range(9)))
    assert kv.get_computed_blocks(longer)[1] == 8


def test_a_block_filled_by_decoding_is_offered_to_the_cache() -> None:
    """Decode steps that need no new block allocate nothing; the step that fills a block
    with decoded tokens registers it, so a later prompt with those tokens hits it."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("A", list(range(6)))              # 1 full block + 2 tokens of the second
    assert admit(kv, a) == [0, 1]
    a.num_computed_tokens = 6
    assert kv.pool.num_cached_blocks == 1
    for token in (60, 61):                    # decode: the slot of the newest token
        a.append_output_token_ids(token)
        hashing.update_block_hashes(a, BS)
        assert kv.allocate_slots(a, 1) == []  # the held blocks cover it
        a.num_computed_tokens += 1
    # the second step's token completes block 1 ([4, 5, 60, 61]): cached at allocation
    assert kv.pool.num_cached_blocks == 2
    probe = req("P", list(range(6)) + [60, 61, 99])
    assert [b.block_id for b in kv.get_computed_blocks(probe)[0][0]] == [0, 1]
    a.append_output_token_ids(62)
    hashing.update_block_hashes(a, BS)
    assert kv.allocate_slots(a, 1) == [2]     # the ninth token opens a third block
    kv.check_integrity()


def test_stats_and_usage() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("A", list(range(9)))
    admit(kv, a)
    b = req("B", list(range(9)))
    admit(kv, b)
    assert kv.prefix_cache_queries == 18 and kv.prefix_cache_hits == 8
    assert kv.num_used_blocks == 4 and kv.usage == 0.5


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = req("A", list(range(9)))
    admit(kv, a)
    b = req("B", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_stale_child_is_not_hit_and_is_replaced() -> None:
    """A cached block whose parent was evicted and reused is never hit, and a fresh block
    with the same hash takes its place in the cache."""
    pool = BlockPool(3)
    parent, child = pool.get_new_blocks(2)
    assert pool.cache_block(parent, b"p", [1, 2], None)
    assert pool.cache_block(child, b"c", [3, 4], parent)
    assert pool.get_cached_block(b"c", [3, 4], parent) is child
    pool.free_blocks([parent, child])          # head first (on purpose): parent evicted first
    assert pool.free_block_ids() == [2, 0, 1]
    pool.get_new_blocks(2)                     # reuses 2 and the parent 0
    assert pool.get_cached_block(b"c", [3, 4], parent) is None
    assert pool.get_new_blocks(1) == [child]   # the stale child is the only free block
    pool.check_integrity()


def test_stale_cached_block_is_replaced_on_register() -> None:
    pool = BlockPool(4)
    parent, child, other = pool.get_new_blocks(3)
    pool.cache_block(parent, b"p", [1, 2], None)
    pool.cache_block(child, b"c", [3, 4], parent)
    pool.free_blocks([parent, child])          # queue: 3, 0, 1
    pool.get_new_blocks(2)                     # 3 and the parent 0 reused; child 1 stale
    assert pool.cache_block(other, b"c", [3, 4], None)
    assert child.block_hash is None and pool.free_block_ids() == [1]
    assert pool.get_cached_block(b"c", [3, 4], None) is other
    pool.check_integrity()


def test_block_pool_integrity_detects_corruption() -> None:
    pool = BlockPool(4)
    pool.check_integrity()
    blocks = pool.get_new_blocks(2)
    blocks[0].ref_cnt = 0                     # used block with ref 0, not in the free queue
    with pytest.raises(AssertionError, match="free .* used"):
        pool.check_integrity()
    blocks[0].ref_cnt = 1
    pool.cache_block(blocks[0], b"h", [1, 2, 3, 4], None)
    pool.check_integrity()
    blocks[0].block_hash = b"other"
    with pytest.raises(AssertionError, match="disagrees"):
        pool.check_integrity()
    blocks[0].block_hash = b"h"
    pool.free_blocks(blocks)
    pool.blocks[blocks[1].block_id].ref_cnt = 1
    with pytest.raises(AssertionError, match="ref_cnt 1 != 0"):
        pool.check_integrity()


def test_get_new_blocks_evicts_hash_lazily() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_block(b, b"h", [1], None)
    pool.free_blocks([b])
    assert pool.get_cached_block(b"h", [1], None) is b      # still cached while free
    pool.get_new_blocks(2)                                  # reuses it: hash dropped
    assert pool.get_cached_block(b"h", [1], None) is None
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_core_does_not_import_torch() -> None:
    import subprocess
    import sys
    code = "import sys, duetserve.core, duetserve.request; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
