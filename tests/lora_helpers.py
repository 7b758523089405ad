"""LoRA adapters made with peft on a tiny checkpoint, and their references: the adapter
merged into the weights (peft's merge_and_unload) run by transformers in float32.

A plain module (not conftest.py) so tests can import it by name."""
from __future__ import annotations

import os

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, path: str, seed: int, r: int = 4, alpha: float = 8,
                 targets: list[str] | None = None, use_rslora: bool = False,
                 scale_b: float = 0.5) -> str:
    """Save a peft LoRA adapter of the HF checkpoint `base` at `path`: random A and a
    random non-zero B (N(0, scale_b)), rank r."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                     use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale_b)
    peft_model.save_pretrained(path)
    assert os.path.isfile(os.path.join(path, "adapter_model.safetensors"))
    return path


def merged_reference(base: str, adapter: str | None):
    """transformers' float32 model of `base` with `adapter` merged in (None: the base)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers from `prompt` (eos not stopping it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
