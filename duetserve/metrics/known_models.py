"""Shapes of well-known models as ModelConfig constants (no weights) for `duet roofline`.

Figures from each model's published config.json (not transformers' config-class defaults,
which are no real model); `weight_dtype` is the released dtype. Their parameter counts are
checked against the published totals in tests/metrics/test_cost_model.py.
"""
from __future__ import annotations

from dataclasses import replace

from duetserve.config import ConfigError, ModelConfig

LLAMA_3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rope_theta=500000.0, max_position_embeddings=8192, weight_dtype="bf16")

LLAMA_2_7B = ModelConfig(
    architecture="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
    max_position_embeddings=4096, weight_dtype="f16")

LLAMA_3_70B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    rope_theta=500000.0, max_position_embeddings=8192, weight_dtype="bf16")

QWEN2_5_7B = ModelConfig(
    architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
    has_qkv_bias=True, weight_dtype="bf16")

QWEN2_5_0_5B = ModelConfig(
    architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
    tie_word_embeddings=True, has_qkv_bias=True, weight_dtype="bf16")

SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    weight_dtype="bf16")

TINYLLAMA_1_1B = ModelConfig(
    architecture="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, head_dim=64,
    max_position_embeddings=2048, weight_dtype="bf16")


def _qwen3(vocab: int = 151936, **shape: object) -> ModelConfig:
    """Qwen3 (dense and MoE): QK-norm, no QKV bias, head_dim 128, RoPE base 1e6, 40,960
    positions (their config.json files)."""
    return ModelConfig(architecture="qwen3", vocab_size=vocab, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True,
                       weight_dtype="bf16", **shape)


QWEN3_0_6B = _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)
QWEN3_1_7B = _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)
QWEN3_4B = _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
QWEN3_8B = _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8)
# 128 experts of 768, top 8 renormalised, in all 48 layers (decoder_sparse_step 1, no
# mlp_only_layers); its intermediate_size (6144) belongs to no layer.
QWEN3_30B_A3B = replace(
    _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
           num_attention_heads=32, num_key_value_heads=4),
    architecture="qwen3_moe", num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, moe_layer_ids=tuple(range(48)))


def _gemma3(num_layers: int, hidden_size: int, **shape: object) -> ModelConfig:
    """Gemma 3 (text): sandwich norms, QK-norm, GELU-tanh, embeddings x sqrt(hidden),
    head_dim 256, five sliding-window layers (RoPE base 1e4) to every full one (1e6),
    tied head."""
    return ModelConfig(
        architecture="gemma3", num_hidden_layers=num_layers, hidden_size=hidden_size,
        head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, norm_placement="sandwich",
        qk_norm=True, hidden_act="gelu_tanh", embedding_scale=hidden_size ** 0.5,
        query_pre_attn_scalar=256.0, rope_local_theta=10000.0, weight_dtype="bf16",
        layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding"
                          for i in range(num_layers)), **shape)


GEMMA_3_270M = _gemma3(18, 640, vocab_size=262144, intermediate_size=2048,
                       num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
                       max_position_embeddings=32768)
# the text part of the multimodal 4B checkpoint (text_config)
GEMMA_3_4B = _gemma3(34, 2560, vocab_size=262208, intermediate_size=10240,
                     num_attention_heads=8, num_key_value_heads=4, sliding_window=1024,
                     max_position_embeddings=131072,
                     rope_scaling=(("rope_type", "linear"), ("factor", 8.0)))

KNOWN_MODELS: dict[str, ModelConfig] = {
    "llama-3-8b": LLAMA_3_8B,
    "llama-2-7b": LLAMA_2_7B,
    "llama-3-70b": LLAMA_3_70B,
    "qwen2.5-7b": QWEN2_5_7B,
    "qwen2.5-0.5b": QWEN2_5_0_5B,
    "smollm2-135m": SMOLLM2_135M,
    "tinyllama-1.1b": TINYLLAMA_1_1B,
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-1.7b": QWEN3_1_7B,
    "qwen3-4b": QWEN3_4B,
    "qwen3-8b": QWEN3_8B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "gemma-3-270m": GEMMA_3_270M,
    "gemma-3-4b": GEMMA_3_4B,
}


def get_known_model(name: str) -> ModelConfig:
    """Return the ModelConfig of a known model name (case-insensitive); ConfigError if unknown."""
    key = name.strip().lower()
    if key not in KNOWN_MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[key]
