"""Mixture-of-experts families: Mixtral (Llama with a top-2 of 8 experts FFN), Qwen3-MoE
(Qwen3 with top-k of many small experts), Qwen2-MoE (Qwen2 with routed experts plus a
gated shared expert)."""
from __future__ import annotations

from duetserve.models.families.base import MOE_GGUF_TENSORS, Family, moe_gguf_fields, moe_layers


def _experts(cfg: dict) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _mixtral_hf(cfg: dict) -> dict:
    n = int(cfg["num_hidden_layers"])
    return {"num_experts": _experts(cfg), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "moe_layer_ids": tuple(range(n))}


def _qwen_moe_hf(cfg: dict) -> dict:
    n = int(cfg["num_hidden_layers"])
    return {"num_experts": _experts(cfg), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_layer_ids": moe_layers(n, cfg.get("decoder_sparse_step", 1),
                                        tuple(cfg.get("mlp_only_layers") or ())),
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size")
                                                   or 0)}


MIXTRAL = Family("mixtral", hf_model_types=("mixtral",), hf_fields=_mixtral_hf,
                 traits={"norm_topk_prob": True}, gguf_permuted_qk=True)
QWEN3_MOE = Family("qwen3_moe", hf_model_types=("qwen3_moe",), gguf_archs=("qwen3moe",),
                   traits={"qk_norm": True}, hf_fields=_qwen_moe_hf, gguf_fields=moe_gguf_fields,
                   gguf_tensor_names=MOE_GGUF_TENSORS)
QWEN2_MOE = Family("qwen2_moe", hf_model_types=("qwen2_moe",),
                   traits={"has_qkv_bias": True, "shared_expert_gate": True},
                   hf_fields=_qwen_moe_hf)
