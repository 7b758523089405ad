"""The KV cache manager with sliding-window groups (Gemma 3's layer kinds): one block table
per group from one pool, exact block ids, blocks released behind the window, prefix hits
that supply the window, capacity per request."""
from __future__ import annotations

from duetserve.core import hashing
from duetserve.core.kv_cache_manager import KVCacheManager
from duetserve.request import Request

BS = 4
W = 8           # window: a query at p reads keys p-7..p


def req(req_id: str, tokens: list[int]) -> Request:
    r = Request(req_id, tokens)
    hashing.update_block_hashes(r, BS)
    return r


def prefill(kv: KVCacheManager, r: Request, chunk: int) -> None:
    """Admit (with prefix hits) and compute the prompt in chunks, as the scheduler does."""
    hit, num_hit = kv.get_computed_blocks(r)
    first = min(chunk, r.num_tokens - num_hit)
    assert kv.allocate_slots(r, first, hit) is not None
    r.num_computed_tokens = num_hit + first
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
    kv.check_integrity()


def table(kv: KVCacheManager, req_id: str, g: int) -> list[int]:
    return kv.get_block_ids(req_id)[g::kv.num_groups]


def test_one_full_group_is_the_plain_cache() -> None:
    kv = KVCacheManager(8, BS)
    assert kv.null_block is None and kv.num_blocks == 8
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10) == [0, 1, 2]


def test_tables_interleave_and_the_sliding_one_releases_behind_the_window() -> None:
    kv = KVCacheManager(32, BS, windows=(None, W))
    assert kv.null_block.block_id == 0 and kv.num_blocks == 31
    r = req("a", list(range(30)))
    # blocks 0 and 1 of each group, interleaved: full 1, sliding 3, full 2, sliding 4
    assert kv.allocate_slots(r, 8) == [1, 3, 2, 4]
    assert table(kv, "a", 0) == [1, 2] and table(kv, "a", 1) == [3, 4]
    r.num_computed_tokens = 8
    assert kv.used_blocks_by_kind() == {"full": 2, "sliding": 2}
    # next chunk [8, 16): its first query (8) needs keys 1.. : block 0 still needed
    kv.allocate_slots(r, 8)
    r.num_computed_tokens = 16
    assert table(kv, "a", 1)[0] != 0
    # chunk [16, 24): keys from 9 on: block 0 (positions 0-3) and 1 (4-7) released
    kv.allocate_slots(r, 8)
    r.num_computed_tokens = 24
    assert table(kv, "a", 1)[:2] == [0, 0] and 0 not in table(kv, "a", 1)[2:]
    assert 0 not in table(kv, "a", 0)                      # the full group keeps all
    assert kv.used_blocks_by_kind() == {"full": 6, "sliding": 4}
    kv.check_integrity()
    # decoding on: a sliding table holds at most ceil(W / BS) + 1 blocks
    for pos in range(24, 60):
        r.append_output_token_ids(pos % 7)
        hashing.update_block_hashes(r, BS)
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        live = [b for b in table(kv, "a", 1) if b != 0]
        assert len(live) <= W // BS + 1
    kv.check_integrity()
    kv.free(r)
    assert kv.num_used_blocks == 0 and kv.used_blocks_by_kind() == {"full": 0, "sliding": 0}
    kv.check_integrity()


def test_prefix_hit_supplies_only_the_window_in_sliding_groups() -> None:
    kv = KVCacheManager(64, BS, windows=(None, W))
    a = req("a", list(range(40)))
    prefill(kv, a, 8)
    kv.free(a)                       # every full block stays cached (free, with its hash)
    b = req("b", list(range(40)) + [99, 98])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 40             # 10 blocks; the next token to compute is 40
    full, sliding = hit
    assert len(full) == len(sliding) == 10 and kv.null_block not in full
    # keys from 40 - 8 + 1 = 33: blocks 8, 9 are needed, 0..7 are not (null)
    assert sliding[:8] == [kv.null_block] * 8 and kv.null_block not in sliding[8:]
    assert kv.allocate_slots(b, 2, hit) is not None
    b.num_computed_tokens = 42
    kv.check_integrity()
    assert kv.prefix_cache_hits == 40


def test_a_hit_stops_where_the_sliding_window_was_not_kept() -> None:
    """The full group has the whole 40-token prefix cached, the sliding group lost its
    last block (evicted): a 10-block hit would need sliding blocks 8 and 9, so the hit is
    cut back to 9 blocks, whose window (keys from 29: blocks 7, 8) is cached: the blocks
    released during a's prefill stay in the cache."""
    kv = KVCacheManager(64, BS, windows=(None, W))
    a = req("a", list(range(40)))
    prefill(kv, a, 8)
    last = table(kv, "a", 1)[-1]
    kv.free(a)
    kv.pool.uncache([kv.pool.blocks[last - 1]])       # pool.blocks[i] holds id i + 1
    b = req("b", list(range(40)) + [7])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 36
    assert hit[1][:7] == [kv.null_block] * 7 and kv.null_block not in hit[1][7:]
    assert len(hit[0]) == len(hit[1]) == 9


def test_loads_allocate_only_the_window_of_the_first_decode() -> None:
    """A KV load (disaggregation) of a 30-token prompt: the sliding group gets blocks only
    for the window of the first position computed here (30), the rest is null."""
    kv = KVCacheManager(64, BS, windows=(None, W))
    r = req("a", list(range(30)))
    assert kv.allocate_slots(r, 30, register=False, first_query=30) is not None
    full, sliding = table(kv, "a", 0), table(kv, "a", 1)
    assert 0 not in full and len(full) == 8
    first = (30 - W + 1) // BS                     # block 5 holds position 23
    assert sliding[:first] == [0] * first and 0 not in sliding[first:]
    kv.check_integrity()


def test_max_request_tokens_counts_the_window_once() -> None:
    full_only = KVCacheManager(65, BS)
    assert full_only.max_request_tokens(chunk=16) == 65 * BS
    hybrid = KVCacheManager(65, BS, windows=(None, W, W))    # 64 usable blocks
    # full: ceil(T/4) blocks; each sliding group: at most ceil((8 + 16) / 4) + 1 = 7
    assert hybrid.max_request_tokens(chunk=16) == (64 - 14) * BS
