"""ModelConfig -> the model class. Every family (models/families/) runs on the one decoder."""
from __future__ import annotations

from duetserve.config import ModelConfig
from duetserve.models.decoder import DecoderForCausalLM


def model_class(cfg: ModelConfig) -> type[DecoderForCausalLM]:
    return DecoderForCausalLM
