"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from duetserve.models.native import ops

_NATIVE = ops()     # compiled fused row ops, or None (plain torch below)


DENSE_GEMV_ROWS = 4   # float32 linears of up to this many rows: the native GEMV, until the
#                       loader measures this machine's bound (kernels.calibrate_dense_gemv_rows)
SILU_MUL_ROWS = 16    # MLP activations of up to this many rows: the native silu_mul
#                       (csrc/decode_stack.cpp takes each layer's bound from its modules'
#                       `act_rows`; kernels.make_row_invariant lifts it)

# oneDNN's float32 matmul, the op torch's own compiler emits for CPU linears. F.linear's
# float32 GEMM is MKL's, which on the AMD EPYC (Zen 4) measured here runs the model's
# shapes at 150-190 GFLOP/s at 512 rows and ~100 at 16 rows; oneDNN at 196-217 and 110-135
# (SmolLM2-135M's four linears: 20.1 -> 17.8 ms a layer at 512 rows; its 49,152-row LM head
# at 64 rows 36.0 -> 21.6 ms). None where this torch has no oneDNN.
_ONEDNN_LINEAR = (getattr(torch.ops.mkldnn, "_linear_pointwise", None)
                  if torch.backends.mkldnn.is_available() else None)


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 gemv_rows: int = DENSE_GEMV_ROWS) -> torch.Tensor:
    """x @ w.T (+ bias) for a float32 weight: the native GEMV up to `gemv_rows` rows
    (DRAM-bound at one row, where GEMM libraries read a large matrix at ~1/3 of the
    bandwidth), oneDNN's GEMM above that, F.linear for anything else."""
    if x.dtype == torch.float32 and w.dtype == torch.float32 and x.dim() == 2:
        if _NATIVE is not None and x.shape[0] <= gemv_rows and w.is_contiguous():
            y = _NATIVE.f32_gemv(x, w)
            return y if bias is None else y + bias
        if _ONEDNN_LINEAR is not None and w.is_contiguous() and (
                bias is None or bias.dtype == torch.float32):
            return _ONEDNN_LINEAR(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


class DenseLinear(nn.Linear):
    """nn.Linear whose forward picks its float32 kernel by rows (`dense_linear`); the
    loader replaces it with a QuantLinear where the weights stay low-bit, and sets
    `gemv_rows` from this machine's measurement (kernels.finish_dense)."""

    gemv_rows = DENSE_GEMV_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias, self.gemv_rows)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            if _NATIVE is not None:          # one pass, no per-op dispatch
                return _NATIVE.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 or linear scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", "default")
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float()
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        # Long wavelengths (low frequencies) are slowed by `factor`; short ones kept;
        # the band between is interpolated smoothly.
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled).float()
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary (Hugging Face convention). cos/sin tables are built by
    `build(max_positions, device)` after weights are loaded (the model lives on the meta
    device until then)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        # Llama-3.1 GGUF stores its rope scaling as per-frequency divisors.
        self.freq_factors: torch.Tensor | None = None

    # Positions tabulated at first; the tables double (up to max_positions) when a step
    # reaches past them, so short contexts do not hold a 32k-position table.
    INITIAL_POSITIONS = 4096

    def build(self, max_positions: int, device: torch.device | str,
              dtype: torch.dtype) -> None:
        """Mutates self: the limit, and cos/sin for the first min(limit, 4096) positions."""
        self.max_positions = max_positions
        self._device, self._dtype = device, dtype
        self._tabulate(min(max_positions, self.INITIAL_POSITIONS))

    def _tabulate(self, n: int) -> None:
        inv = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        if self.freq_factors is not None:
            inv = inv / self.freq_factors
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, inv)                       # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)           # [P, D]
        self.cos = emb.cos().to(device=self._device, dtype=self._dtype)
        # rotate_half(x) * sin == roll(x, hd/2) * [-sin_lo, sin_hi]: the sign goes in the table.
        half = self.head_dim // 2
        sin = emb.sin()
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=self._device,
                                                                          dtype=self._dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, hd] for the step's positions (gathered once per step).
        Mutates self (the tables grow) when a position is past the tabulated ones."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            need = int(positions.max()) + 1
            if need > self.max_positions:
                raise IndexError(f"position {need - 1} is past the rotary tables' "
                                 f"{self.max_positions} positions")
            n = self.cos.shape[0]
            while n < need:
                n *= 2
            self._tabulate(min(n, self.max_positions))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half rotary of x [T, heads, hd] (Hugging Face convention), with the
        signed sin of `tables`: x * cos + rotate_half(x) * sin."""
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), sin)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU or
    GELU with the tanh approximation (`hidden_act`). `act_rows`: the most rows the native
    fused activation takes (the default SILU_MUL_ROWS; unbounded in deterministic mode)."""

    act_rows = SILU_MUL_ROWS

    def __init__(self, hidden_size: int, intermediate_size: int,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.gate_up_proj = DenseLinear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = DenseLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_act(self.gate_up_proj(x), self.hidden_act, self.act_rows))


def gated_act(gate_up: torch.Tensor, hidden_act: str,
              fused_rows: int = SILU_MUL_ROWS) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up [T, I]: the native fused op at any row count
    (each row's result independent of the row count: verify rows of speculative decoding
    equal decodes), one pass over gate_up; 512 rows of the 1.5B's [512, 17920], 2 threads:
    1.1 ms against torch's silu and product's 13 ms (two passes, two fresh tensors).
    `fused_rows` is the decode stack's bound (csrc/decode_stack.cpp); plain torch only
    without the native kernels or for a strided gate_up."""
    if _NATIVE is not None and gate_up.is_contiguous():
        return _NATIVE.silu_mul(gate_up) if hidden_act == "silu" else \
            _NATIVE.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if hidden_act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up
