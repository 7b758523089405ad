"""Read GGUF checkpoints (loader/gguf_reader.py, on the `gguf` library's constants and
block decoders): metadata -> ModelConfig, tensors -> lazy row readers under Hugging Face
parameter names (so one weight-assignment path serves
GGUF and safetensors alike).

NOTE: llama.cpp's converter permutes the rows of Q and K of Llama-architecture models
for interleaved (GPT-J style) rotary. Our model uses Hugging Face's rotate-half rotary,
so those rows are permuted back here (`unpermute_qk`).
"""
from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterator

import numpy as np

from duetserve.config import ConfigError, ModelConfig
from duetserve.errors import CheckpointError
from duetserve.models import families
from duetserve.models.families.base import Family
from duetserve.loader.gguf_blocks import GGUFTensor
from duetserve.loader.gguf_reader import GGUFFile, TruncatedGGUF

GGUF_MAGIC = b"GGUF"
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",   # Llama-3.1 rope scaling factors, not a parameter
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def open_gguf(path: str) -> GGUFFile:
    """Open and validate a GGUF file (loader/gguf_reader.py: metadata and tensor index,
    no per-element objects); every failure becomes a one-line CheckpointError."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if not os.path.isfile(path):
        raise CheckpointError(f"not a file: {path} (expected a .gguf file or a HF folder)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")
    try:
        return GGUFFile(path)
    except TruncatedGGUF as e:
        raise CheckpointError(f"GGUF file is truncated: {e}: {path}") from None
    except Exception as e:  # a damaged file fails in many ways
        raise CheckpointError(f"cannot read GGUF file {path} (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from None


def gguf_family(reader: GGUFFile, path: str = "") -> Family:
    """The model family of a GGUF file (models/families/), or CheckpointError naming the
    supported architectures."""
    arch = reader.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"GGUF file has no general.architecture: {path}")
    family = families.by_gguf_arch(arch)
    if family is None:
        raise CheckpointError(f"unsupported architecture {arch!r} in {path}; supported: "
                              + ", ".join(families.gguf_arch_names()))
    return family


def gguf_model_config(reader: GGUFFile, path: str = "") -> ModelConfig:
    """Build a ModelConfig from GGUF metadata: the keys every family shares, then the
    family's own; errors name the missing key or the unsupported architecture."""
    family = gguf_family(reader, path)
    arch = reader.get("general.architecture")

    def need(key: str):
        v = reader.get(f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"GGUF metadata key {arch}.{key} is missing: {path}")
        return v

    def meta(key: str, default: object = None) -> object:
        return reader.get(f"{arch}.{key}", default)

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    vocab = int(meta("vocab_size", reader.array_len("tokenizer.ggml.tokens") or 0))
    names = {t.name for t in reader.tensors}
    eos = reader.get("tokenizer.ggml.eos_token_id")
    eot = reader.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    rope_scaling = None
    stype = meta("rope.scaling.type")
    if stype == "linear":
        rope_scaling = (("rope_type", "linear"),
                        ("factor", float(meta("rope.scaling.factor", 1.0))))
    elif stype not in (None, "none"):
        raise CheckpointError(f"unsupported rope scaling type {stype!r} in {path}")
    weight_type = next((t.tensor_type.name.lower() for t in reader.tensors
                        if t.name.endswith("attn_q.weight")), "f32")
    fields = dict(
        architecture=family.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length", 0) or 0),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        has_qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        weight_dtype=weight_type,
    )
    try:
        fields.update(family.gguf_fields(meta))
        fields.update(family.traits)
        if not fields["intermediate_size"]:          # an all-MoE file has no dense FFN
            fields["intermediate_size"] = fields.get("moe_intermediate_size", 0)
        return ModelConfig(**fields)
    except (ConfigError, ValueError, TypeError) as e:
        raise CheckpointError(f"cannot read the {family.name} metadata of {path}: "
                              f"{type(e).__name__}: {e}") from None


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rotary row permutation of a Q or K weight (or bias).

    Per head, the converter reordered rows [x0..x_{d/2-1}, y0..y_{d/2-1}] (rotate-half
    pairs) into [x0, y0, x1, y1, ...]; we restore the rotate-half order.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    # (heads, d/2, 2, ...) -> (heads, 2, d/2, ...)
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def drop_mapped_pages(reader: GGUFFile) -> None:
    """Unmap from this process the file pages read so far (the weights were repacked from
    them). The map itself may live on (a file-backed embedding reads rows from it), and
    while it does every page touched counts in the process's resident memory; dropped, a
    later read maps just the pages it needs again (from the page cache, no disk I/O)."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


def _check_type(tensor) -> None:
    if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
        raise CheckpointError(f"unsupported GGUF tensor type {tensor.tensor_type.name} (tensor "
                              f"{tensor.name}); supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")


def dequantize(tensor) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in row-major [rows, cols] layout."""
    _check_type(tensor)
    return GGUFTensor(tensor.name, tensor).dequantize()


def iter_gguf_tensors(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, GGUFTensor]]:
    """Yield (hf_name, lazy GGUFTensor) for every tensor, Q/K rows restored to HF order
    (as a row permutation applied when rows are read) for the families whose converter
    permuted them, and a layer's stacked experts split into one tensor per expert
    ("mlp.experts.{e}.gate_proj.weight"). Nothing is decoded here."""
    family = families.by_name(config.architecture)
    layer_names = {**_LAYER_NAMES, **family.gguf_tensor_names}
    for t in reader.tensors:
        m = _BLK.match(t.name)
        if m:
            suffix = layer_names.get(m.group(2))
            if suffix is None:
                raise CheckpointError(f"unexpected GGUF tensor {t.name}")
            name = f"model.layers.{m.group(1)}.{suffix}"
        else:
            name = _GLOBAL_NAMES.get(t.name)
            if name is None:
                raise CheckpointError(f"unexpected GGUF tensor {t.name}")
        _check_type(t)
        if ".mlp.experts." in name:
            yield from _expert_parts(name, GGUFTensor(t.name, t), config.num_experts)
            continue
        perm = None
        if family.gguf_permuted_qk and (".q_proj." in name or ".k_proj." in name):
            heads = (config.num_attention_heads if ".q_proj." in name
                     else config.num_key_value_heads)
            rows = int(t.shape[1]) if len(t.shape) > 1 else int(t.shape[0])
            perm = unpermute_qk(np.arange(rows), heads)
        yield name, GGUFTensor(t.name, t, perm)


def _expert_parts(name: str, tensor: GGUFTensor, num_experts: int):
    """A GGUF tensor of a layer's experts ([experts * rows, cols]) as one lazy tensor per
    expert under HF's per-expert name."""
    rows = tensor.shape[0] // max(1, num_experts)
    if num_experts < 1 or rows * num_experts != tensor.shape[0]:
        raise CheckpointError(f"GGUF tensor {tensor.name} has {tensor.shape[0]} rows, not "
                              f"a whole number per expert for {num_experts} experts")
    head, tail = name.split(".mlp.experts.")
    for e in range(num_experts):
        yield f"{head}.mlp.experts.{e}.{tail}", tensor.part(f"{tensor.name}[{e}]",
                                                           e * rows, (e + 1) * rows)
