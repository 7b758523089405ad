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


def test_read_of_more_segments_than_mooncake_queues(agents) -> None:
    """3,000 segments in one read: more than Mooncake queues per peer (1,024). Before the
    in-flight window, the overflow was rejected and the read stalled until its timeout."""
    a, src, b, dst = agents
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    dst.tensor.zero_()
    n = 3000
    segs = [((i * 7919) % n * 64, i * 64, 64) for i in range(n)]   # shuffled sources
    assert b.read(_source(a.session, src), _source(a.session, src).cache, dst, segs) \
        == n * 64
    for s, d, x in segs:
        assert torch.equal(dst.tensor[d:d + x], src.tensor[s:s + x])
    assert b._slots.acquire(blocking=False)     # the window is whole again: every slot
    for _ in range(b.MAX_IN_FLIGHT - 1):        # came back
        assert b._slots.acquire(blocking=False)
    assert not b._slots.acquire(blocking=False)
    for _ in range(b.MAX_IN_FLIGHT):
        b._slots.release()


class _FailingFirstChecks:
    """The agent's engine, but the first status check of `fail` reads reports failure."""

    def __init__(self, engine, fail: int) -> None:
        self._engine, self.fail, self.reads = engine, fail, 0

    def batch_transfer_async_read(self, *args):
        self.reads += 1
        return self._engine.batch_transfer_async_read(*args)

    def transfer_check_status(self, batch):
        status = self._engine.transfer_check_status(batch)
        if status == 1 and self.fail > 0:
            self.fail -= 1
            return -1
        return status


def test_failed_segment_is_read_again(agents, monkeypatch) -> None:
    """A segment that fails is read again (RETRIES times at most), and the bytes end up
    right; one that keeps failing fails the read, naming the attempts."""
    a, src, b, dst = agents
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    dst.tensor.zero_()
    segs = [(0, 8192, 4096), (4096, 0, 4096)]
    flaky = _FailingFirstChecks(b.engine, fail=b.RETRIES)
    monkeypatch.setattr(b, "engine", flaky)
    assert b.read(_source(a.session, src), _source(a.session, src).cache, dst, segs) == 8192
    assert flaky.reads == len(segs) + b.RETRIES
    for s, d, x in segs:
        assert torch.equal(dst.tensor[d:d + x], src.tensor[s:s + x])
    monkeypatch.setattr(b, "engine", _FailingFirstChecks(flaky._engine, fail=10))
    with pytest.raises(TransferError, match=f"{b.RETRIES + 1} attempts"):
        b.read(_source(a.session, src), _source(a.session, src).cache, dst, segs[:1])
