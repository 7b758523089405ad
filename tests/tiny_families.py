"""Tiny random-weight checkpoints of the model families beyond Llama/Qwen2 (built with
transformers' own config classes, saved as HF folders), and GGUF files written from them
the way llama.cpp's converter names and lays out tensors (tests/gguf_writer.py).

A family's variant is an entry of FAMILY_VARIANTS: (transformers config class name,
config overrides). The sizes are TINY's (tests/tiny_models.py)."""
from __future__ import annotations

import os

import torch

from tiny_models import TINY, _byte_tokenizer_json

FAMILY_VARIANTS: dict[str, tuple[str, dict]] = {
    # 4 layers: sliding, sliding, full, sliding (window 8 < the test prompts), Gemma's
    # sandwich norms, QK-norm, GELU-tanh, scaled embeddings, tied head
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, num_hidden_layers=4, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        tie_word_embeddings=True)),
    # QK-norm, explicit head size, no QKV bias
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # top-2 of 4 experts in every layer
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=64, sliding_window=None,
                                      tie_word_embeddings=False)),
    # top-2 of 8 small experts, renormalised; layer 1 dense (mlp_only_layers); QK-norm
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[1], head_dim=16,
                                         tie_word_embeddings=False)),
    # routed experts (not renormalised) plus a sigmoid-gated shared expert; QKV bias
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         norm_topk_prob=False, tie_word_embeddings=False)),
}


def make_family_checkpoint(path: str, variant: str, seed: int = 0, **sizes) -> str:
    """Save a random-weight transformers model of `variant` as a HF folder at `path`."""
    import transformers
    from transformers import AutoModelForCausalLM
    cls_name, extra = FAMILY_VARIANTS[variant]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra, **sizes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():   # spread the logits so greedy choices are clear
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)      # around the family's own init
            elif p.dim() >= 2:
                p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.2)                      # biases
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    _byte_tokenizer_json(path, cfg.vocab_size)
    return path
