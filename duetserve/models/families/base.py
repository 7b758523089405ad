"""A model family as data: what it changes in the one decoder (models/decoder.py).

A family file declares a `Family`: the names it goes by (Hugging Face `model_type`,
GGUF `general.architecture`), the ModelConfig fields that are constant for it (`traits`),
the fields it reads from a config.json or from GGUF metadata beyond the common ones
(loader/hf_folder.py and loader/gguf_file.py read those), and how its checkpoints name
tensors where they differ from Llama's. Adding a family is one such file plus tests.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# GGUF metadata of the file's architecture: meta("rope.freq_base", default) reads
# "<arch>.rope.freq_base".
GGUFMeta = Callable[[str, object], object]


def _none(_: object) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    name: str                                     # ModelConfig.architecture
    hf_model_types: tuple[str, ...] = ()          # config.json "model_type"
    gguf_archs: tuple[str, ...] = ()              # GGUF general.architecture
    traits: Mapping[str, object] = field(default_factory=dict)   # fixed ModelConfig fields
    # config.json (as a dict) -> further ModelConfig fields
    hf_fields: Callable[[dict], dict] = _none
    # GGUF metadata -> further ModelConfig fields
    gguf_fields: Callable[[GGUFMeta], dict] = _none
    # per-layer GGUF tensor names (after "blk.N.") that differ from Llama's -> HF suffixes
    gguf_tensor_names: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp's converter permutes Q and K rows of these for interleaved rotary
    gguf_permuted_qk: bool = False
    # HF checkpoints store RMSNorm weights w for a norm that multiplies by (offset + w)
    # (Gemma: 1 + w); the loader adds the offset. GGUF files store offset + w already.
    hf_norm_offset: float = 0.0
    # A SentencePiece GGUF vocabulary without merges: the merges are rebuilt from the
    # vocabulary, best first by token score (llama.cpp's order), or by token index where
    # a family's scores do not follow its merge order (Gemma).
    spm_merges_by_index: bool = False
    # Tokens (by text) that end generation besides the file's eos id: the chat turn end
    # of an instruction-tuned checkpoint (Gemma's <end_of_turn>).
    end_of_generation: tuple[str, ...] = ()


def layer_types_from_hf(cfg: dict) -> tuple[str, ...]:
    """HF `layer_types` ("sliding_attention" / "full_attention") as ModelConfig's."""
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    return tuple(names[t] for t in cfg.get("layer_types") or ())


def moe_layers(num_layers: int, sparse_step: int = 1, dense_layers=()) -> tuple[int, ...]:
    """Layers with a mixture-of-experts FFN: every `sparse_step`-th (Qwen's
    decoder_sparse_step: (i + 1) % step == 0) except `dense_layers` (mlp_only_layers)."""
    step = max(1, int(sparse_step or 1))
    return tuple(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense_layers)


def moe_gguf_fields(meta: GGUFMeta) -> dict:
    """llama.cpp's MoE keys; it always renormalises the chosen weights for these
    architectures (Qwen3-MoE's and Mixtral's checkpoints do too)."""
    n, experts = int(meta("block_count", 0)), int(meta("expert_count", 0))
    if not experts:
        return {}
    return {"num_experts": experts, "num_experts_per_tok": int(meta("expert_used_count", 0)),
            "moe_intermediate_size": int(meta("expert_feed_forward_length", 0)
                                         or meta("feed_forward_length", 0)),
            "moe_layer_ids": tuple(range(n)), "norm_topk_prob": True}


MOE_GGUF_TENSORS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
