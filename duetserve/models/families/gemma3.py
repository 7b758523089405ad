"""Gemma 3 (text): sandwich norms with (1 + w) weights, QK-norm, GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar ** -0.5,
five sliding-window layers (RoPE base 10,000, unscaled) to every full one (base 1e6,
scaled where the checkpoint says), tied embeddings."""
from __future__ import annotations

from duetserve.models.families.base import Family, GGUFMeta, layer_types_from_hf

PATTERN = 6          # every 6th layer is full attention (HF's default sliding_window_pattern)
LOCAL_THETA = 10000.0


def _pattern(num_layers: int, every: int = PATTERN) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(num_layers))


def _hf(cfg: dict) -> dict:
    cfg = cfg.get("text_config") or cfg          # a multimodal checkpoint: its text part
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("Gemma attention logit soft-capping is not supported")
    n = int(cfg["num_hidden_layers"])
    types = layer_types_from_hf(cfg) or _pattern(n, int(cfg.get("sliding_window_pattern",
                                                               PATTERN)))
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    return {"embedding_scale": float(cfg["hidden_size"]) ** 0.5,
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "layer_types": types, "sliding_window": int(cfg.get("sliding_window", 4096)),
            "rope_local_theta": float(local.get("rope_theta",
                                                cfg.get("rope_local_base_freq", LOCAL_THETA))),
            "final_logit_softcapping": cfg.get("final_logit_softcapping"),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}


def _gguf(meta: GGUFMeta) -> dict:
    n = int(meta("block_count", 0))
    hidden, heads = int(meta("embedding_length", 0)), int(meta("attention.head_count", 1))
    head_dim = int(meta("attention.key_length", hidden // heads))
    # llama.cpp scales by head_dim ** -0.5, except for the 27B (62 layers), whose
    # query_pre_attn_scalar is hidden / heads (168 against a head_dim of 128)
    scalar = hidden / heads if n == 62 else head_dim
    return {"embedding_scale": float(hidden) ** 0.5, "query_pre_attn_scalar": float(scalar),
            "layer_types": _pattern(n), "sliding_window": int(meta("attention.sliding_window",
                                                                  4096)),
            "rope_local_theta": LOCAL_THETA,
            "final_logit_softcapping": meta("final_logit_softcapping", None)}


GEMMA3 = Family(
    "gemma3", hf_model_types=("gemma3_text", "gemma3"), gguf_archs=("gemma3",),
    traits={"norm_placement": "sandwich", "qk_norm": True, "hidden_act": "gelu_tanh"},
    hf_fields=_hf, gguf_fields=_gguf,
    gguf_tensor_names={"post_attention_norm.weight": "post_attention_layernorm.weight",
                       "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                       "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    hf_norm_offset=1.0, spm_merges_by_index=True, end_of_generation=("<end_of_turn>",))
