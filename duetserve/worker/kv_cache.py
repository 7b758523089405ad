"""KV cache sizing and allocation.

One tensor for all layers: [layers, 2 (k, v), kv_heads, num_blocks, block_size, head_dim];
layer i uses (cache[i, 0], cache[i, 1]), each [kv_heads, num_blocks, block_size, head_dim].

NOTE: heads first (not [num_blocks, block_size, kv_heads, head_dim]) so that gathering a
sequence's blocks yields, per KV head, a contiguous [context, head_dim] matrix: attention
reads the cache with one gather and no transpose copy.
"""
from __future__ import annotations

import numpy as np
import torch

from duetserve.config import ModelConfig

GiB = 1 << 30


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes per token of a `dtype` cache (ModelConfig's formula), exact."""
    return int(cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()))


def num_blocks_for_memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int,
                          memory_gib: float) -> int:
    per_block = kv_bytes_per_token(cfg, dtype) * block_size
    return max(1, int(memory_gib * GiB) // per_block)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed CPU tensor whose pages are mapped on first touch: numpy's zeros come from
    calloc (fresh zero pages for large sizes), so an idle KV cache costs no resident
    memory (torch.zeros writes every byte). Zeroed so that padded slots read by masked
    attention (the gather fallback) hold finite values."""
    elem = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * elem, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: str | torch.device
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, num_blocks, block_size,
             cfg.head_dim)
    cache = _lazy_zeros(shape, dtype) if str(device) == "cpu" else \
        torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_hidden_layers)]
