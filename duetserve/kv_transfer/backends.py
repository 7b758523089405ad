"""Byte movers: read a set of byte segments of a peer's KV memory into this instance's.

    ShmReader        same host: map the peer's memory file, copy with numpy (memcpy)
    MooncakeAgent    Mooncake Transfer Engine, protocol tcp, P2P handshake (no etcd):
                     one batch_transfer_sync_read of every segment

`read(source, peer, local, segs)` copies `(src_offset, dst_offset, nbytes)` segments
(layout.segments) from the peer's memory region to this instance's `local` memory and
returns the bytes moved, or raises TransferError. Only the reader thread of one load
calls it; the destination blocks belong to that load alone.
"""
from __future__ import annotations

import os
import socket
import threading

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

    def __init__(self, memory: SharedKVMemory, host: str) -> None:
        why = mooncake_available()
        if why is not None:
            raise TransferError(why)
        from mooncake.engine import TransferEngine
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, tcp) failed: {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.register(memory)

    def register(self, memory: SharedKVMemory) -> None:
        """Make `memory` readable by peers and writable by reads."""
        rc = self.engine.register_memory(memory.base_addr, memory.nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {memory.nbytes} bytes failed: {rc}")

    def read(self, source: KVSource, peer: PeerRegion, local: SharedKVMemory,
             segs: list[tuple[int, int, int]]) -> int:
        if not source.mooncake_session:
            raise TransferError("the prefill instance did not publish a Mooncake session "
                                "(start it with Mooncake available)")
        if not segs:
            return 0
        rc = self.engine.batch_transfer_sync_read(
            source.mooncake_session, [local.base_addr + d for _, d, _ in segs],
            [peer.addr + s for s, _, _ in segs], [n for _, _, n in segs])
        if rc != 0:
            raise TransferError(f"Mooncake read from {source.mooncake_session} failed "
                                f"(return code {rc})")
        return sum(n for _, _, n in segs)
