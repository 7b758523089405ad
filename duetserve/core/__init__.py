"""Pure-Python engine core: block pool, prefix cache, KV cache manager and scheduler.

NOTE: nothing under duetserve/core imports torch; it speaks block ids and token counts.
"""
from duetserve.core.block_pool import BlockPool, KVBlock
from duetserve.core.kv_cache_manager import KVCacheManager
from duetserve.core.request_queue import RequestQueue
from duetserve.core.scheduler import Scheduler, SchedulerStats

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "RequestQueue", "Scheduler",
           "SchedulerStats"]
