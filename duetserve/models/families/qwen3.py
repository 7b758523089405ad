"""Qwen3 (dense): Qwen2 without the QKV bias, with an RMSNorm over each head of q and k."""
from __future__ import annotations

from duetserve.models.families.base import Family

QWEN3 = Family("qwen3", hf_model_types=("qwen3",), gguf_archs=("qwen3",),
               traits={"qk_norm": True})
