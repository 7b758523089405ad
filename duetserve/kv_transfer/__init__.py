"""KV connector: moves a request's KV cache from a prefill instance to a decode instance.

    config.py     KVTransferConfig (role, backend, timeout), validated once
    params.py     the per-request control messages (block ids, addresses, sizes only)
    state.py      per-request transfer state: pending -> transferring -> done | failed
    layout.py     where a block's bytes live in a paged cache (torch-free arithmetic)
    memory.py     the KV cache in a shareable memory file (memfd)
    backends.py   byte movers: shared memory (same host), Mooncake Transfer Engine (TCP)
    connector.py  the engine-facing connector: producer holds, consumer loads, timeouts

The scheduler side decides (which requests send or receive, see core/remote_kv.py); the
worker side here moves bytes. Nothing here imports the engine, the worker or the core.
"""
from duetserve.kv_transfer.config import BACKENDS, ROLES, KVTransferConfig

__all__ = ["BACKENDS", "ROLES", "KVTransferConfig"]
