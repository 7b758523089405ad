"""The disk tier's store (kv_transfer/disk_store.py) on its own: round trip, every way a
file can be wrong is a miss (and the file goes), fingerprints never share blocks, the size
cap evicts least recently used, the index comes back from the directory."""
from __future__ import annotations

import os

import pytest

from duetserve.core.hashing import hash_block_tokens
from duetserve.kv_transfer.disk_store import DiskKVStore, decode_block, encode_block

BS, PAYLOAD = 4, 64
FP = {"model": "m", "kv_dtype": "float32", "block_size": BS}


def chain(n: int, offset: int = 0):
    """n blocks of a prompt: (hash, parent hash, token ids, payload)."""
    out, parent = [], None
    for i in range(n):
        toks = tuple(range(offset + i * BS, offset + (i + 1) * BS))
        h = hash_block_tokens(parent, toks)
        out.append((h, parent, toks, bytes([(offset + i * 7 + j) % 256
                                             for j in range(PAYLOAD)])))
        parent = h
    return out


def store(root, fp=FP, max_bytes=1 << 30) -> DiskKVStore:
    return DiskKVStore(str(root), fp, max_bytes, PAYLOAD)


def write_all(s: DiskKVStore, blocks) -> None:
    for b in blocks:
        assert s.put(*b)
    s.flush()


def test_round_trip_and_exact_verification(tmp_path) -> None:
    s = store(tmp_path)
    blocks = chain(3)
    write_all(s, blocks)
    assert not s.put(*blocks[0])                    # stored already: not queued again
    for h, parent, toks, payload in blocks:
        assert s.contains(h)
        assert s.read(h, parent, toks) == payload
    h, parent, toks, _ = blocks[1]
    # as BlockPool.get_cached_block: another parent or other tokens under the hash miss
    assert s.read(h, None, toks) is None
    assert not s.contains(h) and not os.path.exists(s.path_of(h))
    h, parent, toks, _ = blocks[2]
    assert s.read(h, parent, toks[:-1] + (999,)) is None
    assert s.snapshot().corrupt == 2 and s.snapshot().hits == 3
    s.close()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_token", "truncate", "empty"])
def test_damaged_file_is_a_miss_and_deleted(tmp_path, damage) -> None:
    s = store(tmp_path)
    (h, parent, toks, payload), = chain(1)
    write_all(s, [(h, parent, toks, payload)])
    path = s.path_of(h)
    data = bytearray(open(path, "rb").read())
    if damage == "flip_payload":
        data[-1] ^= 1
    elif damage == "flip_token":
        data[-PAYLOAD - 1] ^= 1
    elif damage == "truncate":
        data = data[:-10]
    else:
        data = bytearray()
    with open(path, "wb") as f:
        f.write(data)
    assert s.read(h, parent, toks) is None
    assert not os.path.exists(path) and not s.contains(h)
    assert s.snapshot().corrupt == 1
    s.close()


def test_decode_checks_the_payload_length() -> None:
    (h, parent, toks, payload), = chain(1)
    data = b"".join(encode_block(h, parent, toks, payload))
    assert decode_block(data, h, parent, toks, PAYLOAD) == payload
    assert decode_block(data, h, parent, toks, PAYLOAD + 1) is None


def test_fingerprints_are_separate(tmp_path) -> None:
    a = store(tmp_path)
    write_all(a, chain(2))
    b = store(tmp_path, {**FP, "kv_dtype": "int8"})
    assert b.dir != a.dir
    assert not any(b.contains(h) for h, *_ in chain(2))
    h, parent, toks, _ = chain(1)[0]
    assert b.read(h, parent, toks) is None
    a.close()
    b.close()


def test_index_rebuilt_from_directory_in_lru_order(tmp_path) -> None:
    s = store(tmp_path)
    blocks = chain(4)
    write_all(s, blocks)
    for i, (h, *_) in enumerate(blocks):       # distinct mtimes, block 0 the oldest
        os.utime(s.path_of(h), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    h0, p0, t0, _ = blocks[0]
    assert s.read(h0, p0, t0) is not None      # a hit touches: block 0 is the newest now
    s.close()
    size = os.path.getsize(s.path_of(h0))
    # a stray temporary file of a dead process of this host goes at start-up
    tmp = os.path.join(os.path.dirname(s.path_of(h0)),
                       s._tmp_tag.replace(str(os.getpid()), "999999999") + "x")
    open(tmp, "wb").close()
    again = store(tmp_path, max_bytes=3 * size)  # room for 3: the LRU one (block 1) goes
    assert not os.path.exists(tmp)
    assert [again.contains(h) for h, *_ in blocks] == [True, False, True, True]
    assert again.snapshot().files == 3 and again.snapshot().evictions == 1
    again.close()


def test_lru_cap_evicts_least_recently_used(tmp_path) -> None:
    blocks = chain(5)
    probe = store(tmp_path / "probe")
    write_all(probe, blocks[:1])
    size = os.path.getsize(probe.path_of(blocks[0][0]))
    probe.close()
    s = store(tmp_path / "s", max_bytes=3 * size)
    write_all(s, blocks[:3])
    h0, p0, t0, _ = blocks[0]
    assert s.read(h0, p0, t0) is not None      # block 0 used: block 1 is the LRU now
    write_all(s, blocks[3:5])
    assert [s.contains(h) for h, *_ in blocks] == [True, False, False, True, True]
    assert not os.path.exists(s.path_of(blocks[1][0]))
    snap = s.snapshot()
    assert snap.bytes == 3 * size <= s.max_bytes and snap.evictions == 2
    s.close()


def test_payload_size_is_checked(tmp_path) -> None:
    s = store(tmp_path)
    h, parent, toks, payload = chain(1)[0]
    with pytest.raises(ValueError, match="64 bytes"):
        s.put(h, parent, toks, payload[:-1])
    s.close()


def test_block_bytes_round_trip_whatever_the_planes_dtypes(tmp_path) -> None:
    """DiskBlockIO treats a block as opaque bytes: bfloat16, int8 and float32 (scales)
    planes come back bit-exact in other block ids; a block that does not verify ends the
    load there."""
    import torch

    from duetserve.core.disk_tier import BlockWrite
    from duetserve.kv_transfer.disk_io import DiskBlockIO, plane_bytes
    g = torch.Generator().manual_seed(0)
    planes = [torch.randn(2, 8, 4, 16, generator=g).to(torch.bfloat16),
              torch.randint(-128, 127, (2, 8, 4, 16), generator=g, dtype=torch.int8),
              torch.rand(2, 8, 4, generator=g)]
    s = DiskKVStore(str(tmp_path), FP, 1 << 30, sum(plane_bytes(p) for p in planes))
    io = DiskBlockIO(s, planes)
    blocks = chain(3)
    io.write([BlockWrite(b, h, parent, toks) for b, (h, parent, toks, _) in
              zip((1, 5, 6), blocks)])
    s.flush()
    before = [p.clone() for p in planes]
    with open(s.path_of(blocks[2][0]), "r+b") as f:    # block 3 of the load is torn
        f.truncate(10)
    io.start_load("r", [BlockWrite(b, h, parent, toks) for b, (h, parent, toks, _) in
                        zip((2, 3, 4), blocks)])
    for t in io._threads:
        t.join()
    assert io.poll() == [("r", 2)]
    for p, old in zip(planes, before):
        assert torch.equal(p[:, 2], old[:, 1]) and torch.equal(p[:, 3], old[:, 5])
        assert torch.equal(p[:, 4], old[:, 4])             # not loaded: unchanged
    io.close()
