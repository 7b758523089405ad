"""The one decoder every family runs on (Llama, Llama-3, Mistral, Qwen2, Qwen3, Gemma 3,
Mixtral, Qwen3-MoE, Qwen2-MoE): what differs between them is ModelConfig data, declared
per family in models/families/.

Forward runs over a flat batch of tokens from many sequences (varlen): shapes below use
T = tokens in the step, H / KVH = query / KV heads, hd = head_dim, d = hidden size.
The model never sees a Request: the runner passes tensors and AttentionMetadata.

A layer, by `norm_placement`:

    pre       x = x + attn(norm_in(x));  x = x + mlp(norm_post_attn(x))
    sandwich  x = x + norm_post_attn(attn(norm_in(x)));
              x = x + norm_post_ffn(mlp(norm_pre_ffn(x)))                (Gemma)

attn: qkv projection (+ bias), per-head RMSNorm of q and k (`qk_norm`), rotary (the
layer kind's base: full or sliding), paged attention over the whole context or the last
`sliding_window` positions; mlp: a gated MLP (SiLU or GELU-tanh) or a mixture of experts.
"""
from __future__ import annotations

import torch
from torch import nn

from duetserve.config import ModelConfig
from duetserve.models.attention import AttentionBackend, AttentionMetadata, TorchAttention
from duetserve.models.decode_stack import NativeDecodeStack
from duetserve.models.layers import (DENSE_GEMV_ROWS, DenseLinear, GatedMLP, RMSNorm,
                                     RotaryEmbedding, dense_linear, gated_act)
