"""Low-bit weights kept low-bit, and the linear layer that picks its kernel by rows.

Two packed forms, in torch's CPU layouts. Decode steps run duetserve's own GEMV kernels
on them (csrc/lowbit_gemv.cpp: float32 activations, AVX-512) when those are built, else
torch's kernels (which want bfloat16 activations; float32 ones take a slow path):

- `Int4Weight`: groups of 32 along K, `w = (q - 8) * scale + zero`, q in 0..15, packed by
  `aten._convert_weight_to_int4pack_for_cpu`, run by `aten._weight_int4pack_mm_for_cpu`.
  GGUF Q4_0 / Q4_1 / Q4_K map onto it exactly, up to the scale and zero being stored in
  bfloat16 (the kernel's requirement): |error| <= 2^-8 (|q - 8| |scale| + |zero|) per weight.
- `Int8Weight`: one scale per output row, symmetric, run by `aten._weight_int8pack_mm`.
  Formats that are not 4-bit (Q5_x, Q6_K, Q8_0, and float checkpoints) are requantized
  into it: |error| <= scale / 2 = max|w_row| / 254 per weight (+ the bfloat16 rounding of
  the scale, 2^-8 relative).

`QuantLinear.forward` picks per call: rows <= `policy.lowbit_max_rows` (decode steps) run
the low-bit GEMV-style kernel, which reads 4 or 8 bits per weight; more rows (prefill
chunks, large batches) are bound by FLOPs, so they run a dense GEMM in `policy.dense_dtype`
on a resident dense copy when one was kept, else on weights dequantized for the call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from duetserve.models.native import ops as _native_ops

_NATIVE = _native_ops()   # compiled kernels (int4/int8 GEMV) or None: torch's kernels
GROUP = 32
_DEQUANT_ROWS = 2048   # rows dequantized at a time on the many-row path without a dense copy
_INT4_BLOCK_N = 64     # torch's CPU int4 packing interleaves rows in blocks of 64


@dataclass
class KernelPolicy:
    """Shared by every QuantLinear of a model; set once at load (see models/kernels.py)."""

    lowbit_max_rows: int = 8
    dense_dtype: torch.dtype = torch.float32
    reason: str = ""


class Int4Weight:
    """Packed int4 [N, K/2] uint8 + scales_and_zeros [K/32, N, 2] bfloat16."""

    bits = 4

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """q: [N, K] uint8 in 0..15; scale, zero: [N, K/32] float32."""
        n, k = q.shape
        if n % _INT4_BLOCK_N or k % GROUP:
            raise ValueError(f"int4 packing needs N % {_INT4_BLOCK_N} == 0 and K % {GROUP} "
                             f"== 0, got {n} x {k}")
        self.shape = (n, k)
        parts = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q[i:i + 4096].to(torch.int32), 1) for i in range(0, n, 4096)]
        self.packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]: the native GEMV (float32 in and out) when built, else
        torch's kernel (bfloat16 in and out)."""
        if _NATIVE is not None:
            return _NATIVE.int4_gemv(x.float(), self.packed, self.sz)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed,
                                                          GROUP, self.sz)

    def _codes(self, blocks: torch.Tensor) -> torch.Tensor:
        """Packed bytes [B, K, 32] of B row-blocks -> codes [B * 64, K] (int16)."""
        b, k, _ = blocks.shape
        lo, hi = blocks & 15, blocks >> 4           # rows j and 32 + j of each block
        return torch.stack([lo, hi], 1).permute(0, 1, 3, 2).reshape(b * 64, k).to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32, a: int = 0,
                   b: int | None = None) -> torch.Tensor:
        """Rows [a, b) (multiples of 64) as a dense [b - a, K] tensor."""
        n, k = self.shape
        b = n if b is None else b
        if _NATIVE is not None and dtype == torch.bfloat16:
            return _NATIVE.int4_dequant_bf16(self.packed, self.sz, a, b)
        q = self._codes(self.packed[a:b].view((b - a) // 64, k, 32))
        s = self.sz[:, a:b, 0].t().to(dtype).repeat_interleave(GROUP, 1)
        z = self.sz[:, a:b, 1].t().to(dtype).repeat_interleave(GROUP, 1)
        return (q - 8).to(dtype) * s + z

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` [n] -> [n, K] float32 (embedding lookup)."""
        n, k = self.shape
        view = self.packed.view(n // 64, k, 32)
        blk, r = ids // 64, ids % 64
        b = view[blk, :, r % 32]                                 # [n, K]
        q = torch.where((r >= 32)[:, None], b >> 4, b & 15).float()
        sz = self.sz[:, ids].float()                             # [K/32, n, 2]
        s = sz[..., 0].t().repeat_interleave(GROUP, 1)
        z = sz[..., 1].t().repeat_interleave(GROUP, 1)
        return (q - 8) * s + z

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.sz.numel() * 2


class Int8Weight:
    """int8 [N, K] + one bfloat16 scale per row."""

    bits = 8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """q: int8 [N, K]; scale: [N] (see `quantize_int8`)."""
        self.q = q
        self.scale = scale.to(torch.bfloat16)
        self.scale32 = self.scale.float()     # the native kernel's operand (N floats)
        self.shape = tuple(q.shape)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Weight":
        return cls(*quantize_int8(w))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # The native int8 GEMV wins only for one row of a large matrix (the LM head at
        # batch 1: 1.9 vs 3.2 ms for 49152 x 576 here); torch's kernel elsewhere.
        if _NATIVE is not None and x.shape[0] == 1 and self.shape[0] >= 8192:
            return _NATIVE.int8_gemv(x.float(), self.q, self.scale32)
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale)

    def dequantize(self, dtype: torch.dtype = torch.float32, a: int = 0,
                   b: int | None = None) -> torch.Tensor:
        return self.q[a:b].to(dtype) * self.scale[a:b].to(dtype)[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[ids].float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2


QuantWeight = Int4Weight | Int8Weight


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of float w [N, K] -> (q int8 [N, K], scale bfloat16 [N]),
    w ~= q * scale. Rows are independent, so a tensor may be quantized in row chunks."""
    w = w.float()
    scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int4_groups_from_float(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 over groups of 32 of float w [N, K] -> (q uint8 [N, K],
    scale [N, K/32], zero [N, K/32]) with w ~= (q - 8) * scale + zero (for `--quantization
    int4` of a checkpoint that is not already 4-bit; lossy: |error| <= scale / 2)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(n, k), scale, lo + 8.0 * scale


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W low-bit."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None,
                 policy: KernelPolicy, dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = qweight
        self.out_features, self.in_features = qweight.shape
        self.bias = None if bias is None else bias.float()
        self.policy = policy
        self.dense = dense            # resident dense copy in policy.dense_dtype, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 -> [M, N] in the kernel's output dtype (bfloat16
        for the low-bit kernels and bf16 GEMMs). Consumers widen it for free: the residual
        add, the rotary tables and the bias are float32, so type promotion does the cast
        inside an op the model runs anyway (one op per linear saved at decode)."""
        if x.shape[0] <= self.policy.lowbit_max_rows:
            y = self.qweight.matmul(x)
        elif self.dense is not None:
            y = F.linear(x.to(self.dense.dtype), self.dense)
        else:
            y = self._dequantized_gemm(x.to(self.policy.dense_dtype))
        return y if self.bias is None else y + self.bias

    def _dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows, no resident dense copy: dequantize _DEQUANT_ROWS output rows at a
        time and multiply, so the transient stays small (a few MiB, not the whole
        dense matrix)."""
        n = self.out_features
        if n <= _DEQUANT_ROWS:
            return F.linear(x, self.qweight.dequantize(x.dtype))
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        for a in range(0, n, _DEQUANT_ROWS):
            b = min(n, a + _DEQUANT_ROWS)
            torch.matmul(x, self.qweight.dequantize(x.dtype, a, b).t(), out=y[:, a:b])
        return y

    @property
    def nbytes(self) -> int:
        dense = 0 if self.dense is None else self.dense.numel() * self.dense.element_size()
        return self.qweight.nbytes + dense

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, int{self.qweight.bits}, "
                f"dense={'none' if self.dense is None else self.dense.dtype}")


class QuantEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the rows it is asked for."""

    def __init__(self, qweight: QuantWeight) -> None:
        super().__init__()
        self.qweight = qweight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids)
