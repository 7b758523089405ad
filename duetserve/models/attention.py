"""Attention over a paged KV cache.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads,
head_dim]`. A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

`AttentionMetadata` is built once per step by the runner and shared by every layer.
Token order in the flat batch: decode tokens first (one per sequence), then each
prefill sequence's chunk, contiguous:

    [ d0 d1 ... d_{D-1} | p0 p0 p0 ... | p1 p1 ... | ... ]
      num_decode_tokens   prefills[0]    prefills[1]

`AttentionBackend` is the interface a GPU backend would implement; `TorchAttention`
is the CPU implementation in plain torch (scaled_dot_product_attention).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with more than one new token (or a single token with a cached
    prefix that is not a decode: treated alike)."""

    start: int                    # first token index in the flat batch
    end: int                      # one past the last
    ctx_slots: torch.Tensor       # [L] slots of the whole context (cached + new), L >= end-start
    mask: torch.Tensor | None     # [n, L] bool, None when L == n (plain causal)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                        # [T] where each new token's K/V goes
    num_decode_tokens: int = 0
    decode_ctx_slots: torch.Tensor | None = None      # [D, Lmax] (padded)
    decode_mask: torch.Tensor | None = None           # [D, 1, 1, Lmax] bool, True = attend
    cos: torch.Tensor | None = None                   # [T, 1, hd] rotary, gathered once per step
    sin: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)


class AttentionBackend:
    """Computes attention for one layer. Mutates `kv_cache` (writes the new K/V at
    `meta.slot_mapping`) and returns the attention output [T, H, D]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gqa = num_heads != num_kv_heads
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, kv_cache, meta):
        k_cache, v_cache = kv_cache
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        # NOTE: every token's K/V is written before any read, so a sequence may attend to
        # blocks another sequence of the same step is filling (shared-prefix siblings).
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], k_flat, v_flat, meta)
        for p in meta.prefills:
            qp = q[p.start:p.end].transpose(0, 1)                # [H, n, hd]
            if p.mask is None:   # no cached prefix: the new K/V are the whole context
                kp = k[p.start:p.end].transpose(0, 1)
                vp = v[p.start:p.end].transpose(0, 1)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True,
                                                    enable_gqa=self.gqa)
            else:
                kp = k_flat[p.ctx_slots].transpose(0, 1)         # [KVH, L, hd]
                vp = v_flat[p.ctx_slots].transpose(0, 1)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask,
                                                    enable_gqa=self.gqa)
            out[p.start:p.end] = op.transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence. Plain matmuls: the fused CPU kernel has a large fixed
        cost per call that dominates at one query row."""
        d = q.shape[0]
        g = self.num_heads // self.num_kv_heads
        qg = q.view(d, self.num_kv_heads, g, self.head_dim)             # [D, KVH, G, hd]
        kd = k_flat[meta.decode_ctx_slots].permute(0, 2, 3, 1)          # [D, KVH, hd, L]
        vd = v_flat[meta.decode_ctx_slots].transpose(1, 2)              # [D, KVH, L, hd]
        scores = torch.matmul(qg, kd) * self.scale                      # [D, KVH, G, L]
        scores.masked_fill_(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, vd).view(d, self.num_heads, self.head_dim)
