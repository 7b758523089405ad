"""Quantized KV cache rows (`--kv-cache-dtype int8 | int4`), in plain torch.

A row is one token's head_dim values of one KV head, packed, followed by float16 scales
(config.kv_row_bytes; the native kernels, csrc/paged_attention.cpp and elementwise.cpp,
read and write the same bytes):

    int8  (torch.int8 cache):  q[0..D) int8 | s float16            x ~ q * s
          s = max(|x|) / 127 (at least MIN_SCALE), q = round(x / s) in [-127, 127]
    int4  (torch.uint8 cache): per group of 32 values 16 bytes, byte j = n[j] | n[j+16] << 4
          with n = q + 8, then the D/32 float16 scales       x ~ (n - 8) * d
          d = m / -8 with m the group's value of largest magnitude (as llama.cpp's q4_0:
          m itself is exact, the step is |m| / 8), q = round(x / d) in [-8, 7]

int8 keys are stored rotated (rotate_keys: a Walsh-Hadamard transform over blocks of the
largest power of two dividing head_dim, unnormalised) and the queries that meet them are
rotated alike and divided by the block size (rotate_queries), so q.k is unchanged while a
key's few outlier channels (Qwen's keys have channels ~10x the rest) are spread over the
row before its one scale is chosen. Values are stored as they are. Sums and differences
only (and an exact division by a power of two): the native writer's butterflies
(csrc/kv_rows.h's fwht) give the same bits. Measured on Qwen2.5-Coder-1.5B, 2 x 2,048
tokens, mean KL against a float32 cache (benchmarks/kl_divergence.py --kv-dtypes): one
scale a row 0.036, a scale per 64 values 0.029, per 32 (llama.cpp's q8_0, 1.88x capacity)
0.0035, rotated keys with one scale a row 0.0025 (rotating the values too: 0.0025). int4
keys are not rotated: with groups of 32, rotation doubled the KL (3.5 -> 6.4; the spread
outliers then set every group's step). Queries meeting int8 keys are also rounded to an
int8 grid (int8_queries), so that the decode kernel multiplies in integers: KL 0.0022.

Rounding is half to even (torch.round, C's nearbyint) and the divisions are IEEE float32,
so the torch and native writers store the same bytes.

Why these scales (measured: relative RMS error on 4,096 random rows of 128, Gaussian /
Gaussian with 3 channels x12 as real keys have): int8 per (token, head) 0.65% / 1.9%, for 2
bytes of scale per 128 values (capacity 1.97x bfloat16's); int4 with groups of 32 8.6% /
17%, with one scale for the whole head 10% / 28% (1.2x / 1.65x the error) for 6 bytes
less a row; groups of 32 still hold 3.56x bfloat16's tokens at head_dim 128.
"""
from __future__ import annotations

import torch

from duetserve.config import KV_QUANT_GROUP

MIN_SCALE = 2.0 ** -14          # the smallest normal float16
GROUP4 = KV_QUANT_GROUP["int4"]


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in (torch.int8, torch.uint8)


def rotation_block(head_dim: int) -> int:
    """The Walsh-Hadamard block of int8 keys: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def rotate_keys(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float32 -> its blocks' unnormalised Walsh-Hadamard transform (float32):
    butterflies (a + b, a - b) over pairs h = 1, 2, 4, ... apart, as csrc/kv_rows.h's fwht."""
    d = x.shape[-1]
    lead, h = x.shape[:-1], 1
    while h < rotation_block(d):
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], -2).reshape(*lead, d)
        h *= 2
    return x


def rotate_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries that meet rotated keys: the same transform divided by the block size
    (H H = B I, so rotate_queries(q) . rotate_keys(k) = q . k). q's dtype is kept."""
    return (rotate_keys(q.float()) / rotation_block(q.shape[-1])).to(q.dtype)


def query_grid(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] rounded to an int8 grid with one step per row, max |q| / 127 (1 for a
    zero row): n * step, n in [-127, 127], float32 (csrc/kv_rows.h's int8_query: the same
    bits)."""
    q = q.float()
    am = q.abs().amax(-1, keepdim=True)
    s = torch.where(am > 0, am / 127.0, torch.ones_like(am))
    return torch.round(q / s).clamp_(-127, 127) * s


def int8_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries that meet int8 keys: rotated (rotate_queries), then put on their int8 grid
    (query_grid). The decode kernel multiplies the grid's integers with the stored keys
    (vpdpbusd); every other path over an int8 cache reads the same rounded values, so all
    of them compute the same scores. q's dtype is kept."""
    return query_grid(rotate_queries(q.float())).to(q.dtype)


def quantize(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """x [..., D] (any float dtype) -> packed rows [..., row_bytes] of a `storage` cache."""
    x = x.float()
    if storage == torch.int8:
        s = (x.abs().amax(-1, keepdim=True) / 127.0).clamp_(min=MIN_SCALE).half()
        q = torch.round(x / s.float()).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q, s.view(torch.int8)], -1)
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // GROUP4, GROUP4)
    idx = g.abs().argmax(-1, keepdim=True)
    m = torch.gather(g, -1, idx)
    s = m / -8.0
    s = torch.where(s.abs() < MIN_SCALE, torch.full_like(s, MIN_SCALE), s).half()
    n = (torch.round(g / s.float()).clamp_(-8, 7) + 8).to(torch.uint8)
    half = GROUP4 // 2
    packed = (n[..., :half] | (n[..., half:] << 4)).reshape(*x.shape[:-1], d // 2)
    return torch.cat([packed, s.view(torch.uint8).reshape(*x.shape[:-1], -1)], -1)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Packed rows [..., row_bytes] -> values [..., head_dim] in `dtype`."""
    if rows.dtype == torch.int8:
        s = rows[..., head_dim:].contiguous().view(torch.float16).float()
        return (rows[..., :head_dim].float() * s).to(dtype)
    lead, ng = rows.shape[:-1], head_dim // GROUP4
    packed = rows[..., :head_dim // 2].reshape(*lead, ng, GROUP4 // 2)
    n = torch.cat([packed & 15, packed >> 4], -1).float() - 8.0      # [..., ng, 32]
    s = rows[..., head_dim // 2:].contiguous().view(torch.float16).float()
    return (n * s.unsqueeze(-1)).reshape(*lead, head_dim).to(dtype)


def round_trip(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """x as a `storage` cache holds it (x's dtype and shape)."""
    return dequantize(quantize(x, storage), x.shape[-1], x.dtype)
