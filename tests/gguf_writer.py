"""Write a GGUF file from a tiny HF checkpoint folder the way llama.cpp's converter does:
its tensor names, Q/K rows permuted for interleaved rotary (llama architecture), a layer's
experts stacked into one [experts, rows, cols] tensor, Gemma's norm weights stored as
1 + w, its metadata keys, and the byte-level tokenizer (tests/tiny_models.py) as a gpt2
vocabulary. Tensors of two or more dimensions can be quantized (gguf-py's quantizers)."""
from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

ARCH = {"mixtral": "llama", "llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
        "gemma3_text": "gemma3", "qwen2": "qwen2"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
_NORMS = {  # the FFN-side norms differ between the plain and the sandwich layer
    "llama": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PART = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                "w2": "ffn_down_exps"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotate-half -> interleaved row order of a Q or K weight."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _add(writer: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype) -> None:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype is None or arr.ndim < 2 or arr.shape[-1] % 32:
        writer.add_tensor(name, arr)
    else:
        writer.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    keys = {"block_count": cfg["num_hidden_layers"], "context_length":
            cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "feed_forward_length": cfg["intermediate_size"], "attention.head_count": heads,
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
            "rope.freq_base": float(rope.get("rope_theta", cfg.get("rope_theta", 1e4)))}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        keys.update({"expert_count": experts, "expert_used_count": cfg["num_experts_per_tok"],
                     "expert_feed_forward_length": cfg.get("moe_intermediate_size")
                     or cfg["intermediate_size"]})
    if arch == "gemma3":
        keys["attention.sliding_window"] = cfg["sliding_window"]
    for key, value in keys.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", int(value))


def _tokenizer(w: gguf.GGUFWriter, folder: str, cfg: dict) -> None:
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    for a in tj.get("added_tokens", []):
        tokens[a["id"]] = a["content"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    w.add_token_merges([])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)


def write_gguf(folder: str, path: str, qtype=None) -> str:
    """GGUF at `path` from the HF folder; tensors of >= 2 dimensions in `qtype` (None:
    float32). Returns path."""
    from safetensors.numpy import load_file
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    arch = ARCH[cfg["model_type"]]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, arch, cfg)
    _tokenizer(w, folder, cfg)
    norms = _NORMS.get(arch, _NORMS["llama"])
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, arr in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1.0                    # the converter stores 1 + w
        if not name.startswith("model.layers."):
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
            _add(w, gname, arr, qtype if arr.ndim == 2 else None)
            continue
        layer, suffix = name[len("model.layers."):].split(".", 1)
        m = _EXPERT.match(suffix)
        if m:
            experts.setdefault((int(layer), _EXPERT_PART[m.group(2)]), {})[int(m.group(1))] = arr
            continue
        if arch == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            arr = _permute(arr, heads if "q_proj" in suffix else kv_heads)
        _add(w, f"blk.{layer}.{norms.get(suffix) or _LAYER[suffix]}", arr, qtype)
    for (layer, part), by_expert in sorted(experts.items()):
        _add(w, f"blk.{layer}.{part}.weight",
             np.stack([by_expert[e] for e in sorted(by_expert)]), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
