"""Assign checkpoint tensors (Hugging Face names) to a model built on the meta device.

HF q/k/v projections are stacked into our `qkv_proj`, gate/up into `gate_up_proj`.
Every parameter (and every shard of a stacked one) must be loaded exactly once with the
right shape; anything missing, duplicated or extra is named in the error.

With quantization on, the linear weights (and the embedding) are not materialised in
float: their parts are collected lazily and packed by `loader/quantize.py` into the
low-bit forms of `models/quant.py`, then the modules are swapped for `QuantLinear` /
`QuantEmbedding`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from duetserve.config import ModelConfig
from duetserve.errors import CheckpointError
from duetserve.loader.gguf_blocks import GGUFTensor
from duetserve.loader.quantize import QuantPlan

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _stack_plan(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF layer-suffix -> (our suffix, row offset, row count); experts' suffixes are
    matched with their index replaced by "E" (`_target`)."""
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    plan = {
        "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, q),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q, kv),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q + kv, kv),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, i),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", i, i),
    }
    for part, n in (("experts.E", cfg.moe_intermediate_size),
                    ("shared_expert", cfg.shared_expert_intermediate_size)):
        if n:
            plan[f"mlp.{part}.gate_proj.weight"] = (f"mlp.{part}.gate_up_proj.weight", 0, n)
            plan[f"mlp.{part}.up_proj.weight"] = (f"mlp.{part}.gate_up_proj.weight", n, n)
    if cfg.has_qkv_bias:
        plan.update({
            "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0, q),
            "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", q, kv),
            "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", q + kv, kv),
        })
    return plan


# HF names of Mixtral's MoE block -> the ones used here (Qwen-MoE's).
_RENAMES = ((re.compile(r"^block_sparse_moe\."), "mlp."),
            (re.compile(r"^(mlp\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
            (re.compile(r"^(mlp\.experts\.\d+)\.w3\."), r"\1.up_proj."),
            (re.compile(r"^(mlp\.experts\.\d+)\.w2\."), r"\1.down_proj."))
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


def _target(name: str, plan: dict) -> tuple[str, int | None, int | None]:
    m = _LAYER.match(name)
    if m:
        layer, suffix = m.groups()
        for pattern, repl in _RENAMES:
            suffix = pattern.sub(repl, suffix)
        e = _EXPERT.match(suffix)
        key = _EXPERT.sub("mlp.experts.E.", suffix) if e else suffix
        if key in plan:
            ours, off, n = plan[key]
            if e:
                ours = ours.replace("experts.E.", f"experts.{e.group(1)}.")
            return f"layers.{layer}.{ours}", off, n
        return f"layers.{layer}.{suffix}", None, None
    if name.startswith("model."):
        return name[len("model."):], None, None
    return name, None, None


def _as_tensor(arr) -> torch.Tensor:
    """A float array-like (numpy, torch, or a lazy GGUFTensor) as a torch tensor."""
    if isinstance(arr, GGUFTensor):
        return torch.from_numpy(arr.dequantize())
    if isinstance(arr, np.ndarray):
        # F32 tensors come straight from a read-only memory map: copy those.
        arr = np.ascontiguousarray(arr) if arr.flags.writeable else np.array(arr)
        return torch.from_numpy(arr)
    return arr


def _split_fused_experts(tensors: Iterable[tuple[str, object]]):
    """transformers 5's fused expert tensors (mlp.experts.gate_up_proj [E, 2I, d] with gate
    rows first, mlp.experts.down_proj [E, d, I]) as one tensor per expert."""
    for name, arr in tensors:
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and \
                len(arr.shape) == 3:
            head, tail = name.rsplit(".", 1)
            for e in range(arr.shape[0]):
                yield f"{head}.{e}.{tail}.weight", arr[e]
            continue
        yield name, arr


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, object]], cfg: ModelConfig,
                 dtype: torch.dtype, device: str | torch.device = "cpu",
                 quant: QuantPlan | None = None) -> dict[str, object]:
    """Fill `model` (on meta) from (hf_name, array) pairs. Mutates `model` (parameters
    are assigned real tensors; with `quant`, linear modules are replaced by quantized
    ones). Returns the non-parameter extras found (e.g. rope_freqs).
    Raises CheckpointError naming missing, duplicated, extra or mis-shaped tensors."""
    plan = _stack_plan(cfg)
    tensors = _split_fused_experts(tensors)
    params = dict(model.named_parameters())
    buffers: dict[str, torch.Tensor] = {}
    pending: dict[str, list[tuple[int, object]]] = {}   # quantized target -> (row0, part)
    loaded: dict[str, list[tuple[int, int]]] = {}   # param -> loaded row ranges
    extra: list[str] = []
    extras: dict[str, object] = {}
    for name, arr in tensors:
        if name == "rope_freqs":
            extras[name] = arr.dequantize() if isinstance(arr, GGUFTensor) else arr
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue   # tied checkpoints may still store the head; the embedding is used
        target, off, n = _target(name, plan)
        p = params.get(target)
        if p is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            extra.append(name)
            continue
        want = tuple(p.shape) if off is None else (n, *p.shape[1:])
        if tuple(arr.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(arr.shape)}, "
                                  f"expected {want} for {target}")
        rows = (0, p.shape[0]) if off is None else (off, off + n)
        if rows in loaded.setdefault(target, []):
            raise CheckpointError(f"tensor {name} is loaded twice (into {target})")
        loaded[target].append(rows)
        if quant is not None and quant.wants(target, arr):
            pending.setdefault(target, []).append((rows[0], arr))
            continue
        buf = buffers.get(target)
        if buf is None:
            buf = buffers[target] = torch.empty(p.shape, dtype=dtype, device=device)
        buf[rows[0]:rows[1]].copy_(_as_tensor(arr).to(dtype))
        if isinstance(arr, GGUFTensor):
            arr.drop_pages()
    if extra:
        raise CheckpointError(f"unexpected tensors in checkpoint: {', '.join(extra[:8])}"
                              + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else ""))
    missing = [k for k, p in params.items()
               if sum(b - a for a, b in loaded.get(k, [])) != p.shape[0]]
    if missing:
        raise CheckpointError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                              + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if pending:
        # Targets whose parts were only partly quantizable are loaded dense after all.
        for target in [t for t, parts in pending.items()
                       if sum(a.shape[0] for _, a in parts) != params[t].shape[0]]:
            buf = buffers.setdefault(target, torch.empty(params[target].shape, dtype=dtype,
                                                         device=device))
            for row0, arr in pending.pop(target):
                buf[row0:row0 + arr.shape[0]].copy_(_as_tensor(arr).to(dtype))
        quant.apply(model, pending, buffers, cfg)
    model.load_state_dict(buffers, strict=True, assign=True)
    return extras
