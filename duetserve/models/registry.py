"""Architecture name -> model class."""
from __future__ import annotations

from duetserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from duetserve.models.llama import LlamaForCausalLM

_MODELS = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "mistral": LlamaForCausalLM}
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return _MODELS[cfg.architecture]
