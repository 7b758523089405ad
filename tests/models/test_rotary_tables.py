"""Rotary tables start small and grow on demand to the model's limit."""
from __future__ import annotations

import pytest
import torch

from duetserve.models.layers import RotaryEmbedding


def test_tables_grow_to_the_positions_asked_and_match_a_full_build(monkeypatch):
    monkeypatch.setattr(RotaryEmbedding, "INITIAL_POSITIONS", 64)
    lazy = RotaryEmbedding(32, 10000.0, None)
    lazy.build(1000, "cpu", torch.float32)
    assert lazy.cos.shape[0] == 64
    monkeypatch.setattr(RotaryEmbedding, "INITIAL_POSITIONS", 1000)
    full = RotaryEmbedding(32, 10000.0, None)
    full.build(1000, "cpu", torch.float32)
    pos = torch.tensor([0, 63, 64, 300, 999])
    got, want = lazy.tables(pos), full.tables(pos)
    assert lazy.cos.shape[0] == 1000            # 64 -> 128 -> ... -> capped at the limit
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(IndexError, match="1000 positions"):
        lazy.tables(torch.tensor([1000]))
