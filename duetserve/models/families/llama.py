"""Llama, Llama 3.x and Mistral: the plain pre-norm decoder (every ModelConfig default).
Mistral's sliding window (v0.1: 4096 on every layer) makes every layer a sliding one.
llama.cpp converts Mixtral to a "llama" GGUF with experts (`moe_gguf_fields`)."""
from __future__ import annotations

from duetserve.models.families.base import MOE_GGUF_TENSORS, Family, moe_gguf_fields


def _mistral_window(cfg: dict) -> dict:
    window = cfg.get("sliding_window")
    if not window or window >= cfg.get("max_position_embeddings", 0):
        return {}
    return {"sliding_window": int(window),
            "layer_types": ("sliding",) * int(cfg["num_hidden_layers"])}


LLAMA = Family("llama", hf_model_types=("llama",), gguf_archs=("llama",),
               gguf_fields=moe_gguf_fields, gguf_tensor_names=MOE_GGUF_TENSORS,
               gguf_permuted_qk=True)
MISTRAL = Family("mistral", hf_model_types=("mistral",), gguf_archs=("mistral",),
                 hf_fields=_mistral_window, gguf_permuted_qk=True)
