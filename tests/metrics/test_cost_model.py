"""Cost model against figures computed by hand for a tiny config (pure arithmetic, fast)."""
from __future__ import annotations

import pytest

from duetserve.config import ConfigError, ModelConfig
from duetserve.metrics.cost_model import (bits_per_weight, kv_bytes_per_request,
                                          kv_bytes_per_token, param_count, step_work)
from duetserve.metrics.known_models import KNOWN_MODELS

# d = 8, I = 16, L = 2 layers, 4 q heads / 2 kv heads of head_dim 2 -> q_size 8, kv_size 4.
TINY = ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=2, weight_dtype="f16")
# Request A: a prefill chunk of 3 new tokens after 5 cached; request B: one decode after 10.
STEP = [(3, 5), (1, 10)]


def test_param_count_tiny() -> None:
    p = param_count(TINY)
    # per layer: q 8*8=64, k 8*4=32, v 32, o 8*8=64, gate 8*16=128, up 128, down 16*8=128
    #            = 576 weights + 2 RMSNorms of 8 = 592; two layers = 1184
    assert p.layers == 1184
    assert p.embedding == 100 * 8 == 800
    assert p.lm_head == 800          # untied
    assert p.final_norm == 8
    assert p.total == 1184 + 800 + 800 + 8 == 2792


def test_flops_every_term() -> None:
    c = step_work(TINY, STEP)
    t = dict(c.flops_terms)
    # 4 new tokens x 2 layers = 8 token-layers; 2 FLOPs per multiply-add.
    assert t["q_proj"] == 2 * 8 * 8 * 8 == 1024
    assert t["k_proj"] == 2 * 8 * 4 * 8 == 512
    assert t["v_proj"] == 2 * 8 * 4 * 8 == 512
    assert t["o_proj"] == 2 * 8 * 8 * 8 == 1024
    assert t["gate_proj"] == 2 * 8 * 16 * 8 == 2048
    assert t["up_proj"] == 2 * 8 * 16 * 8 == 2048
    assert t["down_proj"] == 2 * 16 * 8 * 8 == 2048
    # causal (query, key) pairs: A's new tokens see 6, 7, 8 keys = 21; B's one token sees 11.
    # per pair: 2 FLOPs x 4 heads x head_dim 2 x 2 layers = 32 -> 32 pairs x 32 = 1024.
    assert t["attn_scores"] == 1024
    assert t["attn_values"] == 1024
    # lm head on one position per request: 2 x 8 x 100 x 2 = 3200.
    assert t["lm_head"] == 3200
    assert c.flops == 1024 + 512 + 512 + 1024 + 3 * 2048 + 2 * 1024 + 3200 == 14464
    assert c.num_tokens == 4 and c.num_logits == 2


def test_bytes_every_term() -> None:
    c = step_work(TINY, STEP)
    b = dict(c.byte_terms)
    assert b["weights.layers"] == 1184 * 2 == 2368       # f16: 2 bytes per weight
    assert b["weights.final_norm"] == 8 * 2 == 16
    assert b["weights.lm_head"] == 800 * 2 == 1600
    assert b["weights.embedding"] == 4 * 8 * 2 == 64     # 4 gathered rows of 8
    assert c.weight_bytes == 2368 + 16 + 1600 + 64 == 4048
    # KV per token: 2 (K,V) x 2 layers x 2 kv heads x 2 head_dim x 2 bytes = 32.
    assert kv_bytes_per_token(TINY, "f16") == 32
    assert c.kv_read_bytes == (5 + 10) * 32 == 480      # each request's context once
    assert c.kv_write_bytes == 4 * 32 == 128             # the 4 new tokens
    assert c.bytes == c.total_bytes == 4048 + 480 + 128 == 4656
    assert c.ai == pytest.approx(14464 / 4656)
    assert c.breakdown()["bytes.kv_read"] == 480 and c.breakdown()["flops.lm_head"] == 3200


