"""Prometheus series of the prefix cache's disk tier (`--kv-store`), on the server's
registry, refreshed from the store's counters after each step:

    duet:kv_store_blocks, duet:kv_store_bytes      what the store holds now (its index)
    duet:kv_store_writes_total, _write_bytes_total  blocks written
    duet:kv_store_writes_dropped_total              writes dropped (the queue was full)
    duet:kv_store_read_blocks_total, _read_bytes_total  blocks read back and verified
    duet:kv_store_corrupt_blocks_total              files that failed verification (a miss)
    duet:kv_store_evictions_total                   files deleted by the size cap

The prefix cache's hits per tier are ServerMetrics' (duet:prefix_cache_hits, _disk_hits,
duet:prefix_cache_hit_bytes{tier}). The store is duck-typed (snapshot() returns
kv_transfer/disk_store.py's StoreStats).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from duetserve.outputs import StepStats

COUNTERS = {"writes": "Blocks written to the KV store.",
            "write_bytes": "Bytes written to the KV store.",
            "writes_dropped": "KV store writes dropped because the writer's queue was full.",
            "hits": "Blocks read back from the KV store and verified.",
            "hit_bytes": "Bytes of blocks read back from the KV store.",
            "corrupt": "KV store files that failed verification (a miss; deleted).",
            "evictions": "KV store files deleted by its size cap (least recently used)."}
NAMES = {"hits": "read_blocks", "hit_bytes": "read_bytes", "corrupt": "corrupt_blocks"}


class KVStoreMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str,
                 snapshot: Callable[[], object], lock: threading.Lock) -> None:
        self._snapshot, self._lock = snapshot, lock
        self._counters = {k: Counter(f"duet:kv_store_{NAMES.get(k, k)}", doc,
                                     ["model_name"], registry=registry).labels(model_name)
                          for k, doc in COUNTERS.items()}
        self._last = dict.fromkeys(COUNTERS, 0)
        self.blocks = Gauge("duet:kv_store_blocks", "Blocks in the KV store.",
                            ["model_name"], registry=registry).labels(model_name)
        self.bytes = Gauge("duet:kv_store_bytes", "Bytes of the KV store's files.",
                           ["model_name"], registry=registry).labels(model_name)

    def observe_step(self, _: StepStats | None = None) -> None:
        """Engine thread: the store's counters as they are now."""
        snap = self._snapshot()
        with self._lock:
            self.blocks.set(snap.files)
            self.bytes.set(snap.bytes)
            for k, c in self._counters.items():
                new = getattr(snap, k)
                if new > self._last[k]:
                    c.inc(new - self._last[k])
                self._last[k] = new
