"""Qwen2 / Qwen2.5: Llama with a bias on the Q, K and V projections."""
from __future__ import annotations

from duetserve.models.families.base import Family

QWEN2 = Family("qwen2", hf_model_types=("qwen2",), gguf_archs=("qwen2",),
               traits={"has_qkv_bias": True})