def test_logits_positions_and_tied_embedding() -> None:
    # every position needs logits (e.g. verifying drafts): 4 x 2 x 8 x 100.
    assert dict(step_work(TINY, STEP, num_logits=4).flops_terms)["lm_head"] == 6400
    tied = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": True})
    assert param_count(tied).lm_head == 0
    b = dict(step_work(tied, STEP).byte_terms)
    assert b["weights.lm_head"] == 1600 and b["weights.embedding"] == 0  # table read in full
    # no logits in this step: no head, only the gathered rows of the shared table.
    b0 = dict(step_work(tied, STEP, num_logits=0).byte_terms)
    assert b0["weights.lm_head"] == 0 and b0["weights.embedding"] == 64
    assert dict(step_work(tied, STEP, num_logits=0).flops_terms)["lm_head"] == 0
    with pytest.raises(ConfigError):
        step_work(TINY, STEP, num_logits=5)


def test_quantised_and_total_weight_bytes() -> None:
    assert [bits_per_weight(d) for d in ("q4_1", "q8_0", "q4_k", "q6_k", "f16", "bf16", "f32")] \
        == [5.0, 8.5, 4.5, 6.5625, 16.0, 16.0, 32.0]
    assert bits_per_weight("float16") == 16 and bits_per_weight("Q4_1") == 5
    c = step_work(TINY, STEP, weight_dtype="q4_1", kv_dtype="f16")
    assert dict(c.byte_terms)["weights.layers"] == 1184 * 5 / 8 == 740
    # a total from the file: 2792 params in 5584 bytes -> 2 bytes/param, same as f16.
    assert step_work(TINY, STEP, weight_bytes=5584).weight_bytes == 4048
    # quantised weights keep an f16 KV cache by default; f32 KV doubles it.
    assert c.kv_write_bytes == 128
    assert step_work(TINY, STEP, kv_dtype="f32").kv_write_bytes == 256
    with pytest.raises(ConfigError):
        bits_per_weight("q9_9")


def test_qkv_bias_counted_in_params() -> None:
    biased = ModelConfig(**{**TINY.__dict__, "has_qkv_bias": True})
    assert param_count(biased).layers == 1184 + 2 * (8 + 4 + 4)


def test_published_param_counts() -> None:
    expected = {"llama-3-8b": 8_030_261_248, "llama-2-7b": 6_738_415_616,
                "llama-3-70b": 70_553_706_496, "qwen2.5-7b": 7_615_616_512,
                "qwen2.5-0.5b": 494_032_768, "smollm2-135m": 134_515_008,
                "tinyllama-1.1b": 1_100_048_384,
                # Qwen3 model cards: 0.6B (0.44B non-embedding), 1.7B (1.4B), 4.0B (3.6B),
                # 8.2B (6.95B); Qwen3-30B-A3B 30.5B, 3.3B activated, 29.9B non-embedding
                "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976,
                "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360,
                "qwen3-30b-a3b": 30_532_122_624,
                # Gemma 3 270M: 268M (170M embedding); 4B: its text part (the checkpoint's
                # 4.3B include a ~0.4B SigLIP vision tower)
                "gemma-3-270m": 268_098_176, "gemma-3-4b": 3_880_263_168}
    assert {k: param_count(m).total for k, m in KNOWN_MODELS.items()} == expected
    published_non_embedding = {"qwen3-0.6b": 0.44, "qwen3-1.7b": 1.4, "qwen3-4b": 3.6,
                               "qwen3-8b": 6.95, "qwen3-30b-a3b": 29.9}
    for name, billions in published_non_embedding.items():
        layers = param_count(KNOWN_MODELS[name]).layers / 1e9
        assert layers == pytest.approx(billions, abs=0.05 if billions < 1 else 0.06), name
    moe = param_count(KNOWN_MODELS["qwen3-30b-a3b"])
    assert moe.active / 1e9 == pytest.approx(3.3, abs=0.06) and round(moe.total / 1e9, 1) == 30.5
    assert param_count(KNOWN_MODELS["gemma-3-270m"]).embedding == 167_772_160


def test_kv_cache_reference_2gib() -> None:
    # 32 layers, 32 KV heads, head_dim 128, fp16, 4096 tokens: 2*32*32*128*2*4096 = 2 GiB.
    cfg = KNOWN_MODELS["llama-2-7b"]
    assert kv_bytes_per_token(cfg, "f16") == 2 * 32 * 32 * 128 * 2 == 524_288
    assert kv_bytes_per_request(cfg, 4096, "fp16") == 2_147_483_648 == 2 * 2**30
