"""The decoder layers of a decode-only step in one native call (csrc/decode_stack.cpp).

At batch 1 Python's dispatch (module calls, ~10 torch ops a layer) costs about as much as
the kernels. For steps where every layer would run the native kernels anyway (decode
tokens only, rows within the low-bit limit, float32 activations), `NativeDecodeStack`
runs the same kernels in the same order from C++: the hidden states equal the module
path's exactly. Every family's layer is described to C++ by name (a `NativeLayer`: its
norms, its linears as `NativeLinear`s, its activation, attention window, KV group and
rotary, its experts), so one stack serves them all. The call also gathers the step's
embeddings and rotary rows and ends with the final norm, with each residual add fused
into the norm after it: between two steps' weight streams the caches hold none of torch's
code or data, so each small torch op there costs tens of microseconds (~0.2 ms a step on
the F32 copy of SmolLM2). Any other step, model or backend uses the modules.

`--no-decode-stack` (EngineConfig.decode_stack) turns it off (to compare the two paths).
"""
from __future__ import annotations


import torch
from torch import nn

from duetserve.models.attention import AttentionMetadata, TorchAttention
from duetserve.models.layers import DenseLinear, GatedMLP
from duetserve.models.lora import LoRABatch
from duetserve.models.moe import MoEFFN
from duetserve.models.native import ops
from duetserve.models.quant import (Int4KWeight, Int4Weight, Int6Weight, Int8GWeight,
                                    Int8Weight, QuantLinear, StackedWeight)

_EMPTY_IDS = torch.empty(0, dtype=torch.int64)
_NO_ROWS = torch.zeros(1, dtype=torch.int64)     # no LoRA groups: offsets [0]


class _Unsupported(Exception):
    """A layer the native stack does not run (the modules do)."""


def _linear(native, mod: nn.Module, gemv_rows: int):
    """The NativeLinear of one linear module (raises _Unsupported for any other kernel)."""
    if isinstance(mod, QuantLinear):
        w, bias = mod.qweight, mod.bias
        if isinstance(w, Int4Weight | Int4KWeight | Int6Weight | Int8GWeight):
            return native.NativeLinear.lowbit(w.packed, w.shape[0], bias)
        if isinstance(w, Int8Weight):
            return native.NativeLinear.q8(w.packed, w.scale32, bias)
        if isinstance(w, StackedWeight) and len(w.parts) == 2:
            a, c = w.parts
            return native.NativeLinear.stacked(a.packed, a.shape[0], c.packed, c.shape[0], bias)
        raise _Unsupported
    if type(mod) is DenseLinear and mod.weight.dtype == torch.float32:
        bias = None if mod.bias is None else mod.bias.detach()
        if bias is not None and bias.dtype != torch.float32:
            raise _Unsupported
        return native.NativeLinear.dense(mod.weight.detach(), gemv_rows, bias)
    raise _Unsupported


def _norm(mod) -> torch.Tensor:
    if mod.weight.dtype != torch.float32:
        raise _Unsupported
    return mod.weight.detach()


