"""Byte segments of a block copy, and the int8 staging round trip (no model)."""
from __future__ import annotations

import pytest
import torch

from duetserve.kv_transfer.compress import Int8Staging
from duetserve.kv_transfer.layout import KVLayout, block_runs, segments


def test_runs_coalesce_where_both_sides_are_consecutive() -> None:
    assert block_runs([7, 8, 9, 3], [2, 3, 5, 6]) == [(7, 2, 2), (9, 5, 1), (3, 6, 1)]


def test_segments_match_a_tensor_copy() -> None:
    src_l = KVLayout(2, 3, 10, 4, 8, "float32")
    dst_l = KVLayout(2, 3, 6, 4, 8, "float32")
    src = torch.randn(2, 2, 3, 10, 4, 8)
    dst = torch.zeros(2, 2, 3, 6, 4, 8)
    src_ids, dst_ids = [4, 5, 9], [0, 1, 3]
    s_bytes, d_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for s, d, n in segments(src_l, dst_l, src_ids, dst_ids):
        d_bytes[d:d + n] = s_bytes[s:s + n]
    assert torch.equal(dst[:, :, :, dst_ids], src[:, :, :, src_ids])
    assert dst[:, :, :, [2, 4, 5]].abs().sum() == 0


def test_incompatible_layouts_and_bad_ids_are_named() -> None:
    a = KVLayout(2, 3, 10, 4, 8, "float32")
    with pytest.raises(ValueError, match="head_dim"):
        segments(a, KVLayout(2, 3, 10, 4, 16, "float32"), [0], [0])
    with pytest.raises(ValueError, match="out of range"):
        segments(a, a, [10], [0])


def _round_trip(layout: KVLayout, src: torch.Tensor, ids: list[int]) -> torch.Tensor:
    dst = torch.zeros_like(src)
    a, b = Int8Staging(layout, src), Int8Staging(layout, dst)
    a.pack(ids)
    b.data.copy_(a.data)
    b.scales.copy_(a.scales)
    b.unpack(ids)
    return dst


def test_int8_round_trip_within_half_a_step() -> None:
    """K: one step per (block, channel); V: one step per (block, token)."""
    layout = KVLayout(2, 2, 5, 4, 8, "float32")
    src = torch.randn(layout.num_planes, 5, 32)
    dst = _round_trip(layout, src, [1, 3, 4])
    rows = src.view(2, 2, 2, 5, 4, 8)[:, :, :, [1, 3, 4]]
    got = dst.view(2, 2, 2, 5, 4, 8)[:, :, :, [1, 3, 4]]
    k_step = rows[:, 0].abs().amax(dim=3, keepdim=True) / 127      # over the block's tokens
    v_step = rows[:, 1].abs().amax(dim=4, keepdim=True) / 127      # over the head_dim
    tol = 1e-3           # float16 scales: relative rounding of the step
    assert ((got[:, 0] - rows[:, 0]).abs() <= k_step * (0.5 + tol) + 1e-6).all()
    assert ((got[:, 1] - rows[:, 1]).abs() <= v_step * (0.5 + tol) + 1e-6).all()
    assert dst.view(2, 2, 2, 5, 4, 8)[:, :, :, [0, 2]].abs().sum() == 0


def test_int8_key_outlier_channel_does_not_flatten_the_others() -> None:
    """A key channel 100x larger than the rest (as in SmolLM2) keeps the other channels'
    relative error small: per-token scales would round them to about 1/127 of the
    outlier, i.e. mostly to 0."""
    layout = KVLayout(1, 1, 2, 16, 64, "float32")
    src = torch.randn(layout.num_planes, 2, 16 * 64)
    src.view(1, 2, 1, 2, 16, 64)[:, 0, :, :, :, 5] *= 100.0
    dst = _round_trip(layout, src, [0, 1])
    k_src = src.view(1, 2, 1, 2, 16, 64)[:, 0]
    k_got = dst.view(1, 2, 1, 2, 16, 64)[:, 0]
    others = [c for c in range(64) if c != 5]
    rel = (k_got[..., others] - k_src[..., others]).norm() / k_src[..., others].norm()
    assert rel < 0.02


def test_int8_bfloat16_cache_and_tiny_values() -> None:
    layout = KVLayout(1, 1, 3, 4, 8, "bfloat16")
    src = (torch.randn(layout.num_planes, 3, 32) * 1e-7).to(torch.bfloat16)
    dst = _round_trip(layout, src, [2])
    assert torch.isfinite(dst.float()).all()
    assert (dst.float() - src.float())[:, 2].abs().max() <= 127 * 2.0 ** -14 / 2
