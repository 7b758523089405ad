"""Attention over a paged KV cache.

The KV cache of one layer is a pair of tensors `[num_kv_heads, num_blocks, block_size,
head_dim]` (heads first: see worker/kv_cache.py). A token at position p of a sequence lives
in slot `block_table[p // block_size] * block_size + p % block_size` of every head.

`AttentionMetadata` is built once per step by the runner and shared by every layer.
Token order in the flat batch: decode tokens first (one per sequence, sorted by context
length and cut into groups so that padding stays small), then each prefill sequence's
chunk, contiguous:

    [ d0 d1 ... d_{D-1} | p0 p0 p0 ... | p1 p1 ... | ... ]
      decode_groups       prefills[0]    prefills[1]

`AttentionBackend` is the interface a GPU backend would implement; `TorchAttention`
is the CPU implementation in plain torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from duetserve.models.kv_quant import (dequantize, int8_queries, is_quantized, quantize,
                                        rotate_keys)
from duetserve.models.layers import RotaryEmbedding

# A prefix chunk whose score matrix (heads x chunk x context) has at most this many
# elements runs TorchAttention._grouped (2 MiB of float32 scores at most); larger ones the
# two-part flash path, which materializes none (measured crossover on SmolLM2's heads,
# 2 threads: 0.6M scores level, 2.9M 24 ms vs 7 ms, 9.6M 97 ms vs 17 ms).
GROUPED_MAX_SCORES = 1 << 19

# torch's CPU flash attention with its log-sum-exp ([B, H, n] beside the output), which
# lets two partial attentions be merged exactly; None where this torch lacks it.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                          None)


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with more than one new token."""

    start: int                    # first token index in the flat batch
    end: int                      # one past the last
    ctx_slots: torch.Tensor       # [L] slots of the whole context (cached + new), L >= end-start
    mask: torch.Tensor | None     # [n, L] bool, None when L == n (no cached prefix)


@dataclass(slots=True)
class DecodeGroup:
    """Decode tokens [start, end) of the flat batch: one query per sequence."""

    start: int
    end: int
    block_table: torch.Tensor     # [G, num_blocks] (padded with block 0)
    mask: torch.Tensor            # [1, G, 1, num_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                        # [T] where each new token's K/V goes
    # Decode tokens [0, num_decodes): read in place by the native kernel through these...
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None   # [D, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None   # [D] int64
    # ... or, without it, gathered per group (padded tables and masks).
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
    cos: torch.Tensor | None = None                   # [T, 1, hd] rotary, gathered once per step
    sin: torch.Tensor | None = None
    # The KV group these tables are for (config.KVGroup: its layers share a block table):
    # its sliding window (None: full attention), and, on the step's metadata, one view per
    # group (None: a single group, this metadata itself). A view shares the token layout
    # and differs in slot_mapping, decode_block_tables, prefills' ctx_slots, window and
    # rotary rows.
    window: int | None = None
    groups: list["AttentionMetadata"] | None = None

    def group(self, g: int) -> "AttentionMetadata":
        """The metadata of KV group g (self for a single-group model)."""
        return self if self.groups is None else self.groups[g]


