"""KVConnector: the engine-facing side of a transfer.

    producer (prefill instance)                    consumer (decode instance)
    ───────────────────────────                    ──────────────────────────
    hold(req, blocks, first token) -> RemotePrefill start_load(req, remote, dst blocks)
      PENDING until release() or the deadline        reader thread: TRANSFERRING
    poll() -> blocks to free (done or timed out)     poll() -> loads done | failed

NOTE: the engine thread calls hold/start_load/poll. The server's event loop calls
`published` (a read of a dict entry written before the request's last output was
delivered) and `post_release` (a thread-safe queue), and reader threads only write the
destination blocks of their own load and then append to a thread-safe queue. `wake()`
asks the engine thread to poll (it may be idle).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from duetserve.kv_transfer.backends import MooncakeAgent, ShmReader, TransferError
from duetserve.kv_transfer.compress import Int8Staging
from duetserve.kv_transfer.config import KVTransferConfig
from duetserve.kv_transfer.layout import KVLayout, segments
from duetserve.kv_transfer.memory import SharedKVMemory
from duetserve.kv_transfer.params import KVSource, PeerRegion, RemotePrefill
from duetserve.kv_transfer.state import Transfer, TransferTable
from duetserve.outputs import Logprob

log = logging.getLogger("duetserve.kv_transfer")

# fn(transfer, backend) on the engine thread when a transfer ends (metrics, trace).
TransferObserver = Callable[[Transfer, str], None]


@dataclass(slots=True)
class LoadResult:
    req_id: str
    ok: bool
    error: str | None


@dataclass
class BackendTotals:
    """Cumulative per backend (read by /metrics)."""

    bytes: int = 0
    seconds: float = 0.0
    transfers: int = 0
    failures: int = 0


class KVConnector:
    def __init__(self, config: KVTransferConfig, layout: KVLayout, memory: SharedKVMemory,
                 hostname: str) -> None:
        self.config = config
        self.layout = layout
        self.memory = memory
        self.table = TransferTable()
        self.wake: Callable[[], None] = lambda: None
        self.observers: list[TransferObserver] = []
        self.totals: dict[str, BackendTotals] = {}
        self._published: dict[str, RemotePrefill] = {}      # producer: req_id -> descriptor
        self._held: dict[str, str] = {}                     # producer: transfer_id -> req_id
        self._releases: deque[tuple[str, bool]] = deque()   # from the server
        # from readers: (transfer_id, ok, nbytes, error, seconds of the copy)
        self._loads_done: deque[tuple[str, bool, int, str | None, float]] = deque()
        self._load_backend: dict[str, str] = {}             # consumer: transfer_id -> name
        self.mooncake = MooncakeAgent(memory, config.host, config.timeout_s) \
            if config.uses_mooncake else None
        self.reader = None
        if config.role == "decode":
            self.reader = self.mooncake if config.backend == "mooncake" else ShmReader()
        # [planes, num_blocks, block_size * row_width] view of the cache (compress.py)
        self.cache = memory.view(getattr(torch, layout.storage_dtype), (
            layout.num_planes, layout.num_blocks, layout.block_size * layout.row_width))
        self.staging: Int8Staging | None = None
        self._staging_lock = threading.Lock()
        # a quantized cache (--kv-cache-dtype int8/int4) moves as stored: no staging
        if config.role == "prefill" and config.compression == "int8" and not layout.quantized:
            self._ensure_staging()
        staging = None if self.staging is None else PeerRegion(
            self.staging.memory.fd, self.staging.memory.base_addr, self.staging.memory.nbytes)
        self.source = KVSource(hostname, memory.pid, memory.fd, memory.base_addr, layout,
                               self.mooncake.session if self.mooncake else None, staging)

    def _ensure_staging(self) -> Int8Staging:
        """The int8 staging area, made (and registered with Mooncake) on first use."""
        with self._staging_lock:
            if self.staging is None:
                self.staging = Int8Staging(self.layout, self.cache)
                if self.mooncake is not None:
                    self.mooncake.register(self.staging.memory)
            return self.staging

    # -- producer ------------------------------------------------------------------------
    def hold(self, req_id: str, block_ids: list[int], num_tokens: int, first_token_id: int,
             first_logprobs: dict[int, Logprob] | None) -> RemotePrefill:
        """Publish a finished prefill's blocks; PENDING until released or timed out.
        Mutates: the table, the published map."""
        transfer_id = f"{req_id}:{uuid.uuid4().hex[:8]}"
        self.table.add(transfer_id, req_id, self.config.timeout_s)
        self._held[transfer_id] = req_id
        if self.staging is not None:
            self.staging.pack(block_ids)
        remote = RemotePrefill(transfer_id, self.source, list(block_ids), num_tokens,
                               first_token_id, first_logprobs,
                               compression="int8" if self.staging is not None else "none")
        self._published[req_id] = remote
        return remote

    def published(self, req_id: str) -> RemotePrefill | None:
        """The descriptor of a held request (any thread); forgotten once read."""
        return self._published.pop(req_id, None)

    def post_release(self, transfer_id: str, ok: bool) -> bool:
        """A decode instance finished reading (any thread); applied at the next poll.
        Returns whether the blocks were still held (not timed out), i.e. whether what it
        read was valid. NOTE: a transfer leaves _held before its blocks are freed."""
        held = transfer_id in self._held
        self._releases.append((transfer_id, ok))
        self.wake()
        return held

    # -- consumer ------------------------------------------------------------------------
    def start_load(self, req_id: str, remote: RemotePrefill, dst_block_ids: list[int],
                   num_skip_blocks: int, null_block_id: int | None = None) -> None:
        """Read the remote blocks past the first `num_skip_blocks` (already here: local
        prefix hits) into `dst_block_ids` (this load's blocks, same order) on a reader
        thread; pairs where either side is `null_block_id` (a sliding-window entry that
        side released or never needed) are not copied. Mutates: the table. The result
        comes out of poll()."""
        assert self.reader is not None, "start_load on an instance that is not a decode"
        t = self.table.add(remote.transfer_id, req_id, self.config.timeout_s)
        self.table.start(t.transfer_id)
        self._load_backend[t.transfer_id] = self.reader.name
        src_ids = remote.block_ids[num_skip_blocks:]
        dst_ids = dst_block_ids[num_skip_blocks:]
        if null_block_id is not None:
            pairs = [(a, b) for a, b in zip(src_ids, dst_ids)
                     if a != null_block_id and b != null_block_id]
            src_ids, dst_ids = [a for a, _ in pairs], [b for _, b in pairs]
        threading.Thread(target=self._read, args=(t.transfer_id, remote, src_ids, dst_ids),
                         name=f"kv-load-{req_id}", daemon=True).start()

    def _read(self, transfer_id: str, remote: RemotePrefill, src_ids: list[int],
              dst_ids: list[int]) -> None:
        """Reader thread: copy, report, then tell the prefill instance to free."""
        t0 = time.perf_counter()
        try:
            nbytes = self._copy(remote, src_ids, dst_ids)
            result = (transfer_id, True, nbytes, None, time.perf_counter() - t0)
        except (TransferError, ValueError, OSError) as e:
            result = (transfer_id, False, 0, str(e), time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - any failure ends this load, not the engine
            log.exception("KV load %s failed", transfer_id)
            result = (transfer_id, False, 0, f"{type(e).__name__}: {e}",
                      time.perf_counter() - t0)
        if remote.release_url:
            answer = _post_json(remote.release_url, {"transfer_id": transfer_id,
                                                     "ok": result[1]})
            if result[1] and answer is not None and answer.get("held") is False:
                # NOTE: the prefill instance freed the blocks (timeout) before the read
                # ended: they may have been reused, so the bytes cannot be trusted.
                result = (transfer_id, False, 0, "the prefill instance had already freed "
                          "the KV (its --kv-transfer-timeout passed) when the read ended",
                          result[4])
        self._loads_done.append(result)
        self.wake()

    def _copy(self, remote: RemotePrefill, src_ids: list[int], dst_ids: list[int]) -> int:
        """Reader thread: the blocks' bytes, straight or through the int8 staging areas."""
        source = remote.source
        if remote.compression == "none":
            segs = segments(source.layout, self.layout, src_ids, dst_ids)
            return self.reader.read(source, source.cache, self.memory, segs)
        if remote.compression != "int8" or source.staging is None:
            raise TransferError(f"unknown KV compression {remote.compression!r}")
        staging = self._ensure_staging()
        src_data, src_scales = Int8Staging.layouts_of(source.layout)
        segs = segments(src_data, staging.data_layout, src_ids, dst_ids)
        off_src, off_dst = src_data.nbytes, staging.scales_offset
        segs += [(s + off_src, d + off_dst, n) for s, d, n in
                 segments(src_scales, staging.scales_layout, src_ids, dst_ids)]
        nbytes = self.reader.read(source, source.staging, staging.memory, segs)
        staging.unpack(dst_ids)
        return nbytes

    # -- engine thread -------------------------------------------------------------------
    def poll(self) -> tuple[list[str], list[LoadResult]]:
        """Apply releases, finished loads and deadlines. Returns (producer req_ids whose
        held blocks must be freed now, consumer loads that ended). Mutates the table."""
        free: list[str] = []
        loads: list[LoadResult] = []
        while self._releases:
            transfer_id, ok = self._releases.popleft()
            t = self.table.finish(transfer_id, ok, self._nbytes(transfer_id),
                                  None if ok else "the decode instance reported a failure")
            if t is not None and self._held.pop(transfer_id, None) is not None:
                self._ended(t, "held")
                free.append(t.req_id)
        while self._loads_done:
            transfer_id, ok, nbytes, error, seconds = self._loads_done.popleft()
            t = self.table.finish(transfer_id, ok, nbytes, error, seconds)
            if t is not None:       # None: timed out before, already reported failed
                self._ended(t, self._load_backend.pop(transfer_id, "?"))
                loads.append(LoadResult(t.req_id, ok, error))
        for t in self.table.expire():
            if self._held.pop(t.transfer_id, None) is not None:
                log.warning("KV of %s not taken within %.1f s: blocks freed", t.req_id,
                            self.config.timeout_s)
                self._published.pop(t.req_id, None)
                self._ended(t, "held")
                free.append(t.req_id)
            else:
                self._ended(t, self._load_backend.pop(t.transfer_id, "?"))
                loads.append(LoadResult(t.req_id, False, f"KV transfer timed out after "
                                        f"{self.config.timeout_s:.1f} s"))
        return free, loads

    def _nbytes(self, transfer_id: str) -> int:
        req_id = self._held.get(transfer_id)
        remote = self._published.get(req_id) if req_id else None
        return 0 if remote is None else len(remote.block_ids) * self.layout.bytes_per_block

    def _ended(self, t: Transfer, backend: str) -> None:
        if backend != "held":
            tot = self.totals.setdefault(backend, BackendTotals())
            tot.transfers += 1
            tot.bytes += t.nbytes
            tot.seconds += t.seconds if t.seconds is not None else \
                (t.finished or 0.0) - (t.started or t.finished or 0.0)
            tot.failures += 0 if t.status.value == "done" else 1
        for fn in self.observers:
            try:
                fn(t, backend)
            except Exception:  # noqa: BLE001
                log.exception("transfer observer failed")

    def seconds_to_next_deadline(self) -> float | None:
        return self.table.seconds_to_next_deadline()

    @property
    def has_pending_results(self) -> bool:
        return bool(self._releases or self._loads_done)

    @property
    def num_held(self) -> int:
        return len(self._held)


def _post_json(url: str, body: dict, timeout: float = 5.0) -> dict | None:
    """The answer, or None when there is none (a lost release is covered by the prefill
    instance's timeout)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except Exception as e:  # noqa: BLE001
        log.warning("KV release to %s failed: %s", url, e)
        return None