from duetserve.models.lora import LoRABatch
from duetserve.models.moe import MoEFFN


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
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """`lora`: the adapters of the step's rows (their updates added after the q|k|v
        and o linears), or None."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)                                 # [T, q | k | v]
        if lora is not None:
            lora.apply(self.layer_id, "qkv", x, qkv)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv.float().contiguous())
        o = self.backend.forward_qkv(qkv, kv_cache, meta)     # [T, H, hd]
        o = o.reshape(t, self.q_size)
        out = self.o_proj(o)
        if lora is not None:
            lora.apply(self.layer_id, "o", o, out)
        return out

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head of q and of k (their own weights), v untouched."""
        t, hd = qkv.shape[0], self.head_dim
        q = self.q_norm(qkv[:, :self.q_size].reshape(-1, hd)).view(t, self.q_size)
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].reshape(-1, hd))
        return torch.cat((q, k.view(t, self.kv_size), qkv[:, self.q_size + self.kv_size:]),
                         dim=1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sandwich = cfg.norm_placement == "sandwich"
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = SelfAttention(cfg, layer_id, backend)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps)
            self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = MoEFFN(cfg) if cfg.is_moe_layer(layer_id) else \
            GatedMLP(d, cfg.intermediate_size, cfg.hidden_act)
        self.kv_group = 0          # set by the model: which KV group's tables it reads

    def forward(self, x, kv_cache, meta, lora: LoRABatch | None = None):
        h = self.self_attn(self.input_layernorm(x), kv_cache, meta, lora)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self._mlp(
                self.pre_feedforward_layernorm(x), lora))
        x = x + h
        return x + self._mlp(self.post_attention_layernorm(x), lora)

    def _mlp(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """The FFN, with the adapters' updates after gate|up and down (dense MLPs only:
        models/lora.py refuses adapters of experts)."""
        mlp = self.mlp
        if lora is None or not isinstance(mlp, GatedMLP):
            return mlp(x)
        gate_up = mlp.gate_up_proj(x)
        lora.apply(self.self_attn.layer_id, "gate_up", x, gate_up)
        act = gated_act(gate_up, mlp.hidden_act, mlp.act_rows)
        out = mlp.down_proj(act)
        lora.apply(self.self_attn.layer_id, "down", act, out)
        return out


class DecoderForCausalLM(nn.Module):
    """Parameter names (what the loader fills):
    embed_tokens.weight, norm.weight, lm_head.weight (untied),
    layers.N.{input_layernorm, post_attention_layernorm}.weight (+ Gemma's
    {pre,post}_feedforward_layernorm.weight), layers.N.self_attn.{qkv_proj.weight,
    qkv_proj.bias?, o_proj.weight, q_norm.weight?, k_norm.weight?},
    layers.N.mlp.{gate_up_proj, down_proj}.weight, or for a mixture of experts
    layers.N.mlp.{gate.weight, experts.E.{gate_up_proj, down_proj}.weight} (+ a shared
    expert: mlp.shared_expert.{gate_up_proj, down_proj}.weight, mlp.shared_expert_gate)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        # sliding layers' rotary: their own base and no scaling (Gemma 3), else the same
        self.local_rotary = self.rotary if cfg.rope_local_theta is None else \
            RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, None)
        # The loader fills every weight, so none is initialised here: nn.Embedding's own
        # init (normal_) on the meta device runs torch's Python reference, which imports
        # torch._dynamo and with it inductor and sympy (~810 modules, tens of MiB resident).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embedding_scale = cfg.embedding_scale
        backends = {}                    # one backend per attention window (and the given)
        layers = []
        for i in range(cfg.num_hidden_layers):
            window = cfg.layer_window(i)
            if window not in backends:
                backends[window] = backend if backend is not None and window is None else \
                    TorchAttention(cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, cfg.attention_scale, window)
            layers.append(DecoderLayer(cfg, i, backends[window]))
        self.layers = nn.ModuleList(layers)
        for g, group in enumerate(cfg.kv_groups()):
            for i in group.layer_ids:
                self.layers[i].kv_group = g
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else \
            DenseLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.final_logit_softcapping = cfg.final_logit_softcapping
        # decode-only steps through one native call (models/decode_stack.py), built on the
        # first forward (weights are loaded by then)
        self._stack: NativeDecodeStack | None | object = _UNBUILT
        self._prefix_heads: dict[int, object] = {}   # compute_logits(num_ids=n)'s heads
        # float32 linears run the native GEMV up to this many rows (kernels.finish_dense)
        self.dense_gemv_rows = DENSE_GEMV_ROWS

    def rotaries(self) -> list[RotaryEmbedding]:
        """The distinct rotary tables (full layers' first)."""
        return [self.rotary] if self.local_rotary is self.rotary else \
            [self.rotary, self.local_rotary]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, d] float32 embeddings, scaled by the family's embedding_scale."""
        x = self.embed_tokens(input_ids)
        return x if self.embedding_scale == 1.0 else x * self.embedding_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """input_ids, positions: [T]. Writes K/V of every token into kv_caches (one (k, v)
        per layer). Returns final hidden states [T, d] (normed). `lora`: the LoRA adapters
        of the step's rows (models/lora.py), or None."""
        if self._stack is _UNBUILT:
            self._stack = NativeDecodeStack.build(self)
        if self._stack is not None and (lora is None or lora.native) and \
                self._stack.applies(self, input_ids.shape[0], meta):
            return self._stack.forward(self, input_ids, positions, kv_caches, meta, lora)
        x = self.embed(input_ids)
        self.set_rotary(meta, positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, kv, meta.group(layer.kv_group), lora)
        return self.norm(x)

    def set_rotary(self, meta: AttentionMetadata, positions: torch.Tensor) -> None:
        """Gathers the step's rotary rows once: into meta (and every KV group's view) from
        the full layers' tables, into sliding groups' views from the local tables.
        Mutates meta and its group views (cos, sin), and the rotaries (tables grow)."""
        meta.cos, meta.sin = self.rotary.tables(positions)
        local = None
        for view in meta.groups or ():
            if view.window is not None and self.local_rotary is not self.rotary:
                local = local or self.local_rotary.tables(positions)
                view.cos, view.sin = local
            else:
                view.cos, view.sin = meta.cos, meta.sin
        if meta.window is not None and self.local_rotary is not self.rotary:
            meta.cos, meta.sin = local or self.local_rotary.tables(positions)

    def compute_logits(self, hidden: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
        """hidden: [N, d] for the positions that need logits -> [N, vocab] float32.
        num_ids: logits of token ids [0, num_ids) only ([N, num_ids]; the LM head's rows
        past num_ids are not read). Mutates: a cache of the reduced heads."""
        head = self.lm_head
        if num_ids is not None and num_ids < self.config.vocab_size:
            return self._prefix_logits(hidden, head, num_ids)
        if head is not None:             # a DenseLinear or a QuantLinear (tied ones too)
            return self._softcap(head(hidden).float())
        return self._softcap(dense_linear(hidden, self.embed_tokens.weight.detach(),
                                          gemv_rows=self.dense_gemv_rows).float())

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """c * tanh(logits / c) where the family caps its logits (in place)."""
        c = self.final_logit_softcapping
        if c:
            logits.div_(c).tanh_().mul_(c)
        return logits

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
            return self._softcap(dense_linear(hidden, sub, gemv_rows=self.dense_gemv_rows)
                                 .float())
        return self._softcap(sub(hidden)[:, :n].float())
