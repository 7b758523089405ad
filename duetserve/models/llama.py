"""One decoder for Llama, Llama-3, Mistral (full attention) and Qwen2 (QKV bias).

Forward runs over a flat batch of tokens from many sequences (varlen): shapes below use
T = tokens in the step, H / KVH = query / KV heads, hd = head_dim, d = hidden size.
The model never sees a Request: the runner passes tensors and AttentionMetadata.
"""
from __future__ import annotations

import torch
from torch import nn

from duetserve.config import ModelConfig
from duetserve.models.attention import AttentionBackend, AttentionMetadata, TorchAttention
from duetserve.models.decode_stack import NativeDecodeStack
from duetserve.models.layers import (DENSE_GEMV_ROWS, DenseLinear, GatedMLP, RMSNorm,
                                     RotaryEmbedding, dense_linear)


_UNBUILT = object()


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # Q, K and V in one matmul: rows [q | k | v].
        self.qkv_proj = DenseLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.has_qkv_bias)
        self.o_proj = DenseLinear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = backend

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)                                 # [T, q | k | v]
        o = self.backend.forward_qkv(qkv, kv_cache, meta)     # [T, H, hd]
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Parameter names (what the loader fills):
    embed_tokens.weight, layers.N.{input_layernorm, post_attention_layernorm}.weight,
    layers.N.self_attn.{qkv_proj.weight, qkv_proj.bias?, o_proj.weight},
    layers.N.mlp.{gate_up_proj, down_proj}.weight, norm.weight, lm_head.weight (untied)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        backend = backend or TorchAttention(cfg.num_attention_heads, cfg.num_key_value_heads,
                                            cfg.head_dim)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        # The loader fills every weight, so none is initialised here: nn.Embedding's own
        # init (normal_) on the meta device runs torch's Python reference, which imports
        # torch._dynamo and with it inductor and sympy (~810 modules, tens of MiB resident).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else \
            DenseLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # decode-only steps through one native call (models/decode_stack.py), built on the
        # first forward (weights are loaded by then)
        self._stack: NativeDecodeStack | None | object = _UNBUILT
        self._prefix_heads: dict[int, object] = {}   # compute_logits(num_ids=n)'s heads
        # float32 linears run the native GEMV up to this many rows (kernels.finish_dense)
        self.dense_gemv_rows = DENSE_GEMV_ROWS

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Writes K/V of every token into kv_caches.
        Returns final hidden states [T, d] (normed)."""
        if self._stack is _UNBUILT:
            self._stack = NativeDecodeStack.build(self)
        if self._stack is not None and self._stack.applies(self, input_ids.shape[0], meta):
            return self._stack.forward(self, input_ids, positions, kv_caches, meta)
        x = self.embed_tokens(input_ids)
        meta.cos, meta.sin = self.rotary.tables(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
        """hidden: [N, d] for the positions that need logits -> [N, vocab] float32.
        num_ids: logits of token ids [0, num_ids) only ([N, num_ids]; the LM head's rows
        past num_ids are not read). Mutates: a cache of the reduced heads."""
        head = self.lm_head
        if num_ids is not None and num_ids < self.config.vocab_size:
            return self._prefix_logits(hidden, head, num_ids)
        if head is not None:             # a DenseLinear or a QuantLinear (tied ones too)
            return head(hidden).float()
        return dense_linear(hidden, self.embed_tokens.weight.detach(),
                            gemv_rows=self.dense_gemv_rows).float()

    def _prefix_logits(self, hidden: torch.Tensor, head, n: int) -> torch.Tensor:
        sub = self._prefix_heads.get(n)
        if sub is None:
            if head is None:
                sub = self.embed_tokens.weight.detach()[:n]
            elif type(head) is DenseLinear:
                sub = head.weight.detach()[:n] if head.bias is None else head
            else:                        # a QuantLinear: its first n rows, storage shared
                sub = head.prefix(n)
            self._prefix_heads[n] = sub
        if isinstance(sub, torch.Tensor):
            return dense_linear(hidden, sub, gemv_rows=self.dense_gemv_rows).float()
        return sub(hidden)[:, :n].float()
