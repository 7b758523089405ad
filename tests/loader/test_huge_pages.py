"""Weights moved into 2 MiB pages (loader/huge_pages.py): same values, same sharing, same
outputs; small tensors and --no-huge-pages leave everything where it was."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from duetserve.loader import huge_pages
from duetserve.models.quant import Int4Weight, KernelPolicy, QuantLinear, int4_groups_from_float

pytestmark = pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                                reason="kernel without transparent huge pages")


class _Model(nn.Module):
    """A 2 MiB dense linear, a tied copy of it, a packed int4 linear, a small bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(1024, 512)                    # 2 MiB weight, 2 KiB bias
        self.tied = nn.Linear(1024, 512, bias=False)
        self.tied.weight = self.dense.weight                 # one Parameter, two modules
        w = torch.randn(1024, 2048)
        self.q4 = QuantLinear(Int4Weight(*int4_groups_from_float(w)), None,
                              KernelPolicy(dense_dtype=torch.float32, reason="test"))
        self.q4_prefix = self.q4.prefix(512)                 # a view of q4's packed storage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x[:, :1024]) + self.tied(x[:, :1024]).sum(-1, keepdim=True)
        return torch.cat([h, self.q4(x), self.q4_prefix(x)], dim=-1)


def test_weights_move_into_one_aligned_mapping_with_values_and_sharing_kept(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    model = _Model()
    x = torch.randn(3, 2048)
    with torch.inference_mode():
        want = model(x)
    packed = model.q4.qweight.packed
    before = {"dense": model.dense.weight.clone(), "packed": packed.clone()}
    bias_ptr = model.dense.bias.data_ptr()
    prefix_offset = model.q4_prefix.qweight.packed.data_ptr() - packed.data_ptr()

    line = huge_pages.place_weights(model)

    assert line.startswith("in 2 MiB pages (") and "2 storages" in line, line
    w = model.dense.weight
    assert isinstance(w, nn.Parameter) and model.tied.weight is w
    assert w.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()   # one arena
    assert min(w.data_ptr(), packed.data_ptr()) % huge_pages.HUGE_PAGE == 0
    assert model.q4_prefix.qweight.packed.data_ptr() - packed.data_ptr() == prefix_offset
    assert torch.equal(w, before["dense"]) and torch.equal(packed, before["packed"])
    assert model.dense.bias.data_ptr() == bias_ptr           # under 1 MiB: not moved
    with torch.inference_mode():
        assert torch.equal(model(x), want)


def test_nothing_moves_when_turned_off_or_unavailable(monkeypatch):
    model = _Model()
    ptr = model.dense.weight.data_ptr()
    assert huge_pages.place_weights(model, enabled=False) == \
        "in the allocator's pages (--no-huge-pages)"
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert huge_pages.place_weights(model) == \
        "in 4 KiB pages (transparent huge pages: never)"
    assert model.dense.weight.data_ptr() == ptr


def test_the_loader_reports_where_the_weights_are(default_model):
    mode = huge_pages.thp_mode()
    expect = "in 2 MiB pages (" if mode in ("always", "madvise") else "in 4 KiB pages ("
    assert default_model.weight_pages.startswith(expect), default_model.weight_pages
    assert default_model.weight_pages in default_model.describe()
