"""Shapes of well-known models as ModelConfig constants (no weights) for `duet roofline`.

Figures from each model's published config.json; `weight_dtype` is the released dtype.
"""
from __future__ import annotations

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

KNOWN_MODELS: dict[str, ModelConfig] = {
    "llama-3-8b": LLAMA_3_8B,
    "llama-2-7b": LLAMA_2_7B,
    "llama-3-70b": LLAMA_3_70B,
    "qwen2.5-7b": QWEN2_5_7B,
    "qwen2.5-0.5b": QWEN2_5_0_5B,
    "smollm2-135m": SMOLLM2_135M,
    "tinyllama-1.1b": TINYLLAMA_1_1B,
}


def get_known_model(name: str) -> ModelConfig:
    """Return the ModelConfig of a known model name (case-insensitive); ConfigError if unknown."""
    key = name.strip().lower()
    if key not in KNOWN_MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[key]
