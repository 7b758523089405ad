"""Quantized KV cache rows (--kv-cache-dtype int8 / int4): the torch writer's error bound,
the native writer storing the same bytes, the paged decode kernel reading them in place
(against attention over the float32 K/V within a bound derived from the quantization
steps), the torch read paths agreeing with it, the capacity and the transfer bytes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model_helpers import paged_and_grouped_steps

from duetserve.config import ModelConfig
from duetserve.kv_transfer.layout import KVLayout
from duetserve.models.kv_quant import (dequantize, int8_queries, quantize, query_grid,
                                        rotate_keys, rotate_queries, rotation_block)
from duetserve.models.native import ops
from duetserve.worker.kv_cache import kv_row_elems, num_blocks_for_memory

native = ops()
needs_native = pytest.mark.skipif(native is None, reason="native kernels not built here")
STORAGE = {"int8": torch.int8, "int4": torch.uint8}


def _steps(rows: torch.Tensor, hd: int) -> torch.Tensor:
    """Each value's quantization step [..., hd] (int8: the row's scale; int4: its group's)."""
    if rows.dtype == torch.int8:
        return rows[..., hd:].contiguous().view(torch.float16).float().expand(
            *rows.shape[:-1], hd)
    s = rows[..., hd // 2:].contiguous().view(torch.float16).float().abs()
    return s.repeat_interleave(32, -1)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("hd", [32, 64, 128])
def test_round_trip_within_half_a_step(kind, hd):
    """Every value comes back within half its step (int4: the value at -m, which maps to
    +8 and is clamped to 7, within one step), rows keep their shape, and zero rows stay 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, hd, generator=g) * torch.rand(3, 50, 1, generator=g) * 4
    x[0, 0] = 0
    x[1, :, 3] *= 20                                        # an outlier channel
    rows = quantize(x, STORAGE[kind])
    assert rows.dtype == STORAGE[kind] and rows.shape[-1] == kv_row_elems(hd, STORAGE[kind])
    back = dequantize(rows, hd)
    err = (back - x).abs()
    step = _steps(rows, hd)
    limit = 0.5 if kind == "int8" else 1.0
    assert (err <= limit * step * (1 + 1e-6)).all()
    assert (back[0, 0] == 0).all()
    if kind == "int4":       # only the clamped values need more than half a step
        assert (err <= 0.5 * step * (1 + 1e-6)).float().mean() > 0.95


@needs_native
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_native_cache_write_stores_the_torch_bytes(kind):
    """rope_kv_write with an identity rotation (cos 1, sin 0) into a quantized cache
    writes exactly quantize()'s rows for K and V (same scales, same rounding; int8 keys
    after rotate_keys, and the returned queries int8_queries', bit for bit: rotated,
    then on their int8 grid)."""
    kvh, heads, hd, bs, nb, t = 2, 4, 64, 4, 8, 5
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (heads + 2 * kvh) * hd, generator=g) * 3
    qkv[:, heads * hd + 5] *= 30                            # an outlier key channel
    w = kv_row_elems(hd, STORAGE[kind])
    kc = torch.zeros(kvh, nb, bs, w, dtype=STORAGE[kind])
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 9, 10, 17, 30])
    cos, sin = torch.ones(t, 1, hd), torch.zeros(t, 1, hd)
    q = native.rope_kv_write(qkv, cos, sin, kc, vc, slots, heads, kvh)
    q_in = qkv[:, :heads * hd].view(t, heads, hd)
    k = qkv[:, heads * hd:(heads + kvh) * hd].view(t, kvh, hd)
    if kind == "int8":
        q_in, k = int8_queries(q_in), rotate_keys(k)
    assert torch.equal(q, q_in)
    v = qkv[:, (heads + kvh) * hd:].view(t, kvh, hd)
    for cache, x in ((kc, k), (vc, v)):
        assert torch.equal(cache.view(kvh, -1, w)[:, slots], quantize(x, STORAGE[kind])
                           .transpose(0, 1))


@pytest.mark.parametrize("hd", [64, 96, 128])
def test_rotation_keeps_dot_products_and_spreads_outliers(hd):
    """rotate_queries(q) . rotate_keys(k) == q . k (blocks of the largest power of two
    dividing head_dim: 96 -> 32), and a key with one outlier channel loses most of its
    int8 error once rotated (the reason int8 keys are stored rotated)."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(20, hd, generator=g), torch.randn(20, hd, generator=g)
    assert rotation_block(hd) == {64: 64, 96: 32, 128: 128}[hd]
    torch.testing.assert_close(rotate_queries(q) @ rotate_keys(k).T, q @ k.T)
    k[:, 3] *= 30
    plain = (dequantize(quantize(k, torch.int8), hd) - k).norm()
    rk = rotate_keys(k)
    rotated = (dequantize(quantize(rk, torch.int8), hd) - rk).norm() / rotation_block(hd) ** 0.5
    assert rotated < plain / 2


