"""A mixture-of-experts FFN: a router picks `num_experts_per_tok` of `num_experts` gated
MLPs per token, and only those run (the cost of a step follows the active parameters).

    p = softmax(x W_router^T)            [T, E], float32
    w, e = top-k of p                    [T, k]  (renormalised to sum 1: norm_topk_prob)
    y_t = sum_j w_tj * expert_{e_tj}(x_t)  (+ shared expert, gated by sigmoid(x . g))

The batch's rows are grouped by expert, so each chosen expert runs once a step on the
rows that chose it, with its weights as the loader kept them (low-bit QuantLinears for a
GGUF file: the rows-per-expert count decides the kernel as for any linear). Experts add
their rows' outputs in increasing expert order, as the transformers reference does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from duetserve.config import ModelConfig
from duetserve.models.layers import SILU_MUL_ROWS, DenseLinear, GatedMLP
from duetserve.models.native import ops

_NATIVE = ops()


class MoEFFN(nn.Module):
    """Parameters: gate.weight [E, d] (the router), experts.E.{gate_up_proj, down_proj},
    and optionally shared_expert.{gate_up_proj, down_proj}, shared_expert_gate.weight.
    `router_rows`: the most rows the router's native GEMV takes (a GEMM above)."""

    router_rows = SILU_MUL_ROWS

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = DenseLinear(d, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(d, cfg.moe_intermediate_size, cfg.hidden_act)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(d, cfg.shared_expert_intermediate_size,
                                          cfg.hidden_act)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = DenseLinear(d, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] float32, expert ids [T, k] int64). The router's
        logits: the native GEMV up to `router_rows` rows (as csrc/decode_stack.cpp), a
        GEMM above."""
        w = self.gate.weight.detach()
        if _NATIVE is not None and x.shape[0] <= self.router_rows and x.dtype == torch.float32:
            logits = _NATIVE.f32_gemv(x.contiguous(), w)
        else:
            logits = F.linear(x.float(), w)
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> [T, d] float32."""
        weights, ids = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)           # (token, slot) pairs by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // self.top_k                          # token of each pair
        w = weights.reshape(-1)[order]
        at = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            r = rows[at:at + n]
            y = self.experts[e](x[r]).float() * w[at:at + n, None]
            out.index_add_(0, r, y)
            at += n
        if self.shared_expert is not None:
            shared = self.shared_expert(x).float()
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x).float())
            out += shared
        return out
