"""The worker's side of the prefix cache's disk tier: a block's bytes between the paged
KV cache and the store (disk_store.py). What to read and write is decided by the
scheduler (core/disk_tier.py); items arrive as (block id, hash, parent hash, token ids).

A block's payload is every cache plane's slice of that block id, planes in order, as raw
bytes: for each layer its K and V views (and any further per-block tensors the cache
keeps, e.g. quantization scales), each [kv_heads, num_blocks, ...] with the block id on
dimension 1. The bytes are opaque here: a quantized cache stores its own form, and the
fingerprint (engine/disk_cache.py) keeps each form in its own directory.

    write (engine thread, after a step): gather the blocks of every plane (one
        index_select each), one contiguous [n, payload] copy -> store.put (queued)
    load (a reader thread per request): store.read each block in order, stop at the
        first miss, index_copy_ the verified ones into their blocks; report how many
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

from duetserve.kv_transfer.disk_store import DiskKVStore

log = logging.getLogger("duetserve.kv_store")


def plane_bytes(plane: torch.Tensor) -> int:
    """Bytes of one block of a [heads, num_blocks, ...] plane."""
    return plane[:, 0].numel() * plane.element_size()


class DiskBlockIO:
    def __init__(self, store: DiskKVStore, planes: Sequence[torch.Tensor]) -> None:
        self.store = store
        self.planes = list(planes)
        self.payload_bytes = sum(plane_bytes(p) for p in self.planes)
        if self.payload_bytes != store.payload_bytes:
            raise ValueError(f"the store expects {store.payload_bytes} B blocks, the cache "
                             f"has {self.payload_bytes}")
        self.wake: Callable[[], None] = lambda: None
        self._done: deque[tuple[str, int]] = deque()     # (req_id, blocks loaded)
        self._threads: list[threading.Thread] = []

    # -- bytes ---------------------------------------------------------------------------
    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """[n, payload_bytes] uint8 on the CPU: the blocks' bytes, one row per block (a
        copy)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.planes[0].device)
        n = len(block_ids)
        return torch.cat([p.index_select(1, idx).movedim(1, 0).reshape(n, -1)
                          .view(torch.uint8) for p in self.planes], dim=1).cpu()

    def scatter(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """Write [n, payload_bytes] uint8 rows into the blocks (the inverse of gather)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.planes[0].device)
        rows = rows.to(self.planes[0].device)
        n, offset = len(block_ids), 0
        for p in self.planes:
            nbytes = plane_bytes(p)
            part = rows[:, offset:offset + nbytes].contiguous().view(p.dtype)
            p.index_copy_(1, idx, part.view(n, *p[:, 0].shape).movedim(0, 1))
            offset += nbytes

    # -- writes (engine thread) ----------------------------------------------------------
    def write(self, items: Sequence) -> None:
        """Queue the items' blocks for the store (their bytes copied now)."""
        items = [it for it in items if not self.store.contains(it.block_hash)]
        if not items:
            return
        rows = self.gather([it.block_id for it in items]).numpy()
        for it, row in zip(items, rows):
            self.store.put(it.block_hash, it.parent_hash, it.token_ids, row)

    # -- loads ---------------------------------------------------------------------------
    def start_load(self, req_id: str, items: Sequence) -> None:
        """Read the items' blocks on a thread; poll() reports how many arrived."""
        t = threading.Thread(target=self._load, args=(req_id, list(items)),
                             name=f"kv-store-load-{req_id}", daemon=True)
        self._threads = [th for th in self._threads if th.is_alive()] + [t]
        t.start()

    def _load(self, req_id: str, items: list) -> None:
        """Reader thread: the verified leading blocks into the cache, then report."""
        n = 0
        try:
            payloads = []
            for it in items:
                data = self.store.read(it.block_hash, it.parent_hash, it.token_ids)
                if data is None:
                    break
                payloads.append(data)
            if payloads:
                rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
                self.scatter([it.block_id for it in items[:len(payloads)]],
                             rows.view(len(payloads), self.payload_bytes))
            n = len(payloads)
        except Exception:  # noqa: BLE001 - a failed read is a miss, never the engine's end
            log.exception("KV store: loading blocks for %s failed", req_id)
            n = 0
        self._done.append((req_id, n))
        self.wake()

    def poll(self) -> list[tuple[str, int]]:
        """(req_id, blocks loaded) of the loads that ended since the last poll."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    @property
    def has_results(self) -> bool:
        return bool(self._done)

    def close(self) -> None:
        """Wait for the loads in flight and the queued writes. Idempotent."""
        for t in self._threads:
            t.join()
        self.store.close()