class AttentionBackend:
    """Computes attention for one layer. Mutates `kv_cache` (writes the new K/V at
    `meta.slot_mapping`) and returns the attention output [T, H, D]."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def forward_qkv(self, qkv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: AttentionMetadata) -> torch.Tensor:
        """From the fused projection qkv [T, (H + 2 KVH) hd]: rotary on Q and K, then
        `forward`. Backends may fuse the two. Mutates `kv_cache`."""
        t, hd = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        # Q and K rotated together: one set of ops for both.
        qk = RotaryEmbedding.apply(qkv[:, :q_size + kv_size].view(t, -1, hd), meta.cos,
                                   meta.sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [T, H, hd], [T, KVH, hd]
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, hd)
        return self.forward(q, k, v, kv_cache, meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """Prefill with the native causal kernel or torch's SDPA; decode with the native
    in-place paged kernel (models/native.py) when it is built, else with a gather per
    decode group. `window`: a sliding-window layer's W (a query at p attends to keys
    p-W+1..p); None: full attention. `scale`: the scores' scale (default head_dim^-0.5)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, window: int | None = None) -> None:
        from duetserve.models.native import ops
        native = ops()
        self.paged_decode = None if native is None else native.paged_decode_attention
        self.rope_kv_write = None if native is None else native.rope_kv_write
        self.prefill_native = None if native is None else native.prefill_attention
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gqa = num_heads != num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window
        self.window_arg = window or 0          # the native kernels' form (0: none)
        # Prompt chunks' flash attention (no cached prefix, or a long chunk after one) in
        # bfloat16, float32 softmax statistics: where the many-row steps run on AMX and
        # oneDNN's bf16 tiles measured faster than the float32 kernels
        # (kernels.finish_prefill_attention). Full-attention layers only.
        self.bf16_prefill = False
        # Every prompt chunk's attention (cached context or not) through the native
        # bfloat16 dot-product kernel (prefill_attention_bf16) where set: kernels.
        # finish_prefill_attention, where the CPU has AVX512-BF16 and it measured faster.
        self.bf16_kernel = None

    def forward_qkv(self, qkv, kv_cache, meta):
        """Decode-only steps with the native kernels: two calls per layer (rotary + cache
        write, then paged attention) instead of about a dozen torch ops."""
        if (self.rope_kv_write is None or meta.decode_block_tables is None or meta.prefills
                or qkv.dtype != torch.float32 or not qkv.is_contiguous()
                or meta.cos.dtype != torch.float32):
            return super().forward_qkv(qkv, kv_cache, meta)
        k_cache, v_cache = kv_cache
        q = self.rope_kv_write(qkv, meta.cos, meta.sin, k_cache, v_cache, meta.slot_mapping,
                               self.num_heads, self.num_kv_heads)
        return self.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                 meta.decode_context_lens, self.scale, self.window_arg)

    def forward(self, q, k, v, kv_cache, meta):
        k_cache, v_cache = kv_cache
        rb = k_cache.shape[-1]          # head_dim, or a quantized row's bytes
        k_flat = k_cache.view(self.num_kv_heads, -1, rb)   # [KVH, slots, rb]
        v_flat = v_cache.view(self.num_kv_heads, -1, rb)
        # NOTE: every token's K/V is written before any read, so a sequence may attend to
        # blocks another sequence of the same step is filling (shared-prefix siblings).
        kvd = k_cache.dtype             # may be narrower than q (--kv-cache-dtype)
        if k_cache.dtype == torch.int8:        # int8 keys are stored rotated (kv_quant)
            q, k = int8_queries(q), rotate_keys(k.float())
        if is_quantized(k_cache):
            # the chunk attends to its own K/V as stored (as a later chunk, a prefix hit
            # or a decode step reads them): the same results however a prompt is split
            kq, vq = quantize(k, kvd), quantize(v, kvd)
            k_flat.index_copy_(1, meta.slot_mapping, kq.transpose(0, 1))
            v_flat.index_copy_(1, meta.slot_mapping, vq.transpose(0, 1))
            k = dequantize(kq, self.head_dim, q.dtype)
            v = dequantize(vq, self.head_dim, q.dtype)
        else:
            k_flat.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(kvd))
            v_flat.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(kvd))
        if meta.decode_block_tables is not None and not meta.prefills:   # decode-only step
            return self._paged(q, k_cache, v_cache, meta)
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.num_decodes and meta.decode_block_tables is not None:
            out[:meta.num_decodes] = self._paged(q[:meta.num_decodes], k_cache, v_cache, meta)
        for g in meta.decode_groups:
            out[g.start:g.end] = self._decode(q[g.start:g.end], k_cache, v_cache, g)
        # the flash kernels' dtype (bf16_prefill); the small grouped path stays float32
        fd = torch.bfloat16 if self.bf16_prefill and self.window is None else q.dtype
        for p in meta.prefills:
            if self.bf16_kernel is not None and self._bf16_chunk(q, k, v, k_flat, v_flat, p,
                                                                 out):
                continue
            if p.mask is None and fd == q.dtype and self._native_prefill(q, k, v, p, out):
                continue
            qp = q[p.start:p.end].transpose(0, 1)                # [H, n, hd]
            if self.window is not None:
                op = self._window_prefill(qp, k, v, k_flat, v_flat, p)
            elif p.mask is None:   # no cached prefix: the new K/V are the whole context
                qp = qp.to(fd)
                kp = k[p.start:p.end].transpose(0, 1).to(fd)
                vp = v[p.start:p.end].transpose(0, 1).to(fd)
                # 4-D: torch's CPU flash kernel takes only [B, H, n, hd]; 3-D inputs
                # fall back to the math path (~4x slower at 512 tokens: an explicit
                # [H, n, n] score matrix, masked and softmaxed in separate passes)
                op = F.scaled_dot_product_attention(qp[None], kp[None], vp[None],
                                                    is_causal=True, enable_gqa=self.gqa,
                                                    scale=self.scale)[0]
            elif qp.shape[0] * qp.shape[1] * p.ctx_slots.shape[0] <= GROUPED_MAX_SCORES:
                kp = self._gather(k_flat, p.ctx_slots, q.dtype)  # [KVH, L, hd]
                vp = self._gather(v_flat, p.ctx_slots, q.dtype)
                op = self._grouped(qp, kp, vp, p.mask)
            else:
                kp = self._gather(k_flat, p.ctx_slots, fd)
                vp = self._gather(v_flat, p.ctx_slots, fd)
                op = self._after_prefix(qp.to(fd), kp, vp, p.mask)
            out[p.start:p.end] = op.transpose(0, 1)
        return out

    def _native_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        p: PrefillSeq, out: torch.Tensor) -> bool:
        """A prompt chunk without a cached prefix through the native causal kernel
        (csrc/prefill_attention.cpp: only the causal half of the scores; torch's flash
        kernel computes all of them below 512-key blocks). Writes out[p.start:p.end];
        False where it does not apply (no native build, neither float32 nor bfloat16,
        head size other than 64 or 128): the caller runs torch's SDPA.

        bfloat16 q/k/v (many-row steps computed in bf16) are widened to float32 for the
        kernel: 512 tokens of SmolLM2's heads, 2 threads: 3.4-5.1 ms against torch's bf16
        flash SDPA's 4.5-8.1 (and the softmax is float32)."""
        if self.prefill_native is None or any(
                t.dtype not in (torch.float32, torch.bfloat16) for t in (q, k, v)):
            return False
        o = self.prefill_native(q[p.start:p.end].float(), k[p.start:p.end].float(),
                                v[p.start:p.end].float(), self.scale, self.window_arg)
        if o.numel() == 0:
            return False
        out[p.start:p.end] = o
        return True

    def _bf16_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_flat: torch.Tensor, v_flat: torch.Tensor, p: PrefillSeq,
                    out: torch.Tensor) -> bool:
        """A prompt chunk through the native bfloat16 kernel (csrc/prefill_attention.cpp:
        the chunk's rows are the last of its context, key blocks aligned to position 0, so
        a row's result does not depend on how the prompt was chunked): over its own K/V,
        or over the context gathered from the cache (in the cache's dtype where that is
        float32 or bfloat16: a bf16 cache is copied at half the bytes and read exactly).
        Writes out[p.start:p.end]; False where the kernel does not cover the shape."""
        if p.mask is None:
            kc, vc = k[p.start:p.end], v[p.start:p.end]
            if kc.dtype != vc.dtype:       # a bf16 step: k rotated in float32, v not
                kc, vc = kc.float(), vc.float()
        else:
            dt = k_flat.dtype if k_flat.dtype in (torch.float32, torch.bfloat16) else q.dtype
            kc = self._gather(k_flat, p.ctx_slots, dt).transpose(0, 1)   # [L, KVH, hd]
            vc = self._gather(v_flat, p.ctx_slots, dt).transpose(0, 1)
        o = self.bf16_kernel(q[p.start:p.end].float(), kc, vc, self.scale)
        if o.numel() == 0:
            return False
        out[p.start:p.end] = o
        return True

    def _gather(self, flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
        """The cached K or V at `slots` of flat [KVH, slots, rb] as [KVH, L, hd] `dtype`
        (dequantized from a quantized cache: the plain-torch reads' copy)."""
        rows = torch.index_select(flat, 1, slots)
        return dequantize(rows, self.head_dim, dtype) if is_quantized(flat) else rows.to(dtype)

    def _window_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_flat: torch.Tensor, v_flat: torch.Tensor,
                        p: PrefillSeq) -> torch.Tensor:
        """A sliding-window layer's chunk q [H, n, hd] (positions start..start+n-1 where
        the context is `start` cached positions + the chunk): only keys within the window
        of some query are read (the cached ones through ctx_slots, from
        max(0, start - W + 1) on: the blocks before that may be released already)."""
        n = q.shape[1]
        if p.mask is None:                       # no cached prefix: the chunk's own K/V
            start = 0
            kc = k[p.start:p.end].transpose(0, 1).to(q.dtype)
            vc = v[p.start:p.end].transpose(0, 1).to(q.dtype)
            k_start = 0
        else:
            start = p.ctx_slots.shape[0] - n
            k_start = max(0, start - self.window + 1)
            slots = p.ctx_slots[k_start:]
            kc = self._gather(k_flat, slots, q.dtype)     # [KVH, L', hd]
            vc = self._gather(v_flat, slots, q.dtype)
        return self._windowed(q, kc, vc, start, k_start)

    def _windowed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                  k_start: int) -> torch.Tensor:
        """q [H, n, hd] at positions q_start.. over k, v [KVH, L, hd] at positions
        k_start..: causal within the window W, in row blocks whose score matrices stay
        near GROUPED_MAX_SCORES (`_grouped` on each)."""
        h, n = q.shape[0], q.shape[1]
        w = self.window
        rows = max(16, GROUPED_MAX_SCORES // (h * (w + 64)))
        out = []
        for a in range(0, n, rows):
            b = min(n, a + rows)
            lo = max(k_start, q_start + a - w + 1)
            hi = q_start + b
            qpos = torch.arange(q_start + a, q_start + b)[:, None]
            kpos = torch.arange(lo, hi)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - w)
            out.append(self._grouped(q[:, a:b], k[:, lo - k_start:hi - k_start],
                                     v[:, lo - k_start:hi - k_start], mask))
        return torch.cat(out, dim=1)

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """A chunk after a cached prefix: q [H, n, hd] over k, v [KVH, L, hd] with mask
        [n, L] (True = attend). The query heads sharing a KV head are stacked into one
        matrix, so this is two batched GEMMs over the KV heads and one softmax, without
        expanding K/V per query head (torch's masked SDPA with GQA takes its slow generic
        path here: 3-5x slower for chunks of 16-64 tokens over ~1,000 of context)."""
        h, n, hd = q.shape
        kvh, ctx = k.shape[0], k.shape[1]
        qg = q.reshape(kvh, (h // kvh) * n, hd)
        scores = torch.bmm(qg, k.transpose(1, 2)).view(kvh, h // kvh, n, ctx)
        scores.mul_(self.scale).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kvh, (h // kvh) * n, ctx)
        return torch.bmm(probs, v).view(h, n, hd)

    def _after_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """A long chunk after a cached prefix: q [H, n, hd] over k, v [KVH, L, hd] with
        mask [n, L], where the last n of the L positions are the chunk's own (batch.py's
        mask: causal, aligned to the bottom right). Two flash-attention calls, the chunk
        over the prefix (no mask) and over itself (causal), merged by their log-sum-exps;
        neither materializes a score matrix. torch's masked SDPA took the math kernel
        here: 220 ms a layer for 1,955 tokens after 13 cached on SmolLM2 (an 8 s
        prefill), 72 ms with 4-D inputs (the fallback, where torch lacks the op), 46 ms
        this way."""
        flash = _FLASH_WITH_LSE
        if flash is None:
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                  enable_gqa=self.gqa, scale=self.scale)[0]
        cached = k.shape[1] - q.shape[1]
        o1, l1 = flash(q[None], k[None, :, :cached], v[None, :, :cached],
                       scale=self.scale)[:2]
        o2, l2 = flash(q[None], k[None, :, cached:], v[None, :, cached:], is_causal=True,
                       scale=self.scale)[:2]
        lse = torch.logaddexp(l1, l2)                                 # [1, H, n]
        return (o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None])[0]

    def _paged(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        """Decode tokens through the native kernel (float32 math, cache read in place)."""
        out = self.paged_decode(q.float().contiguous(), k_cache, v_cache,
                                meta.decode_block_tables, meta.decode_context_lens, self.scale,
                                self.window_arg)
        return out.to(q.dtype)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                g: DecodeGroup) -> torch.Tensor:
        """One query per sequence. Plain matmuls: the fused CPU kernel has a large fixed
        cost per call that dominates at one query row."""
        n = q.shape[0]
        kvh, hd = self.num_kv_heads, self.head_dim
        ctx = g.block_table.shape[1] * k_cache.shape[2]
        # One gather per tensor, heads leading: [KVH, G, blocks, bs, hd] viewed as
        # [KVH, G, ctx, hd], contiguous, so the batched matmuls below copy nothing.
        num_blocks, bs, rb = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        blocks = g.block_table.view(-1)
        kd = torch.index_select(k_cache.view(kvh, num_blocks, bs * rb), 1, blocks)
        vd = torch.index_select(v_cache.view(kvh, num_blocks, bs * rb), 1, blocks)
        if is_quantized(k_cache):
            kd = dequantize(kd.view(kvh, n, ctx, rb), hd, q.dtype)
            vd = dequantize(vd.view(kvh, n, ctx, rb), hd, q.dtype)
        kd = kd.view(kvh, n, ctx, hd).to(q.dtype)
        vd = vd.view(kvh, n, ctx, hd).to(q.dtype)
        qg = q.view(n, kvh, self.num_heads // kvh, hd).transpose(0, 1)  # [KVH, G, Gq, hd]
        scores = torch.matmul(qg, kd.transpose(-1, -2)) * self.scale   # [KVH, G, Gq, ctx]
        mask = g.mask
        if self.window is not None:        # and only the last W positions of each context
            lens = g.mask.sum(-1, keepdim=True)                         # [1, G, 1, 1]
            mask = mask & (torch.arange(ctx) >= lens - self.window)
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, vd)                                  # [KVH, G, Gq, hd]
        return out.transpose(0, 1).reshape(n, self.num_heads, hd)
