"""int8 compression of KV for transfer (optional, `--kv-transfer-compression int8` on the
prefill instance), with scales shaped as KIVI shapes them:

    K: one scale per channel (head_dim value) over the block's tokens: a few key
       channels carry outliers far larger than the rest, and a per-token scale let
       them set the step of every value of the token (docs/results.md: 4/8 greedy
       outputs identical with per-token scales);
    V: one scale per token over its head_dim values (values have no such channels).

Scales are absmax / 127, stored as float16 (at least 2**-14, so they stay normal). A
float32 cache moves about 28% of its bytes (int8 values + head_dim or block_size float16
scales per block and plane), a bfloat16 one about 56%. The decode instance dequantizes
into its cache, so attention runs on the rounded values: accuracy is measured in
docs/results.md (greedy agreement and KL against uncompressed).

The staging area mirrors the cache block for block (slot b holds block b), so no
allocator is needed: a block held by two requests is packed twice into the same slot.

    data   [layers, 2 (k, v), kv_heads, num_blocks, block_size, head_dim]  int8
    scales [layers, 2 (k, v), kv_heads, num_blocks, S]                     float16
           S = max(block_size, head_dim); K uses [:head_dim], V uses [:block_size]
"""
from __future__ import annotations

import torch

from duetserve.kv_transfer.layout import KVLayout, block_runs
from duetserve.kv_transfer.memory import SharedKVMemory

MIN_SCALE = 2.0 ** -14          # the smallest normal float16


def staging_layouts(layout: KVLayout) -> tuple[KVLayout, KVLayout]:
    """(data, scales) layouts: `segments()` works on them as on the cache."""
    data = KVLayout(layout.num_layers, layout.num_kv_heads, layout.num_blocks,
                    layout.block_size, layout.head_dim, "int8_raw")
    scales = KVLayout(layout.num_layers, layout.num_kv_heads, layout.num_blocks,
                      1, max(layout.block_size, layout.head_dim), "float16")
    return data, scales


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(start, count) of consecutive ids, so each run is one strided view."""
    return [(s, n) for s, _, n in block_runs(block_ids, block_ids)]


class Int8Staging:
    """Shareable int8 staging memory for one cache (`cache`: the cache tensor's
    [planes, num_blocks, block_size * head_dim] view)."""

    def __init__(self, layout: KVLayout, cache: torch.Tensor) -> None:
        self.data_layout, self.scales_layout = staging_layouts(layout)
        self.memory = SharedKVMemory(self.data_layout.nbytes + self.scales_layout.nbytes,
                                     populate=True)
        L, H, nb = layout.num_layers, layout.num_kv_heads, layout.num_blocks
        bs, hd = layout.block_size, layout.head_dim
        self.block_size, self.head_dim = bs, hd
        self.data = self.memory.tensor[:self.data_layout.nbytes].view(torch.int8) \
            .view(L, 2, H, nb, bs, hd)
        self.scales = self.memory.tensor[self.data_layout.nbytes:].view(torch.float16) \
            .view(L, 2, H, nb, max(bs, hd))
        self.scales_offset = self.data_layout.nbytes
        self.cache = cache.view(L, 2, H, nb, bs, hd)

    layouts_of = staticmethod(staging_layouts)

    def pack(self, block_ids: list[int]) -> None:
        """Quantize the cache's blocks into their staging slots. Mutates the slots.
        Layer by layer: the temporaries stay small and are reused by the allocator
        (fresh large ones cost a page fault per 4 KiB)."""
        bs, hd = self.block_size, self.head_dim
        for s, n in _runs(block_ids):
            for layer in range(self.cache.shape[0]):
                x = self.cache[layer, :, :, s:s + n]                  # [2, H, n, bs, hd]
                k_scale = _scale(x[0], 2)                               # [H, n, hd]
                v_scale = _scale(x[1], 3)                               # [H, n, bs]
                self.scales[layer, 0, :, s:s + n, :hd] = k_scale
                self.scales[layer, 1, :, s:s + n, :bs] = v_scale
                q = self.data[layer, :, :, s:s + n]
                q[0] = (x[0] * k_scale.float().reciprocal_().unsqueeze(2)) \
                    .round_().clamp_(-127, 127)
                q[1] = (x[1] * v_scale.float().reciprocal_().unsqueeze(3)) \
                    .round_().clamp_(-127, 127)

    def unpack(self, block_ids: list[int]) -> None:
        """Dequantize staging slots into the cache's blocks. Mutates those blocks (and
        nothing shared: reader threads of different loads may call it at once)."""
        bs, hd = self.block_size, self.head_dim
        for s, n in _runs(block_ids):
            for layer in range(self.cache.shape[0]):
                out = self.cache[layer, :, :, s:s + n]
                out.copy_(self.data[layer, :, :, s:s + n])
                out[0].mul_(self.scales[layer, 0, :, s:s + n, :hd].float().unsqueeze(2))
                out[1].mul_(self.scales[layer, 1, :, s:s + n, :bs].float().unsqueeze(3))


def _scale(x: torch.Tensor, dim: int) -> torch.Tensor:
    """absmax / 127 over `dim` as float16 (amax and amin: abs() would copy x)."""
    absmax = torch.maximum(x.amax(dim=dim), x.amin(dim=dim).neg_()).float()
    return (absmax / 127.0).clamp_(min=MIN_SCALE).to(torch.float16)
