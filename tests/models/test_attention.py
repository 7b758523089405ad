"""A prefill chunk after a cached prefix: the grouped-query path (small chunks) and the
two-part flash path (long chunks) equal torch's masked SDPA, the reference they replaced."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duetserve.models.attention import TorchAttention


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("n,ctx", [(1, 40), (16, 16 + 300), (33, 33 + 7)])
@pytest.mark.parametrize("path", ["_grouped", "_after_prefix"])
def test_prefix_attention_equals_masked_sdpa(heads, kv_heads, n, ctx, path) -> None:
    g = torch.Generator().manual_seed(heads * 100 + n)
    hd = 16
    q = torch.randn(n, heads, hd, generator=g).transpose(0, 1)     # [H, n, hd] strided
    k = torch.randn(kv_heads, ctx, hd, generator=g)
    v = torch.randn(kv_heads, ctx, hd, generator=g)
    start = ctx - n
    mask = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
    attn = TorchAttention(heads, kv_heads, hd)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                         enable_gqa=heads != kv_heads)
    out = getattr(attn, path)(q, k, v, mask)
    assert out.shape == (heads, n, hd)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_two_part_flash_in_bf16_stays_within_bf16_rounding() -> None:
    """bf16_prefill (AMX machines): the two flash calls take bf16 q/k/v, their
    log-sum-exps stay float32, and the merged result is the float32 one to bf16 rounding."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, hd, n, ctx = 8, 2, 64, 96, 96 + 200
    q = torch.randn(heads, n, hd, generator=g)
    k = torch.randn(kv_heads, ctx, hd, generator=g)
    v = torch.randn(kv_heads, ctx, hd, generator=g)
    mask = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    attn = TorchAttention(heads, kv_heads, hd)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = attn._after_prefix(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out.shape == (heads, n, hd)
    err = (out.float() - ref).abs().max().item()
    assert err < 0.03, err
