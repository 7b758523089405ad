"""The native kernels (models/native.py) against plain-torch references: decode attention
reading the paged cache in place (vs SDPA over the gathered context, and vs the padded-group
fallback), the int4 / int8 GEMVs (vs the dequantized weight), and the fused row ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duetserve.models.layers import DenseLinear
from duetserve.models.decoder import _UNBUILT
from duetserve.models.native import ops
from model_helpers import paged_and_grouped_steps
from pinned import pinned_step_time

native = ops()
pytestmark = pytest.mark.skipif(native is None, reason="native kernels not built here")


def _case(kvh=2, heads=6, hd=32, nb=40, bs=16, lens=(1, 15, 16, 17, 130), seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(kvh, nb, bs, hd, generator=g)
    vc = torch.randn(kvh, nb, bs, hd, generator=g)
    width = max((n + bs - 1) // bs for n in lens)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, hd, generator=g)
    return q, kc, vc, tables, torch.tensor(lens)


def _reference(q, kc, vc, tables, lens):
    kvh, _, bs, hd = kc.shape
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[b][pos // bs] * bs + pos % bs
        k = kc.reshape(kvh, -1, hd)[:, slots]
        v = vc.reshape(kvh, -1, hd)[:, slots]
        o = F.scaled_dot_product_attention(q[b].view(kvh, -1, 1, hd), k[:, None], v[:, None])
        out.append(o.reshape(-1, hd))
    return torch.stack(out)


@pytest.mark.parametrize("kvh,heads,hd", [(2, 6, 32), (3, 3, 32), (1, 8, 32), (3, 9, 64),
                                          (2, 12, 128), (1, 9, 64)])
def test_matches_sdpa(kvh, heads, hd):
    # (1, 9, 64): 9 query heads a KV head, past the AVX-512 kernel's 8: the plain loop
    q, kc, vc, tables, lens = _case(kvh, heads, hd)
    got = native.paged_decode_attention(q, kc, vc, tables, lens, q.shape[-1] ** -0.5)
    torch.testing.assert_close(got, _reference(q, kc, vc, tables, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kvh,heads,hd", [(2, 6, 32), (3, 9, 64), (2, 12, 128), (1, 9, 64)])
def test_bf16_cache(kvh, heads, hd):
    q, kc, vc, tables, lens = _case(kvh, heads, hd)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    got = native.paged_decode_attention(q, kb, vb, tables, lens, q.shape[-1] ** -0.5)
    ref = _reference(q, kb.float(), vb.float(), tables, lens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_backend_native_equals_group_fallback():
    """Through TorchAttention: decode tokens via the kernel vs via padded groups, and
    prompt chunks (fresh, and after a cached prefix) as the kernel's decode rows vs the
    causal / masked prefill paths."""
    kvh, heads, hd, bs, nb = 2, 4, 16, 4, 32
    g = torch.Generator().manual_seed(1)
    cache = (torch.randn(kvh, nb, bs, hd, generator=g), torch.randn(kvh, nb, bs, hd, generator=g))
    outs, _ = paged_and_grouped_steps(cache, heads, hd, bs, g)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_cache_write_equals_torch_path(kv_dtype):
    """A decode-only step through `forward_qkv`: the native rotary + cache write + paged
    attention equals the generic rotary and the torch cache write, output and cache
    contents both (the two new slots up to float rounding, every other slot exactly)."""
    from duetserve.models.attention import AttentionBackend, TorchAttention
    from duetserve.models.layers import RotaryEmbedding
    from duetserve.worker.batch import SeqWork, build_step_batch
    kvh, heads, hd, bs, nb = 2, 6, 16, 4, 32
    g = torch.Generator().manual_seed(2)
    cache = (torch.randn(kvh, nb, bs, hd, generator=g).to(kv_dtype),
             torch.randn(kvh, nb, bs, hd, generator=g).to(kv_dtype))
    work = [SeqWork("a", [5], 9, [3, 7, 11], True), SeqWork("b", [6], 2, [20], True)]
    qkv = torch.randn(2, (heads + 2 * kvh) * hd, generator=g)
    rot = RotaryEmbedding(hd, 10000.0, None)
    rot.build(64, "cpu", torch.float32)
    backend = TorchAttention(heads, kvh, hd)
    outs, caches = [], []
    for fused in (True, False):
        c = (cache[0].clone(), cache[1].clone())
        meta = build_step_batch(work, bs, paged_decode=True).meta
        meta.cos, meta.sin = rot.tables(torch.tensor([9, 2]))
        fn = backend.forward_qkv if fused else \
            (lambda *a: AttentionBackend.forward_qkv(backend, *a))
        outs.append(fn(qkv, c, meta))
        caches.append(c)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[meta.slot_mapping] = True
    for a, b in zip(caches[0], caches[1]):
        a, b = a.view(kvh, -1, hd), b.view(kvh, -1, hd)
        assert torch.equal(a[:, ~written], b[:, ~written])
        torch.testing.assert_close(a[:, written].float(), b[:, written].float(),
                                   atol=1e-6, rtol=2 ** -7)


def test_kv_cache_dtype_option(tiny_checkpoints):
    """--kv-cache-dtype bfloat16 stores K/V in bfloat16 (half the bytes) and the engine
    still decodes; a bad value is named."""
    from duetserve.config import ConfigError, EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.sampling_params import SamplingParams
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    outs = {}
    for kvd in ("float32", "bfloat16"):
        eng = EngineCore(EngineConfig(model=tiny_checkpoints["llama-gqa-tied"], num_threads=2,
                                      kv_cache_memory=0.01, kv_cache_dtype=kvd,
                                      step_time=pinned_step_time(),
                                      check_integrity_when_idle=True))
        assert eng.runner.kv_caches[0][0].dtype == getattr(torch, kvd)
        eng.add_request("r", [3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True, logprobs=0))
        while eng.has_unfinished_requests():
            out = eng.step()
        outs[kvd] = out[0].outputs[0]
    assert len(outs["bfloat16"].token_ids) == 6
    # the first token comes from the prefill's own float32 K/V: identical
    assert outs["bfloat16"].token_ids[0] == outs["float32"].token_ids[0]


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the low-bit kernels see it: int8 per group of 32, dx = max|x_g| / 127, each
    value rounded (to nearest even) from x * (1 / dx) in float32 as the kernels compute it
    (in float64 one value in about 6 x 10^5 lands on the other side of a half)."""
    m, k = x.shape
    g = x.float().view(m, k // 32, 32)
    dx = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / torch.where(dx > 0, dx, torch.ones_like(dx)),
                      torch.zeros_like(dx))
    q = torch.round(g * inv)
    return (q.double() * dx.double()).view(m, k)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 9, 70])   # 70: the many-row records path
