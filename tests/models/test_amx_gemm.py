"""The AMX many-row kernel (csrc/lowbit_gemv.cpp: amx_gemm, issue 67): x times a packed
low-bit weight on AMX bf16 tiles equals the dense bf16 product (x and the dequantized
weight rounded to bf16, sums in float32) for every packed form, stacked parts, row and
column counts that are not whole tiles, and weights stored in several K tiles. Runs only
where the CPU reports AMX (amx_tile, amx_bf16) and the native kernels were built with it;
elsewhere the path is never taken (tests/models/test_lowbit_policy.py)."""
from __future__ import annotations

import pytest
import torch

from duetserve.models import kernels
from duetserve.models.native import cpu_flags, ops
from duetserve.models.quant import (Int8GWeight, KernelPolicy, QuantLinear, StackedWeight,
                                    TILE_COLS)

_OPS = ops()
pytestmark = pytest.mark.skipif(
    _OPS is None or not _OPS.amx_available(),
    reason=f"no AMX here (CPU flags: {sorted(f for f in cpu_flags() if 'amx' in f) or 'none'})")


def _weight(form: str, n: int, k: int, gen: torch.Generator):
    if form == "int8g":
        return Int8GWeight(torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen),
                           torch.rand(n, k // 32, generator=gen).half() * 1e-2,
                           -torch.rand(n, k // 32, generator=gen).half())
    return kernels.probe_forms(n, k, gen)[form]


def _reference(x: torch.Tensor, w) -> torch.Tensor:
    """The dense bf16 product in float64: what the tiles compute, up to summation order."""
    return x.bfloat16().double() @ w.dequantize(torch.bfloat16).double().t()


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    # float32 sums of K products, in another order: a few ulps of the largest term's scale
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("form", ["int4", "int4k", "int6", "int8g"])
@pytest.mark.parametrize("m", [1, 31, 33, 100])
def test_amx_gemm_equals_the_dense_bf16_product(form: str, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    w = _weight(form, 80, 512, gen)          # 80 rows: five 16-row blocks, not whole pairs
    x = torch.randn(m, 512, generator=gen)
    _check(_OPS.amx_gemm(x, [w.packed], [80]), _reference(x, w))


def test_weights_in_several_k_tiles_accumulate_across_them() -> None:
    k = TILE_COLS * 2 + 512                  # three K tiles of the packed form
    gen = torch.Generator().manual_seed(3)
    w = _weight("int4k", 160, k, gen)        # and more than one 128-row chunk
    assert w.packed.shape[0] == 3
    x = torch.randn(70, k, generator=gen)
    _check(_OPS.amx_gemm(x, [w.packed], [160]), _reference(x, w))


def test_stacked_parts_of_different_forms_in_one_call() -> None:
    gen = torch.Generator().manual_seed(4)
    parts = [_weight("int4k", 64, 256, gen), _weight("int6", 48, 256, gen),
             _weight("int4", 24, 256, gen)]
    stacked = StackedWeight(parts)
    x = torch.randn(40, 256, generator=gen)
    want = torch.cat([_reference(x, p) for p in parts], dim=1)
    _check(stacked.amx_matmul(x), want)


def test_a_quant_linear_under_the_amx_policy_runs_amx_above_the_bound() -> None:
    gen = torch.Generator().manual_seed(5)
    w = _weight("int4k", 96, 512, gen)
    bias = torch.randn(96, generator=gen)
    layer = QuantLinear(w, bias, KernelPolicy(lowbit_max_rows=8, many_rows="amx"))
    x = torch.randn(64, 512, generator=gen)
    with torch.inference_mode():
        got = layer(x)
    _check(got - bias, _reference(x, w))
    # bf16 inputs as the dense bf16 GEMM takes them give the same products
    with torch.inference_mode():
        torch.testing.assert_close(layer(x.bfloat16()), got, rtol=0, atol=0)
