"""The cost model per model family, against figures computed by hand: a mixture of experts
counts its active parameters (FLOPs) and the experts a step is expected to read (bytes);
sliding-window layers read and hold at most W tokens of KV. Pure arithmetic, fast."""
from __future__ import annotations

from dataclasses import replace

import pytest

from duetserve.config import ModelConfig, attention_pairs
from duetserve.core import hashing
from duetserve.core.kv_cache_manager import KVCacheManager
from duetserve.metrics.cost_model import (decode_step, expert_read_fraction, kv_bytes_held,
                                          kv_bytes_per_token, param_count, step_work)
from duetserve.metrics.known_models import GEMMA_3_270M, GEMMA_3_4B, LLAMA_3_8B, QWEN3_30B_A3B
from duetserve.metrics.roofline import analyse
from duetserve.request import Request

# d = 8, 2 layers, 4 q heads / 2 kv heads of head_dim 2 (q_size 8, kv_size 4), vocab 100;
# layer 0 a dense MLP of 16, layer 1 top-2 of 4 experts of 6 (Qwen3-MoE with an
# mlp_only layer); QK-norm.
MOE = ModelConfig(architecture="qwen3_moe", vocab_size=100, hidden_size=8,
                  intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=2, qk_norm=True, weight_dtype="f16",
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
                  moe_layer_ids=(1,))
STEP = [(3, 5), (1, 10)]         # a chunk of 3 after 5 cached, a decode after 10


def test_moe_params_split_active_from_all_experts() -> None:
    p = param_count(MOE)
    # attention 64 + 32 + 32 + 64 = 192 a layer; layer 0's MLP 3 x 8 x 16 = 384; layer 1's
    # router 8 x 4 = 32 and 4 experts of 3 x 8 x 6 = 144; norms 2 x 8 + QK-norm 2 x 2 = 20
    assert p.layers == 2 * 192 + 384 + 32 + 4 * 144 + 2 * 20 == 1416
    assert (p.experts, p.active_experts) == (576, 2 * 144)
    assert p.total == 1416 + 800 + 800 + 8 == 3024
    assert p.active == 3024 - 576 + 288 == 2736


def test_moe_flops_follow_the_active_parameters() -> None:
    t = dict(step_work(MOE, STEP).flops_terms)
    # 4 new tokens, 2 FLOPs a multiply-add: attention projections over both layers,
    # the dense MLP of one layer, and in the MoE layer the router and 2 of the 4 experts
    assert (t["q_proj"], t["k_proj"], t["v_proj"], t["o_proj"]) == (1024, 512, 512, 1024)
    assert t["gate_proj"] == t["up_proj"] == t["down_proj"] == 2 * 8 * 16 * 4 == 1024
    assert t["router"] == 2 * 8 * 4 * 4 == 256
    assert t["experts"] == 2 * (2 * 144) * 4 == 2304
    assert t["attn_scores"] == t["attn_values"] == 32 * 2 * 4 * 2 * 2 == 1024
    assert t["lm_head"] == 2 * 8 * 100 * 2 == 3200
    assert sum(t.values()) == 13952
    # the same model with every expert run by every token would cost 2 x 576 x 4 more
    dense_equivalent = replace(MOE, num_experts_per_tok=4)
    assert dict(step_work(dense_equivalent, STEP).flops_terms)["experts"] == 2 * 576 * 4


def test_moe_bytes_are_the_experts_a_step_is_expected_to_read() -> None:
    b = dict(step_work(MOE, STEP).byte_terms)
    assert b["weights.layers"] == (1416 - 576) * 2 == 1680        # f16: all but experts
    # 4 rows, each choosing 2 of 4: an expert is missed by all with (1 - 2/4)^4 = 1/16
    assert expert_read_fraction(4, 2, 4) == 15 / 16
    assert b["weights.experts"] == 576 * 15 / 16 * 2 == 1080
    # one decode row reads exactly its own 2 experts; a wide prefill all of them
    one = dict(step_work(MOE, decode_step(1, 10)).byte_terms)["weights.experts"]
    assert one == 2 * 144 * 2
    wide = dict(step_work(MOE, [(64, 0)]).byte_terms)["weights.experts"]
    assert wide == pytest.approx(576 * 2, rel=1e-15)
    assert expert_read_fraction(0, 0, 8) == 0.0 and expert_read_fraction(4, 2, 0) == 0.0
    # a dense model has no expert term: its bytes are unchanged
    assert "weights.experts" not in dict(step_work(LLAMA_3_8B, STEP).byte_terms)


def test_shared_expert_and_its_gate_run_for_every_token() -> None:
    shared = replace(MOE, moe_layer_ids=(0, 1), shared_expert_intermediate_size=5,
                     shared_expert_gate=True, has_qkv_bias=True)
    t = dict(step_work(shared, STEP).flops_terms)
    assert "gate_proj" not in t                                # no dense layer left
    assert t["shared_expert"] == 2 * (3 * 8 * 5 * 2) * 4 == 1920
    assert t["shared_expert_gate"] == 2 * (8 * 2) * 4 == 128
    p = param_count(shared)
    assert p.experts == 2 * 4 * 144                           # shared expert not routed
    assert p.layers == (2 * 192 + 2 * (32 + 4 * 144 + 3 * 8 * 5 + 8) + 2 * 20
                        + 2 * (8 + 4 + 4))                    # + QKV biases