@pytest.mark.parametrize("n,k", [(192, 320), (100, 96), (64, 576),   # K/32 = 10, 3, 18
                                 (64, 2176)])    # 17 chunks: 2 K tiles, the last one padded
def test_q4_gemv_equals_dequantized(rows, n, k):
    """Equal to the float64 product of the int8-quantized activation and the dequantized
    weight (tail groups of K/32 % 4 included), and within the activation rounding of the
    float product."""
    from duetserve.models.quant import Int4Weight, int4_groups_from_float
    gen = torch.Generator().manual_seed(rows)
    qw = Int4Weight(*int4_groups_from_float(torch.randn(n, k, generator=gen)))
    x = torch.randn(rows, k, generator=gen)
    got = native.q4_gemv(x, qw.packed, n).double()
    w = qw.dequantize().double()
    torch.testing.assert_close(got, _int8_activations(x) @ w.t(), atol=1e-4, rtol=1e-5)
    # |x - dx xq| <= dx / 2 per element, dx = max|x_g| / 127
    dx = x.double().view(rows, -1, 32).abs().amax(-1) / 127
    bound = (dx.repeat_interleave(32, 1) / 2) @ w.abs().t() + 1e-4
    assert torch.all((got - x.double() @ w.t()).abs() <= bound)


@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("k", [256, 96])     # whole and half 64-byte pairs
def test_q8_gemv_equals_dequantized(rows, k):
    from duetserve.models.quant import Int8Weight, quantize_int8
    q, scale = quantize_int8(torch.randn(99, k))      # 99 rows: the last block padded
    qw = Int8Weight(q, scale)
    assert torch.equal(qw.int8_rows(torch.arange(99)), q)
    x = torch.randn(rows, k)
    got = native.q8_gemv(x, qw.packed, qw.scale32)
    ref = _int8_activations(x) @ (q.double() * qw.scale32.double()[:, None]).t()
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)


