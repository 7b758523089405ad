"""The decoder layers of a decode-only step in one native call (csrc/decode_stack.cpp).

At batch 1 Python's dispatch (module calls, ~10 torch ops a layer) costs about as much as
the kernels. For steps where every layer would run the native kernels anyway (decode
tokens only, rows within the low-bit limit, float32 activations), `NativeDecodeStack`
runs the same kernels in the same order from C++: the hidden states equal the module
path's exactly. The call also gathers the step's embeddings and rotary rows and ends with
the final norm, with each residual add fused into the norm after it: between two steps'
weight streams the caches hold none of torch's code or data, so each small torch op
there costs tens of microseconds (~0.2 ms a step on the F32 copy of SmolLM2). Any other
step, model or backend uses the modules.

`--no-decode-stack` (EngineConfig.decode_stack) turns it off (to compare the two paths).
"""
from __future__ import annotations


import torch
from torch import nn

from duetserve.models.attention import AttentionMetadata, TorchAttention
from duetserve.models.layers import DenseLinear
from duetserve.models.native import ops
from duetserve.models.quant import (Int4KWeight, Int4Weight, Int6Weight, Int8Weight, QuantLinear,
                                    StackedWeight)

_EMPTY = torch.empty(0)
_EMPTY_IDS = torch.empty(0, dtype=torch.int64)


def _linear_slots(mod: nn.Module) -> list[torch.Tensor] | None:
    """The four slots csrc/decode_stack.cpp reads for one linear, or None when its
    decode-step kernel is not one the native stack runs."""
    if isinstance(mod, QuantLinear):
        w = mod.qweight
        bias = _EMPTY if mod.bias is None else mod.bias
        if isinstance(w, Int4Weight | Int4KWeight | Int6Weight):
            return [w.packed, torch.tensor([w.shape[0]]), _EMPTY, bias]
        if isinstance(w, Int8Weight):
            return [w.packed, w.scale32, _EMPTY, bias]
        if isinstance(w, StackedWeight) and len(w.parts) == 2:
            a, c = w.parts
            return [a.packed, torch.tensor([a.shape[0], c.shape[0]]), c.packed, bias]
        return None
    if type(mod) is DenseLinear and mod.weight.dtype == torch.float32:
        bias = _EMPTY if mod.bias is None else mod.bias.detach()
        if bias.dtype != torch.float32:
            return None
        return [mod.weight.detach(), _EMPTY, _EMPTY, bias]
    return None


class NativeDecodeStack:
    """Built once per model (weights are referenced, not copied)."""

    def __init__(self, native, layers: list, final_norm: torch.Tensor, policies: list,
                 backend: TorchAttention, eps: float, max_rows: int | None = None) -> None:
        self.policies = policies      # the low-bit linears' KernelPolicy objects (row limits)
        # With float32 linears: the GEMV's row bound. Above it the modules run oneDNN's
        # GEMM (layers.dense_linear), which the C++ stack does not call (its at::linear is
        # MKL's, 1.1-1.8x slower on these shapes).
        self.max_rows = max_rows
        self.calls = 0                # steps run through the stack
        self.stack = native.DecodeStack(layers, final_norm, backend.num_heads,
                                        backend.num_kv_heads, eps, backend.scale, max_rows or 0)

    @classmethod
    def build(cls, model: nn.Module) -> "NativeDecodeStack | None":
        """For a LlamaForCausalLM; None when any layer needs the module path."""
        native = ops()
        if native is None or not getattr(model, "use_decode_stack", True):
            return None
        layers, policies, dense = [], [], False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            backend = attn.backend
            if type(backend) is not TorchAttention or backend.rope_kv_write is None:
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if any(n.weight.dtype != torch.float32 or n.eps != norms[0].eps for n in norms):
                return None
            slots = [_linear_slots(m) for m in (attn.qkv_proj, attn.o_proj,
                                                mlp.gate_up_proj, mlp.down_proj)]
            if any(s is None for s in slots):
                return None
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                dense = dense or type(m) is DenseLinear
                if isinstance(m, QuantLinear) and all(p is not m.policy for p in policies):
                    policies.append(m.policy)
            layers.append([n.weight.detach() for n in norms] + [t for s in slots for t in s])
        final = model.norm
        if not layers or final.weight.dtype != torch.float32 or final.eps != norms[0].eps:
            return None
        return cls(native, layers, final.weight.detach(), policies,
                   model.layers[0].self_attn.backend, final.eps,
                   model.dense_gemv_rows if dense else None)

    def applies(self, model: nn.Module, num_tokens: int, meta: AttentionMetadata) -> bool:
        return (meta.decode_block_tables is not None and not meta.prefills
                and model.rotary.cos.dtype == torch.float32
                and all(num_tokens <= p.lowbit_max_rows for p in self.policies)
                and (self.max_rows is None or num_tokens <= self.max_rows))

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states (after the model's final norm) of the step's tokens;
        the embeddings (from a float32 table) and the rotary rows are gathered in C++.
        Mutates every layer's KV cache, and model.rotary (its tables grow) when a position
        is past them."""
        self.calls += 1
        args = (meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches])
        emb, rotary = model.embed_tokens, model.rotary
        if type(emb) is nn.Embedding and emb.weight.dtype == torch.float32:
            embed = emb.weight.detach()           # the table, rows gathered in C++
        else:                                     # low-bit or file-backed: the step's rows
            embed = emb(input_ids).float().contiguous()
            input_ids = _EMPTY_IDS                # (embed holds the rows in order)
        out = self.stack.forward(input_ids, positions, embed, rotary.cos, rotary.sin, *args)
        if out.numel() == 0:         # a position past the tables: grow them, run again
            rotary.tables(positions)
            out = self.stack.forward(input_ids, positions, embed, rotary.cos, rotary.sin, *args)
        return out