def test_qwen3_30b_a3b_decode_reads_about_its_active_parameters() -> None:
    """Batch 1 reads ~3.0B of the 30.5B weights (the embedding rows gathered, the head
    read in full); 64 rows read most experts (1 - (1 - 8/128)^64 = 98.4%)."""
    one = step_work(QWEN3_30B_A3B, decode_step(1, 0), weight_dtype="bf16")
    p = param_count(QWEN3_30B_A3B)
    assert one.weight_bytes / 2 == pytest.approx(p.active - p.embedding, rel=1e-3)
    many = step_work(QWEN3_30B_A3B, decode_step(64, 0), weight_dtype="bf16")
    experts = dict(many.byte_terms)["weights.experts"] / 2
    assert experts == pytest.approx(p.experts * (1 - (1 - 8 / 128) ** 64))
    # the roofline's ridge crossing is still the smallest batch past the ridge
    r = analyse(QWEN3_30B_A3B, "h100-sxm", 1, 16, 0, "bf16")
    b, ridge = r["ridge_crossing_batch_context0"], r["ridge_point"]
    kw = {"weight_dtype": "bf16", "kv_dtype": "bf16"}
    assert step_work(QWEN3_30B_A3B, decode_step(b, 0), **kw).ai >= ridge
    assert step_work(QWEN3_30B_A3B, decode_step(b - 1, 0), **kw).ai < ridge
    assert r["model"]["active_params"] == p.active and r["model"]["num_experts"] == 128


def test_attention_pairs_cap_each_row_at_the_window() -> None:
    assert attention_pairs(3, 5) == 6 + 7 + 8
    assert attention_pairs(3, 5, window=7) == 6 + 7 + 7
    assert attention_pairs(4, 0, window=2) == 1 + 2 + 2 + 2
    assert attention_pairs(1, 8191, window=512) == 512
    assert attention_pairs(0, 9, window=4) == 0


def test_sliding_layers_read_at_most_the_window() -> None:
    """Gemma 3 270M: 3 full and 15 sliding layers (W 512), 4 q heads of 256."""
    cfg = GEMMA_3_270M
    assert cfg.num_sliding_layers == 15
    c = step_work(cfg, decode_step(1, 8191), kv_dtype="bf16")
    per_layer_pair = 2 * 4 * 256                              # scores (values the same)
    assert dict(c.flops_terms)["attn_scores"] == per_layer_pair * (3 * 8192 + 15 * 512)
    per_layer_token = 2 * 1 * 256 * 2                          # K and V, one kv head, bf16
    # the context read: all 8191 cached tokens, or the window's 511 besides the new one
    assert c.kv_read_bytes == per_layer_token * (3 * 8191 + 15 * 511)
    assert c.kv_write_bytes == per_layer_token * 18            # every layer writes
    # within the window nothing changes against full attention
    full = replace(cfg, layer_types=())
    short = [(7, 100), (1, 300)]
    assert step_work(cfg, short).flops == step_work(full, short).flops
    assert step_work(cfg, short).bytes == step_work(full, short).bytes


def test_gemma3_8192_context_holds_a_sixth_plus_the_windows() -> None:
    """The issue's bound: 1/6 + 5/6 x 512/8192 of full attention's KV bytes, exact in
    tokens and in 16-token blocks (8192 and 512 are whole blocks)."""
    cfg, tokens = GEMMA_3_270M, 8192
    full = kv_bytes_per_token(cfg, "bf16") * tokens
    bound = 1 / 6 + 5 / 6 * 512 / 8192
    assert kv_bytes_held(cfg, tokens, "bf16") / full == pytest.approx(bound, rel=1e-12)
    assert kv_bytes_held(cfg, tokens, "bf16", block_size=16) / full == pytest.approx(bound)
    # one token more opens a block in every group: block rounding, at most a block a group
    rounded = kv_bytes_held(cfg, tokens + 1, "bf16", block_size=16)
    exact = kv_bytes_held(cfg, tokens + 1, "bf16")
    assert 0 < rounded - exact <= len(cfg.kv_groups()) * cfg.kv_block_bytes(16, 2)
    # a full-attention model holds every token
    assert kv_bytes_held(LLAMA_3_8B, 100, "bf16") == kv_bytes_per_token(LLAMA_3_8B, "bf16") * 100
    # Gemma 3 4B: 5 full and 29 sliding layers in groups of 5 (one padding slot, which
    # the cache allocates and so counts)
    g4 = GEMMA_3_4B
    assert [len(g.layer_ids) for g in g4.kv_groups()] == [5, 5, 5, 5, 5, 5, 4]
    per_slot = 2 * 4 * 256 * 2
    assert kv_bytes_held(g4, 8192, "bf16") == per_slot * (5 * 8192 + 6 * 5 * 1024)


def test_held_bytes_equal_what_the_cache_manager_holds() -> None:
    """A Gemma 3 270M request prefilled in chunks of 512 up to 8192 tokens, then one decode:
    the blocks the real KV cache manager holds (per kind) x the block bytes equal
    kv_bytes_held with block rounding."""
    cfg, bs = GEMMA_3_270M, 16
    kv = KVCacheManager(4096, bs, windows=tuple(g.window for g in cfg.kv_groups()))
    r = Request("a", [(7 * i) % 1000 + 3 for i in range(8192)])
    hashing.update_block_hashes(r, bs)
    while r.num_computed_tokens < 8192:
        assert kv.allocate_slots(r, 512) is not None
        r.num_computed_tokens += 512
    r.append_output_token_ids(5)
    assert kv.allocate_slots(r, 1) is not None                  # the decode of token 8192
    block_bytes = cfg.kv_block_bytes(bs, 2)
    held = sum(kv.used_blocks_by_kind().values()) * block_bytes
    assert held == kv_bytes_held(cfg, 8193, "bf16", block_size=bs)
    assert kv.used_blocks_by_kind() == {"full": 513, "sliding": 5 * 33}