def _case(kind, kvh, heads, hd, nb=40, bs=16, lens=(1, 15, 16, 17, 130), seed=0):
    g = torch.Generator().manual_seed(seed)
    kf = torch.randn(kvh, nb, bs, hd, generator=g) * 2
    kf[..., 1] *= 8                                         # keys' outlier channel
    vf = torch.randn(kvh, nb, bs, hd, generator=g)
    width = max((n + bs - 1) // bs for n in lens)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, hd, generator=g)
    return q, kf, vf, quantize(kf, STORAGE[kind]), quantize(vf, STORAGE[kind]), tables, \
        torch.tensor(lens)


def _reference(q, kc, vc, tables, lens, window=0):
    kvh, _, bs, hd = kc.shape
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b][pos // bs] * bs + pos % bs
        k = kc.reshape(kvh, -1, hd)[:, slots]
        v = vc.reshape(kvh, -1, hd)[:, slots]
        o = F.scaled_dot_product_attention(q[b].view(kvh, -1, 1, hd), k[:, None], v[:, None])
        out.append(o.reshape(-1, hd))
    return torch.stack(out)


def _vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_vnni" in f.read()
    except OSError:
        return False


def _q8_reference(q, kq, vq, tables, lens, window=0, span_blocks=4):
    """Attention over int8 rows as the AVX512-VNNI kernel computes it (csrc/
    paged_attention.cpp's q8_values): each head's weights (softmax numerators times the
    value rows' scales) on a u8 grid per span of 4 blocks, step = the span's largest / 255,
    times the rows' int8 values, the sum divided by the unrounded numerators' sum."""
    kvh, _, bs, rb = kq.shape
    hd = rb - 2
    k = dequantize(kq, hd).reshape(kvh, -1, hd)
    vi = vq[..., :hd].float().reshape(kvh, -1, hd)
    vs = vq[..., hd:].contiguous().view(torch.float16).float().reshape(kvh, -1)
    g = q.shape[1] // kvh
    out = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        t0 = max(0, n - window) if window else 0
        pos = torch.arange(t0, n)
        slots = tables[b][pos // bs] * bs + pos % bs
        span = (pos - t0 // bs * bs) // (span_blocks * bs)
        for h in range(kvh):
            qh = q[b, h * g:(h + 1) * g]
            s = (qh @ k[h, slots].T) * hd ** -0.5
            e = torch.exp(s - s.amax(-1, keepdim=True))
            w = e * vs[h, slots]
            acc = torch.zeros(g, hd)
            for sp in span.unique().tolist():
                m = span == sp
                mx = w[:, m].amax(-1, keepdim=True)
                wq = torch.round(w[:, m] * (255.0 / mx)).clamp(0, 255)
                acc += (mx / 255.0) * (wq @ vi[h, slots[m]])
            out[b, h * g:(h + 1) * g] = acc / e.sum(-1, keepdim=True)
    return out


def _bound(q, kq, vq, hd) -> float:
    """How far attention over the stored values may be from attention over the float32
    ones: |o - o'| <= max|dV| + (exp(2 dS) - 1) max|V|, with a score error dS <=
    scale * |q|_1 * max|dK| (each |dK| and |dV| within the steps of
    test_round_trip_within_half_a_step)."""
    limit = 0.5 if kq.dtype == torch.int8 else 1.0
    dk = limit * _steps(kq, hd).max().item()
    dv = limit * _steps(vq, hd).max().item()
    ds = hd ** -0.5 * q.abs().sum(-1).max().item() * dk
    vmax = dequantize(vq, hd).abs().max().item()
    return dv + math.expm1(2 * ds) * vmax


@needs_native
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("kvh,heads,hd,window", [(2, 6, 32, 0), (2, 12, 128, 0),
                                                 (1, 9, 64, 0), (2, 4, 64, 20)])
def test_paged_decode_reads_quantized_rows_in_place(kind, kvh, heads, hd, window):
    """The kernel over the packed rows equals attention over their dequantized values
    (1e-5: the same numbers, read in place; int8 keys meet the queries on their int8
    grid, and with AVX512-VNNI the kernel multiplies in integers, the values by weights on
    a u8 grid: _q8_reference), and stays within _bound of attention over
    the float32 K/V; its mean error is far inside that bound (int8 about 1% of V's
    spread). (1, 9, 64): past the AVX-512 kernel's 8 heads a KV head, the plain loop."""
    q, kf, vf, kq, vq, tables, lens = _case(kind, kvh, heads, hd)
    got = native.paged_decode_attention(q, kq, vq, tables, lens, hd ** -0.5, window)
    qk = query_grid(q) if kind == "int8" else q     # int8 keys meet int8 queries
    if kind == "int8" and hd % 64 == 0 and heads // kvh <= 8 and _vnni():
        exact = _q8_reference(qk, kq, vq, tables, lens, window)    # values in integers
    else:
        exact = _reference(qk, dequantize(kq, hd), dequantize(vq, hd), tables, lens, window)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    ref = _reference(q, kf, vf, tables, lens, window)
    err = (got - ref).abs()
    assert err.max().item() <= _bound(q, kq, vq, hd)
    assert err.mean().item() <= (0.02 if kind == "int8" else 0.2) * vf.std().item()


@needs_native
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_backend_paths_agree_on_a_quantized_cache(kind):
    """Through TorchAttention: decode tokens through the native kernel vs the torch
    gather of padded groups, and prompt chunks (fresh, and after a cached prefix) as the
    kernel's decode rows vs the causal / masked prefill paths, all over the same int8 /
    int4 cache (the new K/V quantized as they are written)."""
    kvh, heads, hd, bs, nb = 2, 4, 32, 4, 32
    g = torch.Generator().manual_seed(1)
    st = STORAGE[kind]
    cache = (quantize(torch.randn(kvh, nb, bs, hd, generator=g), st),
             quantize(torch.randn(kvh, nb, bs, hd, generator=g), st))
    outs, caches = paged_and_grouped_steps(cache, heads, hd, bs, g)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


# Qwen2.5-Coder-1.5B's attention shape (issue 64's model) and SmolLM2-135M's head size.
_SHAPES = [dict(num_hidden_layers=28, num_key_value_heads=2, head_dim=128),
           dict(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)]


@pytest.mark.parametrize("shape", _SHAPES)
def test_capacity_at_the_same_memory(shape):
    """At the same --kv-cache-memory int8 holds >= 1.9x and int4 >= 3.5x the tokens of
    bfloat16 (scales counted)."""
    cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=1000, hidden_size=1536,
                      intermediate_size=8960, num_attention_heads=12, **shape)
    blocks = {k: num_blocks_for_memory(cfg, d, 16, 4.0) for k, d in
              (("bfloat16", torch.bfloat16), ("int8", torch.int8), ("int4", torch.uint8))}
    assert blocks["int8"] >= 1.9 * blocks["bfloat16"]
    assert blocks["int4"] >= 3.5 * blocks["bfloat16"]


@pytest.mark.parametrize("shape", _SHAPES)
def test_transfer_bytes_per_token(shape):
    """PD moves a quantized cache as stored: bytes per block (so per token) of the int8
    layout <= 0.55x bfloat16's, and they are the cache's own bytes (row width = the
    cache's last dimension)."""
    args = (shape["num_hidden_layers"], shape["num_key_value_heads"], 100, 16,
            shape["head_dim"])
    bf16, int8, int4 = (KVLayout(*args, d) for d in ("bfloat16", "int8", "int4"))
    assert int8.bytes_per_block <= 0.55 * bf16.bytes_per_block
    assert int4.bytes_per_block <= 0.3 * bf16.bytes_per_block
    assert int8.row_width == kv_row_elems(shape["head_dim"], torch.int8)
    assert int8.storage_dtype == "int8" and int4.storage_dtype == "uint8"
