"""Row prefixes of low-bit weights and the reduced LM head (a draft model's reduced
vocabulary): the first n rows' outputs equal the full weight's, bit for bit."""
from __future__ import annotations

import pytest
import torch

from duetserve.models.quant import Int4Weight, Int8Weight, KernelPolicy, QuantLinear, \
    int4_groups_from_float


def _weights(n: int, k: int):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g)
    return Int4Weight(*int4_groups_from_float(w)), Int8Weight.from_float(w)


@pytest.mark.parametrize("n", [1, 4, 37, 64])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_prefix_equals_full_weight_rows(n: int, rows: int) -> None:
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(4))
    for w in _weights(70, 96):
        p = w.prefix(n)
        assert p.shape == (n, 96)
        assert p.packed.data_ptr() == w.packed.data_ptr()     # shared, not copied
        assert torch.equal(p.matmul(x), w.matmul(x)[:, :n])
        bias = torch.randn(70)
        lin = QuantLinear(w, bias, KernelPolicy())
        assert torch.equal(lin.prefix(n)(x), lin(x)[:, :n])


def test_prefix_bounds() -> None:
    for w in _weights(8, 32):
        with pytest.raises(ValueError, match="row prefix 9 outside 1..8"):
            w.prefix(9)


def test_compute_logits_num_ids(tiny_checkpoints) -> None:
    from duetserve.loader import load_model
    for name, quant in (("llama-gqa-untied", "auto"), ("llama-gqa-tied", "auto"),
                        ("llama-gqa-untied", "int4"), ("llama-gqa-tied", "int8")):
        model = load_model(tiny_checkpoints[name], quantization=quant).model
        h = torch.randn(3, model.config.hidden_size)
        full = model.compute_logits(h)
        assert torch.equal(model.compute_logits(h, 100), full[:, :100])
        assert torch.equal(model.compute_logits(h, model.config.vocab_size), full)
