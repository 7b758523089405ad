"""The Mooncake backend in one process: two agents (a prefill's and a decode's) over
loopback TCP. Reads copy the segments; a read outside the peer's registered memory or
from a peer that is not there fails with TransferError (no hang)."""
from __future__ import annotations

import pytest
import torch

from duetserve.kv_transfer.backends import MooncakeAgent, TransferError, mooncake_available
from duetserve.kv_transfer.layout import KVLayout
from duetserve.kv_transfer.memory import SharedKVMemory
from duetserve.kv_transfer.params import KVSource, PeerRegion

pytestmark = pytest.mark.skipif(mooncake_available() is not None,
                                reason=f"Mooncake unavailable: {mooncake_available()}")
LAYOUT = KVLayout(1, 1, 64, 16, 64, "float32")


@pytest.fixture(scope="module")
def agents():
    src, dst = SharedKVMemory(LAYOUT.nbytes), SharedKVMemory(LAYOUT.nbytes, populate=True)
    a = MooncakeAgent(src, "127.0.0.1", timeout_s=20.0)
    b = MooncakeAgent(dst, "127.0.0.1", timeout_s=20.0)
    return a, src, b, dst


def _source(session: str, mem: SharedKVMemory) -> KVSource:
    return KVSource("h", mem.pid, mem.fd, mem.base_addr, LAYOUT, session)


def test_read_copies_every_segment(agents) -> None:
    a, src, b, dst = agents
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    segs = [(0, 4096, 100_000), (300_000, 0, 4096), (150_000, 200_000, 65_537)]
    n = b.read(_source(a.session, src), _source(a.session, src).cache, dst, segs)
    assert n == sum(x for _, _, x in segs)
    for s, d, x in segs:
        assert torch.equal(dst.tensor[d:d + x], src.tensor[s:s + x])


def test_read_outside_registered_memory_fails(agents) -> None:
    a, src, b, dst = agents
    bogus = PeerRegion(src.fd, 4096, src.nbytes)          # not a registered address
    with pytest.raises(TransferError, match="failed"):
        b.read(_source(a.session, src), bogus, dst, [(0, 0, 4096), (4096, 4096, 4096)])


def test_read_from_absent_peer_fails(agents) -> None:
    _, src, b, dst = agents
    with pytest.raises(TransferError):
        b.read(_source("127.0.0.1:9", src), _source("127.0.0.1:9", src).cache, dst,
               [(0, 0, 4096)])


def test_rate_estimate_is_a_decaying_maximum(agents) -> None:
    """A slower read lowers the estimate by 10% at most; a faster one replaces it."""
    _, _, b, _ = agents
    saved = b.rate
    try:
        b.rate = 1e9
        b._observe(1e6)
        assert b.rate == pytest.approx(0.9e9)
        b._observe(2e9)
        assert b.rate == 2e9
    finally:
        b.rate = saved


def test_read_sleeping_first_still_copies_everything(agents, monkeypatch) -> None:
    """A read large enough to sleep before its first check (RATE_MIN_BYTES lowered to
    this test's size) returns only once every segment is in place, and updates the
    rate; a smaller read leaves the rate alone."""
    a, src, b, dst = agents
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    segs = [(0, 65_536, 65_536), (131_072, 0, 65_536)]
    monkeypatch.setattr(b, "RATE_MIN_BYTES", 131_072)
    monkeypatch.setattr(b, "rate", 1e12)        # expects ~0 s: the first sleep is short
    assert b.read(_source(a.session, src), _source(a.session, src).cache, dst, segs) \
        == 131_072
    for s, d, x in segs:
        assert torch.equal(dst.tensor[d:d + x], src.tensor[s:s + x])
    assert b.rate == pytest.approx(0.9e12)      # updated: 0.9x the (higher) old estimate
    rate = b.rate
    b.read(_source(a.session, src), _source(a.session, src).cache, dst, [(0, 0, 4096)])
    assert b.rate == rate
