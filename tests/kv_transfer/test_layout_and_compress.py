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


def test_int8_round_trip_within_half_a_step() -> None:
    layout = KVLayout(2, 2, 5, 4, 8, "float32")
    src = torch.randn(layout.num_planes, 5, 32)
    dst = torch.zeros_like(src)
    a, b = Int8Staging(layout, src), Int8Staging(layout, dst)
    a.pack([1, 3])
    b.data.copy_(a.data)
    b.scales.copy_(a.scales)
    b.unpack([1, 3])
    rows = src.view(layout.num_planes, 5, 4, 8)[:, [1, 3]]
    step = rows.abs().amax(dim=3, keepdim=True) / 127
    got = dst.view(layout.num_planes, 5, 4, 8)[:, [1, 3]]
    assert ((got - rows).abs() <= step / 2 + 1e-6).all()
    assert dst[:, [0, 2, 4]].abs().sum() == 0
