"""Read Hugging Face checkpoint folders: config.json, model.safetensors or sharded
*.safetensors with model.safetensors.index.json, generation_config.json (eos ids)."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

from duetserve.config import ConfigError, ModelConfig
from duetserve.errors import CheckpointError
from duetserve.models import families


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def _rope(cfg: dict) -> tuple[float, tuple | None]:
    """rope_theta and scaling from either the transformers<5 keys (rope_theta,
    rope_scaling) or the transformers>=5 key (rope_parameters; per layer type where the
    layer types differ: the full-attention layers' here, sliding ones are the family's)."""
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise CheckpointError(f"unsupported rope scaling type {rope_type!r}; "
                              "supported: default, linear, llama3")
    items = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    items["rope_type"] = rope_type
    return theta, tuple(sorted(items.items()))


def hf_model_config(folder: str) -> ModelConfig:
    """config.json (+ generation_config.json's eos ids) -> ModelConfig: the fields every
    family shares, then the family's own (models/families/)."""
    top = read_json(os.path.join(folder, "config.json"))
    model_type = top.get("model_type")
    family = families.by_hf_model_type(model_type)
    if family is None:
        archs = top.get("architectures") or [model_type]
        raise CheckpointError(f"unsupported architecture {archs[0]!r} (model_type "
                              f"{model_type!r}) in {folder}; supported model types: "
                              + ", ".join(families.hf_model_type_names()))
    cfg = top.get("text_config") or top      # multimodal checkpoints: the text model
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope(cfg)
    eos = top.get("eos_token_id", cfg.get("eos_token_id"))
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        eos = read_json(gen_path).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    dtype = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(
        str(cfg.get("torch_dtype", cfg.get("dtype", "float32"))), "f32")
    fields = dict(
        architecture=family.name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0)
        or int(cfg.get("moe_intermediate_size") or 0),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(top.get("tie_word_embeddings",
                                         cfg.get("tie_word_embeddings", False))),
        has_qkv_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=top.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        weight_dtype=dtype,
    )
    try:
        fields.update(family.hf_fields(cfg))
        fields.update(family.traits)
        return ModelConfig(**fields)
    except (ConfigError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read the {family.name} config in {folder}: "
                              f"{type(e).__name__}: {e}") from None


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(read_json(index)["weight_map"].values()))
        files = [os.path.join(folder, s) for s in shards]
    else:
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                       if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder}")
    for f in files:
        if not os.path.isfile(f):
            raise CheckpointError(f"missing weight shard {f}")
    return files


def iter_safetensors(folder: str, norm_offset: float = 0.0) -> Iterator[tuple[str, "object"]]:
    """Yield (hf_name, torch tensor) for every tensor of every shard; RMSNorm weights
    ("*norm.weight") get `norm_offset` added (the family's, e.g. Gemma's 1 + w)."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if norm_offset and name.endswith("norm.weight"):
                        t = t.float() + norm_offset
                    yield name, t
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