def _random_q6(n: int, k: int, gen: torch.Generator):
    from duetserve.models.quant import Int6Weight
    return Int6Weight(torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen),
                      torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen),
                      (torch.rand(n, k // 128, generator=gen) * 1e-2).half())


def _random_q4k(n: int, k: int, gen: torch.Generator):
    from duetserve.models.quant import Int4KWeight
    codes = lambda: torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen)  # noqa: E731
    scales = lambda: (torch.rand(n, k // 256, generator=gen) * 1e-2).half()              # noqa: E731
    return Int4KWeight(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                       codes(), codes(), scales(), scales())


def _random_q8g(n: int, k: int, gen: torch.Generator):
    """Bytes 0..255 with float16 d and m per group (Q8_0's m is -128 d; any m here)."""
    from duetserve.models.quant import Int8GWeight
    return Int8GWeight(torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen),
                       (torch.rand(n, k // 32, generator=gen) * 1e-2).half(),
                       (torch.randn(n, k // 32, generator=gen) * 0.3).half())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 9, 70])
@pytest.mark.parametrize("form,n,k", [("q4k", 99, 512), ("q4k", 8, 256),    # 2 / 1 blocks
                                      ("q8g", 99, 96), ("q8g", 8, 32),      # 3 / 1 groups
                                      ("q8g", 37, 2176),                    # 2 K tiles
                                      ("q6", 99, 384), ("q6", 8, 128),      # 3 / 1 chunks
                                      ("q4k", 99, 2304), ("q6", 99, 2176)])  # 2 K tiles
def test_k_quant_gemv_equals_dequantized(rows, form, n, k):
    """As for q4 (the last block padded): the float64 product of the int8-quantized
    activation and the exact dequantized weight, with each group's d and m computed from
    Q4_K's codes (q4k), each half-group's scale applied to its own dot (q6), a byte a
    weight (q8g: GGUF Q8_0 / Q5_x)."""
    gen = torch.Generator().manual_seed(rows)
    qw = {"q4k": _random_q4k, "q6": _random_q6, "q8g": _random_q8g}[form](n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    got = getattr(native, f"{form}_gemv")(x, qw.packed, n).double()
    w = qw.dequantize().double()
    torch.testing.assert_close(got, _int8_activations(x) @ w.t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("form", ["q4", "q4k", "q6", "q8g"])
def test_gemv_rows_do_not_depend_on_the_step(form):
    """A row's output is the same bits alone, in a step of one pass (5 or 8 rows), of
    tiled passes (13: 8 + 5) and of unpacked records (70): deterministic mode's batch
    invariance rests on it, and the kernels switch by row count (csrc/lowbit_gemv.cpp:
    many_rows)."""
    make = {"q4": _random_q4, "q4k": _random_q4k, "q6": _random_q6, "q8g": _random_q8g}[form]
    k = 512
    qw = make(99, k, torch.Generator().manual_seed(2))
    gemv = getattr(native, f"{form}_gemv")
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(3))
    every = gemv(x, qw.packed, 99)
    for rows in (1, 5, 8, 13):
        assert torch.equal(gemv(x[:rows], qw.packed, 99), every[:rows]), rows


def _random_q4(n: int, k: int, gen: torch.Generator):
    from duetserve.models.quant import Int4Weight, int4_groups_from_float
    return Int4Weight(*int4_groups_from_float(torch.randn(n, k, generator=gen)))


@pytest.mark.parametrize("form,k", [("q4", 2176), ("q4k", 2304), ("q6", 2176), ("q6", 4608),
                                    ("q8g", 2176)])
def test_k_tiles_compute_what_one_tile_does(monkeypatch, form, k):
    """A weight whose K spans several tiles (models/quant.py: TILE_COLS; the last tile
    padded for all but q6 4608) gives the products, dequantization, rows and row prefixes
    of the same numbers packed as one tile, bit for bit: each output adds its units in the
    same order."""
    import duetserve.models.quant as quant
    make = {"q4": _random_q4, "q4k": _random_q4k, "q6": _random_q6, "q8g": _random_q8g}[form]
    tiled = make(99, k, torch.Generator().manual_seed(1))
    monkeypatch.setattr(quant, "TILE_COLS", 1 << 20)
    whole = make(99, k, torch.Generator().manual_seed(1))
    assert tiled.packed.shape[0] > 1 and whole.packed.shape[0] == 1
    # no view of a packing temporary: a base tensor would keep its storage alive after the
    # loader moves the weight into its 2 MiB pages (loader/huge_pages.py)
    assert tiled.packed._base is None and whole.packed._base is None
    gemv = getattr(native, f"{form}_gemv")
    for rows in (1, 5, 13, 70):   # 13: passes past 8 rows; 70: records over every K tile
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(gemv(x, tiled.packed, 99), gemv(x, whole.packed, 99))
        head = tiled.prefix(33)       # tiles apart: a strided view of the row blocks
        assert not head.packed.is_contiguous()
        assert torch.equal(gemv(x, head.packed, 33), gemv(x, whole.packed, 99)[:, :33])
    for dtype in ("bf16", "f32"):
        dequant = getattr(native, f"{form}_dequant_{dtype}")
        assert torch.equal(dequant(tiled.packed, k, 5, 70), dequant(whole.packed, k, 5, 70))
    ids = torch.tensor([0, 98, 33, 4, 4])
    assert torch.equal(tiled.rows(ids), whole.rows(ids))
    assert torch.equal(tiled.dequantize(), whole.dequantize())
    assert tiled.nbytes >= whole.nbytes


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("forms,ns,k", [(("q4k", "q6"), (99, 37), 512),
                                        (("q4", "q6", "q4k"), (8, 5, 64), 2304),   # 2 K tiles
                                        (("q6", "q4"), (3, 2), 128),
                                        (("q4k", "q8g"), (40, 24), 256),   # Q4_K q, k + Q8_0 v
                                        # parts cut into work items of several row blocks
                                        (("q4k", "q6"), (600, 250), 256)])
def test_stacked_gemv_is_each_part_gemv(rows, forms, ns, k):
    """Parts of different packed forms stacked along N (a Q4_K_M file's qkv: Q4_K q and
    k, Q6_K v): one call gives every part's own GEMV, bit for bit, at 1 and 2 threads."""
    from duetserve.models.quant import StackedWeight
    gen = torch.Generator().manual_seed(rows)
    make = {"q4": _random_q4, "q4k": _random_q4k, "q6": _random_q6, "q8g": _random_q8g}
    parts = [make[f](n, k, gen) for f, n in zip(forms, ns)]
    x = torch.randn(rows, k, generator=gen)
    want = torch.cat([getattr(native, f"{f}_gemv")(x, p.packed, n)
                      for f, p, n in zip(forms, parts, ns)], dim=1)
    stacked = StackedWeight(parts)      # moves the parts into one storage
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(stacked.matmul(x), want)
    finally:
        torch.set_num_threads(threads)
    assert len({p.packed.untyped_storage().data_ptr() for p in parts}) == 1
    assert all(p.packed._base is None for p in parts)     # see test_k_tiles_compute_...
    assert torch.equal(stacked.dequantize(torch.bfloat16, 2, sum(ns) - 1),
                       torch.cat([p.dequantize(torch.bfloat16) for p in parts])[2:-1])


def _torch_dequant(qw) -> torch.Tensor:
    """Every row of a packed weight dequantized by its plain-torch path, float32."""
    return qw._decode(*qw._unpack(torch.arange(qw.shape[0])), torch.float32)


def _check_dequant_slices(qw, form: str) -> None:
    """The native float32 dequantization of row slices is the torch path's bit for bit
    (`dequantize(float32)` takes it: the many-row path of --dtype float32); the bf16 one
    is within bf16 rounding of it."""
    ref, k = _torch_dequant(qw), qw.shape[1]
    assert torch.equal(qw.dequantize(torch.float32), ref)
    for a, b in ((0, qw.shape[0]), (64, 192), (5, 6), (qw.shape[0] - 1, qw.shape[0])):
        got = getattr(native, f"{form}_dequant_f32")(qw.packed, k, a, b)
        assert got.dtype == torch.float32 and torch.equal(got, ref[a:b])
        got = getattr(native, f"{form}_dequant_bf16")(qw.packed, k, a, b)
        assert got.dtype == torch.bfloat16 and got.shape == (b - a, k)
        torch.testing.assert_close(got.float(), ref[a:b], atol=0, rtol=2 ** -8)


def test_q4k_dequant_slices():
    gen = torch.Generator().manual_seed(0)
    _check_dequant_slices(_random_q4k(254, 512, gen), "q4k")


def test_q8g_dequant_slices():
    gen = torch.Generator().manual_seed(0)
    qw = _random_q8g(254, 96, gen)
    _check_dequant_slices(qw, "q8g")
    ref = _torch_dequant(qw)             # u * d is exact: bf16 rounds d * u + m once
    assert torch.equal(native.q8g_dequant_bf16(qw.packed, 96, 0, 254), ref.to(torch.bfloat16))


def test_q6_dequant_slices():
    gen = torch.Generator().manual_seed(0)
    qw = _random_q6(254, 256, gen)
    _check_dequant_slices(qw, "q6")
    ref = _torch_dequant(qw)             # (d * sc) * (q - 32): bf16 rounds it exactly once
    assert torch.equal(native.q6_dequant_bf16(qw.packed, 256, 0, 254), ref.to(torch.bfloat16))


def test_fused_row_ops():
    x, w = torch.randn(7, 96), torch.randn(96)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6),
                               F.rms_norm(x, (96,), w, 1e-6), atol=1e-6, rtol=1e-5)
    # the residual add fused into the norm: x holds x + delta after, and the norm is
    # rms_norm of that sum, bit for bit (the decode stack relies on it)
    delta, stream = torch.randn(7, 96), x.clone()
    normed = native.add_rms_norm(stream, delta, w, 1e-6)
    assert torch.equal(stream, x + delta)
    assert torch.equal(normed, native.rms_norm(x + delta, w, 1e-6))
    g = torch.randn(5, 2 * 37) * 8        # a row's last 16-lane vector is partial
    g[0, 0], g[0, 1], g[0, 2] = 100.0, -100.0, 0.0
    whole = native.silu_mul(g)
    torch.testing.assert_close(whole, F.silu(g[:, :37]) * g[:, 37:], atol=1e-6, rtol=1e-5)
    for i in range(5):     # a row does not depend on the rows computed with it
        assert torch.equal(native.silu_mul(g[i:i + 1]), whole[i:i + 1])


@pytest.mark.parametrize("v", [1, 15, 16, 17, 100, 49152])
def test_argmax_rows_is_torchs_argmax(v):
    """The first index of each row's maximum, as torch.argmax: ties (the max again later,
    in the vector part and in the tail), -0.0 against 0.0, rows of -inf, NaN (torch's
    answer), a transposed (non-contiguous) input, 1 and many rows."""
    from duetserve.worker.sampler import argmax_rows
    g = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=g)
    x[1, -1] = x[1].max()                    # a tie at the end (the tail when v % 16)
    x[2, v // 2] = x[2].max()                # a tie in the middle
    x[3] = -float("inf")
    x[4] = 0.0
    x[4, v // 3] = -0.0
    cases = [x, x[:1], x.t().contiguous().t()]
    if v > 1:
        y = x.clone()
        y[5, v - 1] = float("nan")           # NaN: the whole call is torch's
        cases.append(y)
        cases.append(torch.randn(v, 9, generator=g).t())     # non-contiguous rows
    for c in cases:
        assert torch.equal(native.argmax_rows(c), c.argmax(dim=-1))
        assert torch.equal(argmax_rows(c), c.argmax(dim=-1))


def test_q4_dequant_slices():
    from duetserve.models.quant import Int4Weight, int4_groups_from_float
    q, d, m = int4_groups_from_float(torch.randn(254, 96))   # rows and groups padded
    qw = Int4Weight(q, d, m)
    torch.testing.assert_close(_torch_dequant(qw), Int4Weight._decode(
        q.view(254, 3, 32), d.half(), m.half(), torch.float32), atol=0, rtol=0)
    _check_dequant_slices(qw, "q4")


def _as_q4k(qw):
    """Any Q4_K-form weight near qw's values (see _as_q6): asymmetric per 32, codes 0..63."""
    from duetserve.models.quant import Int4KWeight
    w = qw.dequantize()
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1)
    step = (hi - lo) / 15
    d = (step.view(n, k // 256, 8).amax(-1) / 63).clamp_min(1e-6).half()
    dmin = ((-lo).view(n, k // 256, 8).amax(-1) / 63).clamp_min(1e-6).half()
    sc = torch.round(step / d.float().repeat_interleave(8, 1)).clamp(1, 63)
    mn = torch.round(-lo / dmin.float().repeat_interleave(8, 1)).clamp(0, 63)
    dq = (d.float().repeat_interleave(8, 1) * sc)[..., None]
    mq = (dmin.float().repeat_interleave(8, 1) * mn)[..., None]
    q = torch.round((g + mq) / dq).clamp(0, 15)
    return Int4KWeight(q.to(torch.uint8).view(n, k), sc.to(torch.uint8), mn.to(torch.uint8),
                       d, dmin)


def _as_q6(qw):
    """Any 6-bit weight near qw's values (the stack test needs q6 linears; Q6_K files are
    too big for tests): per 16 symmetric, q in 0..63, d per 128."""
    from duetserve.models.quant import Int6Weight
    w = qw.dequantize()
    n, k = w.shape
    amax = w.view(n, k // 16, 16).abs().amax(-1)                         # [n, K/16]
    d = (amax.view(n, k // 128, 8).amax(-1) / (127 * 31)).clamp_min(1e-6).half()
    scale = d.float().repeat_interleave(8, 1)
    sc = torch.round(amax / (31 * scale)).clamp(1, 127)
    q = torch.round(w.view(n, k // 16, 16) / (scale * sc)[..., None]).clamp(-32, 31) + 32
    return Int6Weight(q.to(torch.uint8).view(n, k), sc.to(torch.int8), d)


class _Rows:
    """Rows [a, b) of a weight, as the _as_* helpers read it."""

    def __init__(self, qw, a: int, b: int) -> None:
        self.w = qw.dequantize()[a:b]

    def dequantize(self):
        return self.w


def _as_stacked(qw):
    """A q4k part and a q6 part (the last 64 rows), as a Q4_K_M file's qkv."""
    from duetserve.models.quant import StackedWeight
    n = qw.shape[0]
    return StackedWeight([_as_q4k(_Rows(qw, 0, n - 64)), _as_q6(_Rows(qw, n - 64, n))])


@pytest.mark.parametrize("variant,quant", [("qwen2-qkv-bias", "int4"), ("llama-gqa-untied", "int8"),
                                           ("llama-gqa-tied", "none"), ("wide", "int6"),
                                           ("wide", "int4k"), ("wide", "stacked"),
                                           ("gemma3", "int8"), ("qwen3_moe", "int4"),
                                           ("mixtral", "int8"), ("gemma3", "none")])
def test_native_decode_stack_equals_module_path(tiny_checkpoints, tmp_path, variant, quant):
    """Decode-only steps through the one-call native stack give the module path's logprobs
    exactly for q4 (with QKV bias), q4k, q6 and q8 linears (same kernels, same order), at 1 and 3
    sequences, and the KV cache ends up identical; float32 linears run the native GEMV
    there (oneDNN's GEMM in the modules): same tokens, float32 rounding apart. "wide": a
    qwen2 of hidden size 256 (q4k blocks are 256 columns) with every linear made q6 / q4k
    (stacked: qkv a q4k part and a q6 part, the others q4k)."""
    from duetserve.models.quant import QuantLinear
    from tiny_families import FAMILY_VARIANTS, make_family_checkpoint
    from tiny_models import make_tiny_checkpoint
    # families: Gemma 3's sandwich norms, QK-norm, GELU, scaled embeddings and sliding
    # window (8: the requests below pass it), experts routed per row (Qwen3-MoE, Mixtral)
    if variant in FAMILY_VARIANTS:
        path = make_family_checkpoint(str(tmp_path / variant), variant)
    elif variant == "wide":
        path = make_tiny_checkpoint(str(tmp_path / "wide"), "qwen2-qkv-bias", hidden_size=256,
                                    intermediate_size=512)
    else:
        path = tiny_checkpoints[variant]
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.sampling_params import SamplingParams
    runs = {}
    for use_stack in (True, False):
        eng = EngineCore(EngineConfig(model=path, num_threads=2, kv_cache_memory=0.01,
                                      quantization="int8" if variant == "wide" else quant,
                                      enable_prefix_caching=False,
                                      step_time=pinned_step_time(),
                                      check_integrity_when_idle=True))
        model = eng.runner.model
        if variant == "wide":
            for m in model.modules():
                if isinstance(m, QuantLinear):
                    make = _as_q6 if quant == "int6" else _as_q4k
                    if quant == "stacked" and any(m is la.self_attn.qkv_proj
                                                  for la in model.layers):
                        make = _as_stacked
                    m.qweight = make(m.qweight)
                    m.dense = None
        for m in model.modules():     # tiny shapes calibrate to the dense path: force low-bit
            if hasattr(m, "policy"):
                m.policy.lowbit_max_rows = 8
            if type(m) is DenseLinear:  # and the float32 GEMV's bound (timed at load)
                m.gemv_rows = 4
        model.dense_gemv_rows = 4
        model._stack = _UNBUILT if use_stack else None
        for t in (t for kv in eng.runner.kv_caches for t in kv):
            t.zero_()     # start-up measurements may have written slots (or read a cache)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        eng.add_request("a", [3, 4, 5, 6, 7], sp)
        eng.add_request("b", [9, 8, 7], sp)
        eng.add_request("c", [11], sp)
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        if use_stack:
            assert model._stack is not None and model._stack.calls >= 4   # built and used
        runs[use_stack] = (done, [t.clone() for kv in eng.runner.kv_caches for t in kv])
    (a, ca), (b, cb) = runs[True], runs[False]
    for rid in "abc":
        assert a[rid].token_ids == b[rid].token_ids
        if quant != "none":
            assert a[rid].logprobs == b[rid].logprobs
        else:
            for la, lb in zip(a[rid].logprobs, b[rid].logprobs):
                assert la.keys() == lb.keys()
                for t in la:
                    assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    for x, y in zip(ca, cb):
        if quant != "none":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_native_decode_stack_grows_the_rotary_tables(tiny_checkpoints):
    """A decode step whose position is past the rotary tables: the stack runs nothing,
    the tables grow and the step runs again, giving the tokens and logprobs of an engine
    whose tables were never short."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.sampling_params import SamplingParams
    outs = []
    for short in (False, True):
        eng = EngineCore(EngineConfig(model=tiny_checkpoints["qwen2-qkv-bias"], num_threads=2,
                                      kv_cache_memory=0.01, quantization="int4",
                                      enable_prefix_caching=False,
                                      step_time=pinned_step_time(),
                                      check_integrity_when_idle=True))
        model = eng.runner.model
        for m in model.modules():     # tiny shapes calibrate to the dense path: force low-bit
            if hasattr(m, "policy"):
                m.policy.lowbit_max_rows = 8
        model._stack = _UNBUILT
        if short:
            model.rotary._tabulate(4)     # positions 0-3; the prompt and decodes go past
        eng.add_request("a", [3, 4, 5], SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True, logprobs=2))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs.append(o.outputs[0])
        assert model._stack is not None and model._stack.calls >= 6
        if short:
            assert model.rotary.cos.shape[0] >= 11     # grown past the last position (10)
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs


@pytest.mark.parametrize("rows,n,k", [(1, 49152 // 64, 576), (3, 37, 100), (4, 64, 1536)])
def test_f32_gemv_equals_linear(rows, n, k):
    """The native float32 GEMV (decode steps and the LM head of float32 models) equals
    F.linear within float32 summation-order rounding, K tails included."""
    native = ops()
    if native is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(native.f32_gemv(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_build_guard_clears_a_dead_builds_lock_and_excludes_other_builds(tmp_path):
    """torch's `lock` file, left by a killed extension build, would make every later load
    wait forever: under the build guard's flock no build of ours is running, so it is
    removed; while one process holds the guard, another cannot take it."""
    import fcntl

    from duetserve.models import native
    lock = tmp_path / "lock"
    lock.write_text("")
    with native._build_guard(str(tmp_path)):
        assert not lock.exists()
        with open(tmp_path / "build.flock", "w") as other:   # another open file: another holder
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "build.flock", "w") as other:        # released on exit
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with native._build_guard(str(tmp_path)):                   # nothing to remove: no error
        pass


def test_f32_gemv_rows_are_independent_of_the_row_count():
    """Each activation row sums in the same order whatever the step's row count, so a
    sequence's float32 decode result does not depend on what it was batched with."""
    native = ops()
    if native is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 200, generator=g), torch.randn(70, 200, generator=g)
    whole = native.f32_gemv(x, w)
    for i in range(4):
        assert torch.equal(native.f32_gemv(x[i:i + 1], w), whole[i:i + 1])
    assert torch.equal(native.f32_gemv(x[1:3], w), whole[1:3])


@pytest.mark.parametrize("rows", [2, 5, 7, 8, 11, 17])
def test_gemv_rows_equal_alone(rows):
    """The GEMVs compute up to 8 (q4, q4k, q6) or 4 (q8, float32) activation rows in one
    pass over the weights; more rows run in several passes (8 or 4 each, then the rest)
    over tiles of the weight (so later passes read it from cache). Every row equals
    the same row run as a step of its own, bit for bit, for weights spanning many tiles
    (q4, q4k, q6, q8 and float32): a verify step's rows are what decodes of them would compute."""
    from duetserve.models.quant import Int4Weight, Int8Weight, int4_groups_from_float, \
        quantize_int8
    native = ops()
    if native is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(rows)
    n, k = 1001, 1024             # q4: 251 blocks of 2.5 KiB (the last padded), q8: 4 KiB
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    q4 = Int4Weight(*int4_groups_from_float(w))
    q8 = Int8Weight(*quantize_int8(w))
    q6, q4k = _random_q6(n, k, g), _random_q4k(n, k, g)
    for run in (lambda a: native.q4_gemv(a, q4.packed, n),
                lambda a: native.q4k_gemv(a, q4k.packed, n),
                lambda a: native.q6_gemv(a, q6.packed, n),
                lambda a: native.q8_gemv(a, q8.packed, q8.scale32),
                lambda a: native.f32_gemv(a, w)):
        whole = run(x)
        for i in range(rows):
            assert torch.equal(run(x[i:i + 1]), whole[i:i + 1]), i
        assert torch.equal(run(x[1:rows]), whole[1:rows])


def _qkv_views(n, heads, kvh, hd, seed=0):
    """q [n, H, hd], k / v [n, KVH, hd] as strided views of one fused projection, the
    way the attention backend receives them."""
    qkv = torch.randn(n, (heads + 2 * kvh) * hd, generator=torch.Generator().manual_seed(seed))
    q = qkv[:, :heads * hd].view(n, heads, hd)
    k = qkv[:, heads * hd:(heads + kvh) * hd].view(n, kvh, hd)
    v = qkv[:, (heads + kvh) * hd:].view(n, kvh, hd)
    return q, k, v


@pytest.mark.parametrize("n,heads,kvh,hd", [(1, 4, 4, 64), (31, 9, 3, 64), (33, 9, 3, 64),
                                            (100, 6, 2, 128), (257, 8, 1, 64)])
def test_prefill_attention_matches_causal_sdpa(n, heads, kvh, hd):
    q, k, v = _qkv_views(n, heads, kvh, hd)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1), is_causal=True,
                                          enable_gqa=True).transpose(0, 1)
    got = native.prefill_attention(q, k, v, hd ** -0.5)
    if got.numel() == 0:
        pytest.skip("prefill kernel not covered by this build (no AVX-512)")
    assert got.shape == (n, heads, hd)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_prefill_attention_declines_what_it_does_not_cover_and_the_backend_falls_back():
    from duetserve.models.attention import PrefillSeq, TorchAttention
    q, k, v = _qkv_views(20, 4, 2, 32)                       # head size 32: not covered
    assert native.prefill_attention(q, k, v, 32 ** -0.5).numel() == 0
    backend = TorchAttention(4, 2, 32)
    out = torch.zeros(20, 4, 32)
    seq = PrefillSeq(0, 20, torch.arange(20), None)
    assert backend._native_prefill(q, k, v, seq, out) is False
    assert not out.any()


def test_bfloat16_prefill_runs_the_native_kernel_in_float32():
    """A bf16 step's prompt (many-row GEMMs in bfloat16) goes through the native causal
    kernel on its q/k/v widened to float32, not through torch's bf16 SDPA."""
    from duetserve.models.attention import PrefillSeq, TorchAttention
    q, k, v = (t.bfloat16() for t in _qkv_views(40, 9, 3, 64, seed=3))
    backend = TorchAttention(9, 3, 64)
    out = torch.zeros(40, 9, 64, dtype=torch.bfloat16)
    seq = PrefillSeq(0, 40, torch.arange(40), None)
    assert backend._native_prefill(q, k, v, seq, out) is True
    want = native.prefill_attention(q.float(), k.float(), v.float(), 64 ** -0.5)
    assert torch.equal(out, want.bfloat16())
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None],
                                         k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], is_causal=True,
                                         enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)   # bf16 output


needs_bf16 = pytest.mark.skipif(native is None or not native.bf16_attention_available(),
                                reason="no AVX512-BF16 attention kernel in this build")


def _bf16_rounded_reference(q, k, v, start, scale=None):
    """Causal attention of rows at positions start.. over k, v [L, KVH, hd], float32 math
    on q, k, v rounded to bf16 as the kernel rounds them (float32 keys less the first)."""
    n, heads, hd = q.shape
    if k.dtype == torch.float32:
        k = (k - k[:1]).bfloat16().float() + k[:1]
    r = [t.bfloat16().float().transpose(0, 1) for t in (q, k, v)]
    mask = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(r[0], r[1], r[2], attn_mask=mask, enable_gqa=True,
                                          scale=scale).transpose(0, 1)


@needs_bf16
@pytest.mark.parametrize("n,ctx,heads,kvh,hd,kv_dtype", [
    (1, 1, 4, 4, 64, torch.float32), (31, 31, 9, 3, 64, torch.float32),
    (100, 100, 6, 2, 128, torch.bfloat16), (5, 133, 6, 2, 128, torch.float32),
    (70, 200, 8, 1, 256, torch.bfloat16), (64, 129, 4, 2, 64, torch.float32)])
def test_bf16_prompt_attention_matches_the_causal_reference(n, ctx, heads, kvh, hd, kv_dtype):
    """prefill_attention_bf16: a chunk of n rows, the last of a ctx-token context, equals
    float32 causal attention on bf16-rounded inputs to within the rounding of its softmax
    weights (bf16), and float32 attention to within bf16 rounding."""
    g = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, heads, hd, generator=g)
    k, v = (torch.randn(ctx, kvh, hd, generator=g).to(kv_dtype) for _ in range(2))
    got = native.prefill_attention_bf16(q, k, v, hd ** -0.5)
    assert got.shape == (n, heads, hd) and got.dtype == torch.float32
    torch.testing.assert_close(got, _bf16_rounded_reference(q, k, v, ctx - n),
                               rtol=0, atol=6e-3)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None],
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2)


@needs_bf16
def test_bf16_prompt_attention_does_not_depend_on_the_chunking():
    """A row's result is the same bits whether its prompt ran whole or in chunks after
    cached context (key blocks aligned to position 0), and the backend's chunk path over
    a paged cache gives what the kernel gives on the gathered context."""
    from duetserve.models.attention import PrefillSeq, TorchAttention
    q, k, v = _qkv_views(150, 6, 2, 64, seed=5)
    whole = native.prefill_attention_bf16(q, k, v, 64 ** -0.5)
    for a, b in ((0, 37), (37, 101), (101, 150)):
        part = native.prefill_attention_bf16(q[a:b], k[:b], v[:b], 64 ** -0.5)
        assert torch.equal(part, whole[a:b])
    backend = TorchAttention(6, 2, 64)
    backend.bf16_kernel = native.prefill_attention_bf16
    slots = torch.randperm(160)[:150]                        # a scattered paged context
    k_flat, v_flat = torch.zeros(2, 160, 64), torch.zeros(2, 160, 64)
    k_flat[:, slots], v_flat[:, slots] = k.transpose(0, 1), v.transpose(0, 1)
    out = torch.zeros(150, 6, 64)
    seq = PrefillSeq(101, 150, slots, torch.ones(49, 150, dtype=torch.bool))
    assert backend._bf16_chunk(q, k, v, k_flat, v_flat, seq, out)
    assert torch.equal(out[101:], whole[101:]) and not out[:101].any()


@needs_bf16
def test_bf16_chunk_takes_keys_and_values_of_different_dtypes():
    """A fresh chunk of a step whose GEMMs ran in bfloat16 has float32 keys (rotated with
    float32 cos/sin) beside bfloat16 values: the chunk path widens both (the kernel takes
    one dtype) instead of raising (it did: a 301-token prompt on the default model's
    many-row path failed with "shape mismatch")."""
    from duetserve.models.attention import PrefillSeq, TorchAttention
    q, k, v = _qkv_views(40, 6, 2, 64, seed=7)
    backend = TorchAttention(6, 2, 64)
    backend.bf16_kernel = native.prefill_attention_bf16
    out = torch.zeros(40, 6, 64)
    vb = v.bfloat16()
    assert backend._bf16_chunk(q, k, vb, None, None, PrefillSeq(0, 40, torch.arange(40), None),
                               out)
    assert torch.equal(out, native.prefill_attention_bf16(q, k, vb.float(), 64 ** -0.5))


@needs_bf16
def test_engine_bf16_many_row_step_runs_bf16_prompt_attention(tmp_path):
    """A prompt longer than the few-row limit on a model whose many-row GEMMs run in
    bfloat16 (as SmolLM2 Q4_1 where the start-up put the crossover at 256 rows) prefills
    through the bf16 attention kernel and answers like the same engine with float32
    prompt attention (it raised "shape mismatch": float32 rotated keys, bf16 values)."""
    from tiny_models import make_tiny_checkpoint
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.engine.llm import LLM
    from duetserve.loader import load_model
    from duetserve.models.attention import TorchAttention
    from duetserve.models.quant import QuantLinear
    from duetserve.sampling_params import SamplingParams
    path = make_tiny_checkpoint(str(tmp_path / "m"), "llama-gqa-untied", hidden_size=256)
    prompt = torch.randint(3, 290, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    outs = {}
    for mode in ("float32", "bfloat16"):
        loaded = load_model(path, quantization="int4", prefill_attention=mode)
        calls = []
        for b in (m.backend for m in loaded.model.modules()
                  if isinstance(getattr(m, "backend", None), TorchAttention)):
            if b.bf16_kernel is not None:
                def run(q, k, v, scale, kernel=b.bf16_kernel):
                    calls.append((q.shape[0], k.shape[0], k.dtype))
                    return kernel(q, k, v, scale)
                b.bf16_kernel = run
        cfg = EngineConfig(model=path, quantization="int4", num_threads=2,
                           step_time=pinned_step_time(), max_num_batched_tokens=128)
        core = EngineCore(cfg, loaded=loaded)
        linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
        assert linears and all(m.dense is not None for m in linears)
        for m in linears:       # after the start-up's choice: as dtype "auto" where bf16 won
            m.policy.lowbit_max_rows, m.dense = 16, m.dense.to(torch.bfloat16)
        out = LLM.from_engine(core).generate([prompt], sp)[0]
        outs[mode] = out.outputs[0]
        assert out.outputs[0].finish_reason == "length"
        assert (mode == "bfloat16") is any(n == ctx == 120 for n, ctx, _ in calls)
    a, b = outs["float32"], outs["bfloat16"]
    t = a.token_ids[0]
    assert b.token_ids[0] == t and abs(a.logprobs[0][t].logprob - b.logprobs[0][t].logprob) < 0.1


@needs_bf16
def test_engine_runs_prompt_attention_in_bf16_on_a_low_bit_model(tmp_path):
    """--prefill-attention bfloat16 on a low-bit model with 64-wide heads: every prompt
    chunk, fresh or after cached context, goes through the bf16 kernel (float32 leaves it
    unset), and the engine's first tokens and log-probabilities match those of the same
    engine with the kernel replaced by float32 attention on the same bf16-rounded inputs,
    to within what rounding the softmax weights moves them on this random model (a wrong
    context or offset moves them by far more; test_bf16_prompt_attention_does_not_depend_
    on_the_chunking checks the chunk path bit for bit)."""
    from tiny_models import make_tiny_checkpoint
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.engine.llm import LLM
    from duetserve.loader import load_model
    from duetserve.models.attention import TorchAttention
    from duetserve.sampling_params import SamplingParams
    from safetensors.torch import load_file, save_file
    path = make_tiny_checkpoint(str(tmp_path / "m"), "llama-gqa-untied", hidden_size=256)
    weights = load_file(f"{path}/model.safetensors")
    for name in weights:        # softer scores (the helper's are sharp: std ~10 at 64 dims)
        if "q_proj" in name or "k_proj" in name:
            weights[name] = weights[name] * 0.3
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (20, 75, 200)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    firsts = {}
    for mode in ("float32", "bfloat16", "emulated"):
        loaded = load_model(path, quantization="int8",
                            prefill_attention="float32" if mode == "float32" else "bfloat16")
        backends = [m.backend for m in loaded.model.modules()
                    if isinstance(getattr(m, "backend", None), TorchAttention)]
        assert backends and all((b.bf16_kernel is not None) is (mode != "float32")
                                for b in backends)
        calls = []

        def spy(kernel):
            def run(q, k, v, scale):
                calls.append((q.shape[0], k.shape[0]))
                if mode == "emulated":
                    return _bf16_rounded_reference(q, k, v, k.shape[0] - q.shape[0], scale)
                return kernel(q, k, v, scale)
            return run
        for b in backends:
            if b.bf16_kernel is not None:
                b.bf16_kernel = spy(b.bf16_kernel)
        cfg = EngineConfig(model=path, quantization="int8", num_threads=2,
                           step_time=pinned_step_time(), max_num_batched_tokens=96)
        llm = LLM.from_engine(EngineCore(cfg, loaded=loaded))   # chunks > 64: not decode rows
        outs = [llm.generate([p], sp)[0].outputs[0] for p in prompts]
        firsts[mode] = [(o.token_ids[0], o.logprobs[0][o.token_ids[0]].logprob) for o in outs]
        if mode != "float32":
            assert any(n < ctx for n, ctx in calls) and any(n == ctx for n, ctx in calls)
    for (t, lp), (te, lpe) in zip(firsts["bfloat16"], firsts["emulated"]):
        assert t == te and abs(lp - lpe) < 0.1      # seen: <= 0.036 (the P rounding)
    assert firsts["float32"] != firsts["bfloat16"]          # a different kernel ran


def test_finish_dense_sets_the_measured_gemv_bound(tiny_checkpoints, monkeypatch):
    """finish_dense puts the calibrated row bound on every float32 linear and on the model
    (tied LM head, decode stack); dense_linear runs the GEMV up to it and oneDNN above,
    the same product either way (float32 rounding apart)."""
    from duetserve.loader import load_model
    from duetserve.models import kernels
    from duetserve.models.layers import dense_linear
    monkeypatch.setattr(kernels, "calibrate_dense_gemv_rows", lambda model: 6)
    loaded = load_model(tiny_checkpoints["llama-gqa-tied"])
    model = loaded.model
    linears = [m for m in model.modules() if type(m) is DenseLinear]
    assert linears and {m.gemv_rows for m in linears} == {6} and model.dense_gemv_rows == 6
    assert "native GEMV up to 6 rows" in loaded.describe()
    w = linears[0].weight.detach()
    x = torch.randn(8, w.shape[1])
    torch.testing.assert_close(dense_linear(x, w, None, 8), dense_linear(x, w, None, 0),
                               atol=1e-5, rtol=1e-5)


def test_dense_gemv_calibration_stops_at_the_first_loss(tiny_checkpoints, monkeypatch):
    """The search keeps the largest row count before oneDNN first wins (here: a fake clock
    where the GEMV loses from 8 rows on, then would win again at 16)."""
    from duetserve.loader import load_model
    from duetserve.models import kernels, layers
    monkeypatch.setattr(kernels, "_cached", lambda key, measure: measure())
    model = load_model(tiny_checkpoints["llama-gqa-tied"]).model
    clock = [0.0]
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])

    def fake_dense_linear(x, w, bias=None, gemv_rows=4):
        rows = x.shape[0]
        gemv_wins = rows < 8 or rows >= 16
        clock[0] += 1.0 if (rows <= gemv_rows) == gemv_wins else 2.0
    monkeypatch.setattr(layers, "dense_linear", fake_dense_linear)
    assert kernels.calibrate_dense_gemv_rows(model) == 6


def test_short_chunks_become_decode_rows_with_the_logits_at_their_end(monkeypatch):
    """With the in-place kernel, a chunk of up to CHUNK_AS_DECODE_ROWS tokens is laid out
    as decode rows after the decodes, contiguous and in position order (context = its
    position + 1), with a logits row only at its end when the slice needs one; a longer
    chunk stays a prefill; without the kernel nothing is expanded."""
    from duetserve.worker import batch as B
    monkeypatch.setattr(B, "CHUNK_AS_DECODE_ROWS", 4)
    work = [B.SeqWork("long", [1, 2, 3, 4, 5], 0, [40, 41], True),
            B.SeqWork("dec", [9], 7, [3, 4], True),
            B.SeqWork("chunk", [6, 7, 8], 5, [10, 11], True),
            B.SeqWork("part", [2, 3], 0, [20], False)]
    b = B.build_step_batch(work, 4, paged_decode=True)
    assert b.input_ids.tolist() == [9, 6, 7, 8, 2, 3, 1, 2, 3, 4, 5]
    assert b.positions.tolist() == [7, 5, 6, 7, 0, 1, 0, 1, 2, 3, 4]
    assert b.meta.num_decodes == 6
    assert b.meta.decode_context_lens.tolist() == [8, 6, 7, 8, 1, 2]
    assert b.meta.decode_block_tables[1].tolist() == [10, 11]
    assert [(p.start, p.end) for p in b.meta.prefills] == [(6, 11)]
    assert b.order == ["dec", "chunk", "part", "long"]
    assert b.logits_req_ids == ["dec", "chunk", "long"]
    assert b.logits_indices.tolist() == [0, 3, 10]
    plain = B.build_step_batch(work, 4, paged_decode=False)
    assert plain.meta.num_decodes == 1 and len(plain.meta.prefills) == 3
    assert plain.logits_req_ids == ["dec", "long", "chunk"]


# --- sliding-window attention (Gemma 3's local layers) --------------------------------

def _windowed_reference(q, kc, vc, tables, lens, window, scale):
    kvh, _, bs, hd = kc.shape
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window), n)
        slots = tables[b][pos // bs] * bs + pos % bs
        k = kc.reshape(kvh, -1, hd)[:, slots]
        v = vc.reshape(kvh, -1, hd)[:, slots]
        o = F.scaled_dot_product_attention(q[b].view(kvh, -1, 1, hd), k[:, None], v[:, None],
                                           scale=scale)
        out.append(o.reshape(-1, hd))
    return torch.stack(out)


@pytest.mark.parametrize("kvh,heads,hd", [(2, 6, 32), (1, 4, 256), (1, 9, 64)])
@pytest.mark.parametrize("window", [5, 16, 40])
def test_paged_decode_window_reads_only_the_window(kvh, heads, hd, window):
    """Only the last `window` positions are attended to, and the blocks wholly before them
    are never read: the table points them at a block full of NaN (as a released sliding
    block points at the null block)."""
    q, kc, vc, tables, lens = _case(kvh, heads, hd, lens=(1, 15, 17, 40, 130))
    poison = kc.shape[1] - 1
    kc[:, poison] = float("nan")
    vc[:, poison] = float("nan")
    tables = tables.clone()
    tables[tables == poison] = 0
    bs = kc.shape[2]
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window) // bs             # the first block the window needs
        tables[b, :first] = poison
    scale = 0.3
    got = native.paged_decode_attention(q, kc, vc, tables, lens, scale, window)
    want = _windowed_reference(q, kc, vc, tables, lens, window, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,heads,kvh,hd,window", [(100, 4, 1, 256, 37), (300, 9, 3, 64, 64),
                                                   (70, 4, 2, 128, 1), (50, 4, 4, 64, 80)])
def test_prefill_attention_window_matches_masked_sdpa(n, heads, kvh, hd, window):
    q, k, v = _qkv_views(n, heads, kvh, hd, seed=5)
    i = torch.arange(n)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1), attn_mask=mask, scale=0.2,
                                          enable_gqa=True).transpose(0, 1)
    got = native.prefill_attention(q, k, v, 0.2, window)
    if got.numel() == 0:
        pytest.skip("prefill kernel not covered by this build (no AVX-512)")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * hd / 64)   # longer dots


