"""EngineConfig.kv_prefault: the KV cache's pages are mapped at start, so the first use of
a block takes no page faults (by default they are mapped as blocks are first used)."""
from __future__ import annotations

import os
import resource

import pytest
import torch
from proc_maps import vm_flags

from duetserve.config import ModelConfig
from duetserve.worker.kv_cache import allocate_kv_cache

PAGE = 4096


def _config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=64, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       rms_norm_eps=1e-5, rope_theta=10000.0)


def _faults_writing_every_page(caches) -> int:
    base = caches[0][0]
    # the views share one tensor: write one element per page of the whole cache
    flat = torch.as_strided(base, (base.untyped_storage().nbytes() // 4,), (1,), 0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    flat[::PAGE // 4] = 1.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_prefault_maps_the_cache_at_allocation() -> None:
    cfg = _config()
    num_blocks = 1024                                 # 4 layers x 2 x 2 heads x 4 KiB blocks
    pages = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * num_blocks * 16 * 16 * 4 \
        // PAGE
    lazy = allocate_kv_cache(cfg, num_blocks, 16, torch.float32, "cpu")
    assert float(lazy[0][0].abs().sum()) == 0.0       # reads as zeros (reading maps no page
    assert _faults_writing_every_page(lazy) >= pages // 2   # ... for writing: the zero page)
    eager = allocate_kv_cache(cfg, num_blocks, 16, torch.float32, "cpu", prefault=True)
    assert float(eager[-1][1].abs().sum()) == 0.0
    assert _faults_writing_every_page(eager) < pages // 20


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_a_prefaulted_cache_asks_for_huge_pages_and_a_lazy_one_refuses_them() -> None:
    """Prefaulted, every page is written at start, so 2 MiB pages cost nothing later and
    spare the scattered blocks of a serving pool a TLB miss each (worker/kv_cache.py);
    lazily mapped, a block's first write would fault a whole 2 MiB page."""
    cfg = _config()
    lazy = allocate_kv_cache(cfg, 1024, 16, torch.float32, "cpu")
    eager = allocate_kv_cache(cfg, 1024, 16, torch.float32, "cpu", prefault=True)
    assert "nh" in vm_flags(lazy[0][0].data_ptr())        # MADV_NOHUGEPAGE
    assert "hg" in vm_flags(eager[0][0].data_ptr())       # MADV_HUGEPAGE
    assert "hg" not in vm_flags(lazy[0][0].data_ptr())
