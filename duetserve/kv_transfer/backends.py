"""Byte movers: read a set of byte segments of a peer's KV memory into this instance's.

    ShmReader        same host: map the peer's memory file, copy with numpy (memcpy)
    MooncakeAgent    Mooncake Transfer Engine, protocol tcp, P2P handshake (no etcd):
                     every segment its own asynchronous read, at most MAX_IN_FLIGHT in
                     flight per process, waited for with short sleeps (see
                     MooncakeAgent.read for why not the synchronous batch read)

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
from collections import deque

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
    instance publishes `session` ("host:rpc_port"); a decode instance reads from it.

    NOTE: at most MAX_IN_FLIGHT segment reads are submitted and not yet ended, over all
    the loads of this process (reader threads share `_slots`). Mooncake 0.3.13's TCP
    transport queues at most 1,024 transfers per peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER)
    and lets an overflow wait 1 s for admission, then rejects it: before the window, one
    read of 3,000 small segments here failed (status -1) or stayed "running" until our
    timeout. Sixteen prompts x two samples of SmolLM2 are ~1,900 one-block (layer, k/v)
    segments at once: CI's disaggregation test failed so."""

    name = "mooncake"
    POLL_S = 0.0002       # sleep between status checks of an unfinished read
    FIRST_WAIT = 0.8      # share of a read's expected time slept before the first check
    RATE_MIN_BYTES = 16 << 20   # reads this large estimate the rate and sleep first
    MAX_IN_FLIGHT = 256   # segment reads submitted and not yet ended, all loads together
    RETRIES = 2           # a failed segment is read again this many times

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
        self._slots = threading.BoundedSemaphore(self.MAX_IN_FLIGHT)
        self.register(memory)

    def register(self, memory: SharedKVMemory) -> None:
        """Make `memory` readable by peers and writable by reads."""
        rc = self.engine.register_memory(memory.base_addr, memory.nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {memory.nbytes} bytes failed: {rc}")

    def read(self, source: KVSource, peer: PeerRegion, local: SharedKVMemory,
             segs: list[tuple[int, int, int]]) -> int:
        """Every segment as its own asynchronous read, as many in flight as the shared
        window allows (MAX_IN_FLIGHT), waited for oldest first with POLL_S sleeps; a
        failed segment is read again up to RETRIES times. A read of RATE_MIN_BYTES or
        more first sleeps FIRST_WAIT of the time its first submitted bytes should take at
        `rate` (polling from the start woke the reader ~250 times per 117 MB read, ~4-5
        ms of its CPU on the cores the bytes need). NOTE: Mooncake's synchronous batch
        read (and get_batch_transfer_status) spins on the status without sleeping: on a
        2-core host that spinning thread took a core from the two that move the bytes,
        and the read ran at 0.35-0.6x raw TCP; sleeping here brings it to about raw TCP
        (docs/results.md). transfer_check_status looks at a batch's first request
        only, hence one request per batch. Returns only when no read can still write
        `local` (or after timeout_s, see docs/disaggregation.md). Mutates `rate`."""
        if not source.mooncake_session:
            raise TransferError("the prefill instance did not publish a Mooncake session "
                                "(start it with Mooncake available)")
        if not segs:
            return 0
        session = source.mooncake_session
        total = sum(n for _, _, n in segs)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        # (segment, reads of it so far); in flight: (batch, segment, reads so far)
        pending = deque((seg, 0) for seg in segs)
        in_flight: deque[tuple[int, tuple[int, int, int], int]] = deque()
        error, slept = None, False
        try:
            while pending or in_flight:
                submitted = 0
                while pending and error is None and self._take_slot(not in_flight, deadline):
                    (s, d, n), tries = pending.popleft()
                    try:
                        b = self.engine.batch_transfer_async_read(
                            session, [local.base_addr + d], [peer.addr + s], [n])
                    except BaseException:
                        self._slots.release()
                        raise
                    if not b:
                        self._slots.release()
                        error = f"Mooncake could not start a read from {session}"
                        break
                    in_flight.append((b, (s, d, n), tries + 1))
                    submitted += n
                if not in_flight:
                    break
                if not slept and self.rate > 0 and total >= self.RATE_MIN_BYTES:
                    time.sleep(min(self.FIRST_WAIT * submitted / self.rate, self.timeout_s))
                slept = True
                b, seg, tries = in_flight[0]
                status = self.engine.transfer_check_status(b)  # 1 done, 0 running, < 0 failed
                if 0 <= status != 1:
                    if time.monotonic() > deadline:
                        raise TransferError(f"Mooncake read from {session} did not end "
                                            f"within {self.timeout_s:.1f} s")
                    time.sleep(self.POLL_S)
                    continue
                in_flight.popleft()
                self._slots.release()
                if status < 0:
                    if tries <= self.RETRIES and error is None:
                        pending.appendleft((seg, tries))
                    else:
                        error = error or (f"Mooncake read from {session} failed (status "
                                          f"{status}, {tries} attempts)")
                        pending.clear()
        finally:
            for _ in in_flight:     # timed out: these may never end; free their slots
                self._slots.release()
        if error is not None:
            raise TransferError(error)
        if total >= self.RATE_MIN_BYTES:     # smaller ones measure latency more than rate
            self._observe(total / max(time.monotonic() - t0, 1e-9))
        return total

    def _take_slot(self, wait: bool, deadline: float) -> bool:
        """One place in the window: waits (until `deadline`, then TransferError) only when
        `wait`, i.e. when the caller has no read in flight to wait for instead."""
        if not wait:
            return self._slots.acquire(blocking=False)
        if self._slots.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return True
        raise TransferError(f"no Mooncake read could start within {self.timeout_s:.1f} s "
                            f"({self.MAX_IN_FLIGHT} reads of other loads in flight)")

    def _observe(self, rate: float) -> None:
        """Mutates `rate`: the new read's rate, or 0.9x the old one if higher (a slower
        read, e.g. one sharing the link with others, must not make the first sleep of
        a later, faster read overshoot; an estimate too high only costs extra checks)."""
        self.rate = max(rate, 0.9 * self.rate)
