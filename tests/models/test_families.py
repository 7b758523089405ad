"""Every model family against transformers on tiny random checkpoints (HF folders built
with transformers' config classes, and GGUF files written from them as llama.cpp's
converter would): logits and 32 greedy tokens, through the module path and the paged
decode kernel, with prompts longer than Gemma's sliding window."""
from __future__ import annotations

import pytest
import torch

from gguf_writer import write_gguf
from model_helpers import PagedModel, rel_err
from tiny_families import FAMILY_VARIANTS, make_family_checkpoint
from tiny_models import TINY
from duetserve.loader import load_model, load_model_config

PROMPT = [5, 17, 99, 3, 250, 42, 42, 7, 128, 64, 1, 200, 33, 12, 90, 91, 92, 150, 11]
GGUF_FAMILIES = [v for v in FAMILY_VARIANTS if v != "qwen2_moe"]   # no llama.cpp arch
EOS = (TINY["eos_token_id"],)       # masked like transformers' min_new_tokens does


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {v: make_family_checkpoint(str(root / v), v) for v in FAMILY_VARIANTS}


@pytest.fixture(scope="module")
def hf_models(family_checkpoints):
    from transformers import AutoModelForCausalLM
    return {v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for v, p in family_checkpoints.items()}


def _reference_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
@pytest.mark.parametrize("paged", [False, True])
def test_logits_and_greedy_match(variant, paged, family_checkpoints, hf_models):
    loaded = load_model(family_checkpoints[variant])
    with torch.no_grad():
        ref = hf_models[variant](torch.tensor([PROMPT])).logits[0, -1]
    model = PagedModel(loaded, num_blocks=512, paged_decode=paged)
    assert rel_err(model.prompt_logits(PROMPT), ref) < 1e-4
    assert model.greedy(PROMPT, 32, EOS) == _reference_greedy(hf_models[variant], PROMPT, 32)


# What a GGUF file can say: llama.cpp's Gemma 3 has every 6th layer full and scales
# attention by head_dim ** -0.5 (transformers reading a GGUF takes its default
# query_pre_attn_scalar, 256: the real files' head size); its Qwen3-MoE has experts in
# every layer (transformers reading a GGUF takes its default moe_intermediate_size, 768).
GGUF_SHAPES = {"gemma3": dict(num_hidden_layers=6, layer_types=None, head_dim=256,
                              query_pre_attn_scalar=256),
               "qwen3_moe": dict(mlp_only_layers=[], moe_intermediate_size=768)}


def _gguf_ready(variant: str, root) -> str:
    return make_family_checkpoint(str(root / variant), variant, **GGUF_SHAPES.get(variant, {}))


@pytest.mark.parametrize("variant", GGUF_FAMILIES)
def test_gguf_float32_equals_the_hf_folder(variant, tmp_path):
    """A float32 GGUF written from the folder (llama.cpp's names, permuted Q/K, stacked
    experts, Gemma's 1 + w norms) loads into the same model as transformers runs."""
    from transformers import AutoModelForCausalLM
    folder = _gguf_ready(variant, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = write_gguf(folder, str(tmp_path / f"{variant}.gguf"))
    loaded = load_model(path, quantization="none")
    hf_cfg = load_model_config(folder)      # a Mixtral GGUF is a "llama" with experts
    assert (loaded.config.num_experts, loaded.config.layer_types) == \
        (hf_cfg.num_experts, hf_cfg.layer_types)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
    model = PagedModel(loaded, num_blocks=512, paged_decode=True)
    assert rel_err(model.prompt_logits(PROMPT), ref) < 1e-4
    assert model.greedy(PROMPT, 32, EOS) == _reference_greedy(hf, PROMPT, 32)


@pytest.mark.parametrize("variant", ["gemma3", "qwen3_moe"])
def test_quantized_gguf_dequantized_equals_transformers(variant, tmp_path):
    """Q8_0 tensors, dequantized (`--quantization none`), against transformers reading the
    same GGUF file (its own dequantization)."""
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForCausalLM
    folder = _gguf_ready(variant, tmp_path)
    path = write_gguf(folder, str(tmp_path / "q8.gguf"), Q.Q8_0)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q8.gguf",
                                              dtype=torch.float32).eval()
    loaded = load_model(path, quantization="none")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
    model = PagedModel(loaded, num_blocks=512, paged_decode=True)
    assert rel_err(model.prompt_logits(PROMPT), ref) < 1e-4
    assert model.greedy(PROMPT, 16, EOS) == _reference_greedy(hf, PROMPT, 16)


def test_family_config_fields(family_checkpoints):
    g = load_model_config(family_checkpoints["gemma3"])
    assert (g.norm_placement, g.qk_norm, g.hidden_act) == ("sandwich", True, "gelu_tanh")
    assert g.layer_types == ("sliding", "sliding", "full", "sliding")
    assert g.sliding_window == 8 and g.rope_local_theta == 1e4 and g.rope_theta == 1e6
    assert g.attention_scale == 24 ** -0.5 and g.embedding_scale == 64 ** 0.5
    assert [grp.kind for grp in g.kv_groups()] == ["full", "sliding", "sliding", "sliding"]
    m = load_model_config(family_checkpoints["qwen3_moe"])
    assert (m.num_experts, m.num_experts_per_tok, m.moe_layer_ids) == (8, 2, (0, 2))
    assert m.qk_norm and m.norm_topk_prob
    q2 = load_model_config(family_checkpoints["qwen2_moe"])
    assert q2.shared_expert_gate and not q2.norm_topk_prob and q2.has_qkv_bias
    assert load_model_config(family_checkpoints["mixtral"]).moe_layer_ids == (0, 1, 2)