class NativeDecodeStack:
    """Built once per model (weights are referenced, not copied)."""

    def __init__(self, native, layers: list, final_norm: torch.Tensor, policies: list,
                 backend: TorchAttention, eps: float, embed_scale: float,
                 max_rows: int | None = None) -> None:
        self.policies = policies      # the low-bit linears' KernelPolicy objects (row limits)
        # With float32 linears: the GEMV's row bound. Above it the modules run oneDNN's
        # GEMM (layers.dense_linear), which the C++ stack does not call (its at::linear is
        # MKL's, 1.1-1.8x slower on these shapes).
        self.max_rows = max_rows
        self.calls = 0                # steps run through the stack
        self.stack = native.DecodeStack(layers, final_norm, backend.num_heads,
                                        backend.num_kv_heads, eps, backend.scale, embed_scale)

    @classmethod
    def build(cls, model: nn.Module) -> "NativeDecodeStack | None":
        """For a DecoderForCausalLM; None when any layer needs the module path."""
        native = ops()
        if native is None or not getattr(model, "use_decode_stack", True):
            return None
        gemv_rows = model.dense_gemv_rows
        state = {"policies": [], "dense": False}
        try:
            layers = [cls._layer(native, model, layer, gemv_rows, state)
                      for layer in model.layers]
            final = _norm(model.norm)
        except _Unsupported:
            return None
        eps = {layer.input_layernorm.eps for layer in model.layers} | {model.norm.eps}
        if not layers or len(eps) != 1:
            return None
        return cls(native, layers, final, state["policies"],
                   model.layers[0].self_attn.backend, eps.pop(), model.embedding_scale,
                   gemv_rows if state["dense"] else None)

    @staticmethod
    def _layer(native, model: nn.Module, layer: nn.Module, gemv_rows: int, state: dict):
        """One NativeLayer; records the low-bit policies and whether a dense linear runs.
        Raises _Unsupported."""
        attn, mlp = layer.self_attn, layer.mlp
        backend = attn.backend
        if type(backend) is not TorchAttention or backend.rope_kv_write is None or \
                backend.scale != model.layers[0].self_attn.backend.scale:
            raise _Unsupported
        out = native.NativeLayer()
        out.in_norm, out.post_attn_norm = _norm(layer.input_layernorm), \
            _norm(layer.post_attention_layernorm)
        out.sandwich = layer.sandwich
        if layer.sandwich:
            out.pre_ffn_norm = _norm(layer.pre_feedforward_layernorm)
            out.post_ffn_norm = _norm(layer.post_feedforward_layernorm)
        if attn.q_norm is not None:
            out.q_norm, out.k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
        linears = [attn.qkv_proj, attn.o_proj]
        out.qkv, out.o = (_linear(native, m, gemv_rows) for m in linears)
        if isinstance(mlp, MoEFFN):
            if mlp.shared_expert is not None or mlp.gate.weight.dtype != torch.float32:
                raise _Unsupported
            experts: list[GatedMLP] = list(mlp.experts)
            out.router = mlp.gate.weight.detach()
            out.expert_gate_up = [_linear(native, e.gate_up_proj, gemv_rows) for e in experts]
            out.expert_down = [_linear(native, e.down_proj, gemv_rows) for e in experts]
            out.top_k, out.norm_topk = mlp.top_k, mlp.norm_topk_prob
            out.gelu = experts[0].hidden_act == "gelu_tanh"
            if len({mlp.router_rows} | {e.act_rows for e in experts}) != 1:
                raise _Unsupported      # one bound a layer in the C++ stack
            out.fused_rows = mlp.router_rows
            linears += [m for e in experts for m in (e.gate_up_proj, e.down_proj)]
        else:
            out.gate_up, out.down = (_linear(native, m, gemv_rows)
                                     for m in (mlp.gate_up_proj, mlp.down_proj))
            out.gelu = mlp.hidden_act == "gelu_tanh"
            out.fused_rows = mlp.act_rows
            linears += [mlp.gate_up_proj, mlp.down_proj]
        out.window = backend.window_arg
        out.group = layer.kv_group
        out.rope = 1 if backend.window is not None and model.local_rotary is not model.rotary \
            else 0
        for m in linears:
            state["dense"] = state["dense"] or type(m) is DenseLinear
            if isinstance(m, QuantLinear) and all(p is not m.policy for p in state["policies"]):
                state["policies"].append(m.policy)
        return out

    def applies(self, model: nn.Module, num_tokens: int, meta: AttentionMetadata) -> bool:
        return (meta.decode_block_tables is not None and not meta.prefills
                and all(r.cos.dtype == torch.float32 for r in model.rotaries())
                and all(num_tokens <= p.lowbit_max_rows for p in self.policies)
                and (self.max_rows is None or num_tokens <= self.max_rows))

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """The final hidden states (after the model's final norm) of the step's tokens;
        `lora`: the LoRA adapters of the step's rows (their updates run in the stack);
        the embeddings (from a float32 table) and the rotary rows are gathered in C++.
        Mutates every layer's KV cache, and the model's rotaries (their tables grow) when
        a position is past them."""
        self.calls += 1
        views = meta.groups or [meta]
        args = ([v.slot_mapping for v in views], [v.decode_block_tables for v in views],
                meta.decode_context_lens, [kv[0] for kv in kv_caches],
                [kv[1] for kv in kv_caches]) + \
            (lora.native_args() if lora is not None else ([], _NO_ROWS, _NO_ROWS))
        emb, rotaries = model.embed_tokens, model.rotaries()
        if type(emb) is nn.Embedding and emb.weight.dtype == torch.float32:
            embed = emb.weight.detach()           # the table, rows gathered in C++
        else:                                     # low-bit or file-backed: the step's rows
            embed = emb(input_ids).float().contiguous()
            input_ids = _EMPTY_IDS                # (embed holds the rows in order)
        out = self.stack.forward(input_ids, positions, embed, [r.cos for r in rotaries],
                                 [r.sin for r in rotaries], *args)
        if out.numel() == 0:         # a position past the tables: grow them, run again
            for r in rotaries:
                r.tables(positions)
            out = self.stack.forward(input_ids, positions, embed, [r.cos for r in rotaries],
                                     [r.sin for r in rotaries], *args)
        return out