def test_backend_window_paths_agree():
    """A sliding-window layer's chunk through every path the backend has: without a
    cached prefix (native kernel, and the row-block fallback), after a cached prefix
    (gathered from the paged cache, blocks before the window poisoned with NaN), and as
    decode rows read in place; all equal the masked reference."""
    from duetserve.models.attention import AttentionMetadata, PrefillSeq, TorchAttention
    heads, kvh, hd, window, bs, n = 4, 2, 64, 24, 8, 60
    q, k, v = _qkv_views(n, heads, kvh, hd, seed=7)
    i = torch.arange(n)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1), attn_mask=mask,
                                          enable_gqa=True).transpose(0, 1)
    backend = TorchAttention(heads, kvh, hd, window=window)
    nb = n // bs + 2
    slots = torch.arange(n)                                   # blocks 0.. in order

    def cache():
        return torch.zeros(kvh, nb, bs, hd), torch.zeros(kvh, nb, bs, hd)
    # whole chunk, no prefix
    kc, vc = cache()
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillSeq(0, n, slots[:0], None)])
    torch.testing.assert_close(backend.forward(q, k, v, (kc, vc), meta), want, atol=2e-6, rtol=0)
    torch.testing.assert_close(backend._windowed(q.transpose(0, 1), k.transpose(0, 1),
                                                 v.transpose(0, 1), 0, 0).transpose(0, 1),
                               want, atol=2e-6, rtol=0)
    # the last 20 tokens after 40 cached ones; positions before the window poisoned
    kc, vc = cache()
    first = AttentionMetadata(slot_mapping=slots[:40],
                              prefills=[PrefillSeq(0, 40, slots[:0], None)])
    backend.forward(q[:40], k[:40], v[:40], (kc, vc), first)
    cut = (40 - window + 1) // bs * bs                        # blocks before: released
    kc.view(kvh, -1, hd)[:, :cut] = float("nan")
    vc.view(kvh, -1, hd)[:, :cut] = float("nan")
    ctx = torch.arange(n)
    chunk = AttentionMetadata(slot_mapping=slots[40:], prefills=[PrefillSeq(
        0, 20, ctx, ctx[None, :] <= (40 + torch.arange(20))[:, None])])
    got = backend.forward(q[40:], k[40:], v[40:], (kc, vc), chunk)
    torch.testing.assert_close(got, want[40:], atol=2e-6, rtol=0)
