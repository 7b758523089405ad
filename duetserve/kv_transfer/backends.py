"""Byte movers: read a set of byte segments of a peer's KV memory into this instance's.

    ShmReader        same host: map the peer's memory file, copy with numpy (memcpy)
    MooncakeAgent    Mooncake Transfer Engine, protocol tcp, P2P handshake (no etcd):
                     every segment submitted as its own asynchronous read, then waited
                     for with short sleeps (see MooncakeAgent.read for why not the
                     synchronous batch read)

`read(source, peer, local, segs)` copies `(src_offset, dst_offset, nbytes)` segments
(layout.segments) from the peer's memory region to this instance's `local` memory and
returns the bytes moved, or raises TransferError. Only the reader thread of one load
calls it; the destination blocks belong to that load alone.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np

from duetserve.kv_transfer.memory import SharedKVMemory, open_peer_memory
from duetserve.kv_transfer.params import KVSource, PeerRegion


class TransferError(RuntimeError):
    """A transfer could not be completed; the message says why."""


class ShmReader:
    name = "shm"

    def __init__(self) -> None:
        self._peers: dict[tuple[int, int], object] = {}
        self._lock = threading.Lock()
        self.hostname = socket.gethostname()

    def register(self, memory: SharedKVMemory) -> None:
        """Nothing to do: shared memory needs no registration."""

    def _peer(self, source: KVSource, region: PeerRegion) -> np.ndarray:
        if source.hostname != self.hostname:
            raise TransferError(f"the prefill instance runs on {source.hostname!r}, this "
                                f"decode instance on {self.hostname!r}: shared memory works "
                                "on one host only (use --kv-transfer-backend mooncake)")
        key = (source.pid, region.fd)
        with self._lock:
            mm = self._peers.get(key)
            if mm is None:
                try:
                    mm = open_peer_memory(source.pid, region.fd, region.nbytes)
                except OSError as e:
                    raise TransferError(f"cannot map the prefill instance's KV memory "
                                        f"(pid {source.pid}): {e}") from None
                self._peers[key] = mm
        return np.frombuffer(mm, dtype=np.uint8)

    def read(self, source: KVSource, peer: PeerRegion, local: SharedKVMemory,
             segs: list[tuple[int, int, int]]) -> int:
        src, dst = self._peer(source, peer), local.tensor.numpy()
        total = 0
        for s, d, n in segs:
            dst[d:d + n] = src[s:s + n]
            total += n
        return total


def mooncake_available() -> str | None:
    """None when the Mooncake Transfer Engine imports, else why not."""
    os.environ.setdefault("GLOG_minloglevel", "2")   # Mooncake logs every connection
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a missing libibverbs
        return f"mooncake-transfer-engine-non-cuda is not usable: {type(e).__name__}: {e}"
    return None


class MooncakeAgent:
    """One Mooncake Transfer Engine per process with `memory` registered. A prefill
    instance publishes `session` ("host:rpc_port"); a decode instance reads from it."""

    name = "mooncake"
    POLL_S = 0.0002       # sleep between status checks of an unfinished read
    FIRST_WAIT = 0.8      # share of a read's expected time slept before the first check
    RATE_MIN_BYTES = 16 << 20   # reads this large estimate the rate and sleep first

    def __init__(self, memory: SharedKVMemory, host: str, timeout_s: float = 30.0) -> None:
        why = mooncake_available()
        if why is not None:
            raise TransferError(why)
        from mooncake.engine import TransferEngine
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, tcp) failed: {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.timeout_s = timeout_s
        # bytes/s of recent successful reads: a decaying maximum (see read); 0 = unknown
        self.rate = 0.0
        self.register(memory)

    def register(self, memory: SharedKVMemory) -> None:
        """Make `memory` readable by peers and writable by reads."""
        rc = self.engine.register_memory(memory.base_addr, memory.nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {memory.nbytes} bytes failed: {rc}")

    def read(self, source: KVSource, peer: PeerRegion, local: SharedKVMemory,
             segs: list[tuple[int, int, int]]) -> int:
        """Every segment as its own asynchronous read, all in flight at once, then waited
        for in order with POLL_S sleeps; a read of RATE_MIN_BYTES or more first sleeps
        FIRST_WAIT of the time it should take at `rate` (polling from the start woke the
        reader ~250 times per 117 MB read, ~4-5 ms of its CPU on the cores the bytes
        need). NOTE: Mooncake's synchronous batch read (and get_batch_transfer_status)
        spins on the status without sleeping: on a 2-core host that spinning thread
        took a core from the two that move the bytes, and the read ran at 0.35-0.6x
        raw TCP; sleeping here brings it to about raw TCP
        (docs/benchmarks.md). transfer_check_status looks at a batch's first request
        only, hence one request per batch. Returns only when no read can still write
        `local` (or after timeout_s, see docs/disaggregation.md)."""
        if not source.mooncake_session:
            raise TransferError("the prefill instance did not publish a Mooncake session "
                                "(start it with Mooncake available)")
        if not segs:
            return 0
        eng, session = self.engine, source.mooncake_session
        total = sum(n for _, _, n in segs)
        t0 = time.monotonic()
        batches, error = [], None
        for s, d, n in segs:
            b = eng.batch_transfer_async_read(session, [local.base_addr + d],
                                              [peer.addr + s], [n])
            if not b:
                error = f"Mooncake could not start a read from {session}"
                break
            batches.append(b)
        deadline = t0 + self.timeout_s
        if batches and self.rate > 0 and total >= self.RATE_MIN_BYTES:
            time.sleep(min(self.FIRST_WAIT * total / self.rate, self.timeout_s))
        for b in batches:
            while True:
                status = eng.transfer_check_status(b)    # 1 done, 0 running, < 0 failed
                if status == 1:
                    break
                if status < 0:
                    error = error or f"Mooncake read from {session} failed (status {status})"
                    break
                if time.monotonic() > deadline:
                    raise TransferError(f"Mooncake read from {session} did not end within "
                                        f"{self.timeout_s:.1f} s")
                time.sleep(self.POLL_S)
        if error is not None:
            raise TransferError(error)
        if total >= self.RATE_MIN_BYTES:     # smaller ones measure latency more than rate
            self._observe(total / max(time.monotonic() - t0, 1e-9))
        return total

    def _observe(self, rate: float) -> None:
        """Mutates `rate`: the new read's rate, or 0.9x the old one if higher (a slower
        read, e.g. one sharing the link with others, must not make the first sleep of
        a later, faster read overshoot; an estimate too high only costs extra checks)."""
        self.rate = max(rate, 0.9 * self.rate)
