"""The engine's part in the prefix cache's disk tier (`--kv-store DIR`): opens the store
under the model's fingerprint and, on the engine thread, each step

    poll        loads that ended -> Scheduler.finish_disk_load (the request runs from
                what was verified)
    start_loads requests the scheduler admitted to load -> a reader thread each
    write       blocks the step computed -> their bytes copied, queued for the writer

The scheduler decides (core/disk_tier.py), kv_transfer/disk_io.py moves bytes,
kv_transfer/disk_store.py owns the files.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from duetserve.config import ConfigError, EngineConfig, ModelConfig
from duetserve.core.disk_tier import DiskLoad, DiskTier
from duetserve.kv_transfer.disk_io import DiskBlockIO, plane_bytes
from duetserve.kv_transfer.disk_store import DiskKVStore, file_identity
from duetserve.loader import LoadedModel

log = logging.getLogger("duetserve.kv_store")
FORMAT = 2          # bump when a block's payload layout changes (2: int8 keys rotated)


def store_fingerprint(config: EngineConfig, loaded: LoadedModel, mcfg: ModelConfig,
                      kv_dtype: torch.dtype, planes: list[torch.Tensor]) -> dict:
    """Everything that decides a block's bytes: the model file's identity (path, size,
    mtime: disk_store.file_identity says why not a content hash), the compute dtype, the
    weight quantization, the KV dtype, block size and layout (planes, KV groups), and
    the kernels that change the numbers (switches, and the dense GEMMs' dtype that
    `--dtype auto` measures)."""
    policy = loaded.kernel_policy
    return {"format": FORMAT, "model": file_identity(loaded.path),
            "dtype": str(loaded.dtype), "quantization": config.quantization,
            "dense_dtype": str(policy.dense_dtype if policy else loaded.dtype),
            "quant_summary": loaded.quant_summary,
            "kv_cache_dtype": config.kv_cache_dtype, "kv_dtype": str(kv_dtype),
            "block_size": config.block_size,
            "planes": [[[p.shape[0], *p.shape[2:]], str(p.dtype)] for p in planes],
            "kv_groups": [[g.window, list(g.layer_ids)] for g in mcfg.kv_groups()],
            "kernels": {k: getattr(config, k) for k in ("native_kernels", "kquant_forms",
                                                        "deterministic", "amx",
                                                        "prefill_attention")}}


class DiskCache:
    def __init__(self, io: DiskBlockIO, tier: DiskTier) -> None:
        self.io, self.tier = io, tier
        self._event = threading.Event()
        self.on_wake: Callable[[], None] = lambda: None     # the async engine's wake-up
        io.wake = self._wake
        self._in_flight = 0
        self._loads: dict[str, DiskLoad] = {}      # started, not polled

    def _wake(self) -> None:
        self._event.set()
        self.on_wake()

    def poll(self, scheduler) -> None:
        """Loads that ended: their requests run from what was verified."""
        for req_id, num_blocks in self.io.poll():
            self._in_flight -= 1
            load = self._loads.pop(req_id)
            scheduler.finish_disk_load(req_id, load.base_tokens
                                       + num_blocks * self.tier.block_size)

    def start_loads(self) -> None:
        for load in self.tier.take_loads():
            self._loads[load.req_id] = load
            self._in_flight += 1
            self.io.start_load(load.req_id, load.blocks)

    def write(self) -> None:
        """The blocks the last step filled, copied and queued for the store."""
        writes = self.tier.take_writes()
        if writes:
            self.io.write(writes)

    def wait_if_idle(self, scheduler) -> None:
        """Nothing to run but loads in flight (an offline caller steps in a loop): wait
        for one to end instead of spinning."""
        if self._in_flight and not self.io.has_results \
                and not scheduler.has_schedulable_requests():
            self._event.wait(1.0)
        self._event.clear()

    @property
    def has_results(self) -> bool:
        return self.io.has_results

    def close(self) -> None:
        self.io.close()


def open_disk_cache(config: EngineConfig, loaded: LoadedModel, mcfg: ModelConfig,
                    kv_dtype: torch.dtype, kv_caches: list) -> DiskCache | None:
    """The disk tier for config.kv_store (None without one). Raises ConfigError for a
    model with several KV groups (sliding-window layers: not supported)."""
    if config.kv_store is None:
        return None
    if len(mcfg.kv_groups()) > 1:
        raise ConfigError("--kv-store supports models whose layers all attend to the whole "
                          f"context; this one has {len(mcfg.kv_groups())} KV groups "
                          "(sliding-window layers)")
    planes = [t for layer in kv_caches for t in layer]
    try:
        store = DiskKVStore(config.kv_store, store_fingerprint(config, loaded, mcfg,
                                                               kv_dtype, planes),
                            int(config.kv_store_max_gib * 2**30),
                            sum(plane_bytes(p) for p in planes))
    except OSError as e:
        raise ConfigError(f"--kv-store {config.kv_store}: {e}") from None
    snap = store.snapshot()
    log.info("KV store %s: %d blocks (%.2f GiB of %.2f GiB)", store.dir, snap.files,
             snap.bytes / 2**30, config.kv_store_max_gib)
    cache = DiskCache(DiskBlockIO(store, planes),
                      DiskTier(store.contains, config.block_size))
    return cache
