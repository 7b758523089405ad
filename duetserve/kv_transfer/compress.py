"""int8 compression of KV for transfer (optional, `--kv-transfer-compression int8` on the
prefill instance): each token's head_dim values of each (layer, k|v, head) plane are sent
as int8 with one float32 scale (absmax / 127): a per-head, per-token scale (one scale per
block and head was measured first: too coarse, see docs/benchmarks.md). A float32 cache
moves about 1/4 (+ 4 bytes per head_dim values) of the bytes, a bfloat16 one about 1/2. The decode instance dequantizes into
its cache, so attention runs on the rounded values: accuracy is measured in
docs/benchmarks.md (greedy agreement and KL against uncompressed).

The staging area mirrors the cache block for block (slot b holds block b), so no
allocator is needed: a block held by two requests is packed twice into the same slot.

    data   [planes, num_blocks, block_size, head_dim]  int8
    scales [planes, num_blocks, block_size]            float32
"""
from __future__ import annotations

import torch

from duetserve.kv_transfer.layout import KVLayout
from duetserve.kv_transfer.memory import SharedKVMemory

COMPRESSIONS = ("none", "int8")


def staging_layouts(layout: KVLayout) -> tuple[KVLayout, KVLayout]:
    """(data, scales) layouts: `segments()` works on them as on the cache."""
    data = KVLayout(layout.num_layers, layout.num_kv_heads, layout.num_blocks,
                    layout.block_size, layout.head_dim, "int8")
    scales = KVLayout(layout.num_layers, layout.num_kv_heads, layout.num_blocks,
                      layout.block_size, 1, "float32")
    return data, scales


class Int8Staging:
    """Shareable int8 staging memory for one cache (`cache`: the cache tensor's
    [planes, num_blocks, block_size * head_dim] view)."""

    def __init__(self, layout: KVLayout, cache: torch.Tensor) -> None:
        self.data_layout, self.scales_layout = staging_layouts(layout)
        self.memory = SharedKVMemory(self.data_layout.nbytes + self.scales_layout.nbytes,
                                     populate=True)
        planes, nb, bs = layout.num_planes, layout.num_blocks, layout.block_size
        self.data = self.memory.tensor[:self.data_layout.nbytes].view(torch.int8) \
            .view(planes, nb, bs, layout.head_dim)
        self.scales = self.memory.tensor[self.data_layout.nbytes:].view(torch.float32) \
            .view(planes, nb, bs)
        self.scales_offset = self.data_layout.nbytes
        self.cache = cache.view(planes, nb, bs, layout.head_dim)

    layouts_of = staticmethod(staging_layouts)

    def pack(self, block_ids: list[int]) -> None:
        """Quantize the cache's blocks into their staging slots. Mutates the slots."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        x = self.cache.index_select(1, ids).float()              # [planes, n, B, hd]
        scale = x.abs().amax(dim=3).clamp_min(1e-12) / 127.0     # [planes, n, B]
        q = torch.round(x / scale.unsqueeze(3)).clamp_(-127, 127).to(torch.int8)
        self.data.index_copy_(1, ids, q)
        self.scales.index_copy_(1, ids, scale)

    def unpack(self, block_ids: list[int]) -> None:
        """Dequantize staging slots into the cache's blocks. Mutates those blocks."""
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.long)
        q = self.data.index_select(1, ids).float()
        x = q * self.scales.index_select(1, ids).unsqueeze(3)
        self.cache.index_copy_(1, ids, x.to(self.cache.dtype))
