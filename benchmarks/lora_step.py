"""Cost of LoRA adapters in a decode step: B decode rows (context C) with no adapter (the
native decode stack), with no adapter through the per-layer modules (what a step with an
adapter row falls back to), and with one adapter per row (B distinct adapters, rank R, all
attention and MLP projections). Random adapters are written in the PEFT format.

    PYTHONPATH=. .venv/bin/python benchmarks/lora_step.py [--model PATH] [--rows 8]
        [--rank 16] [--context 256] [--steps 50] [--lora-dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from duetserve.loader import load_model
from duetserve.models.lora import LoRABatch, linear_shapes, load_adapter
from duetserve.worker.batch import SeqWork, build_step_batch, chunk_rows
from duetserve.worker.kv_cache import allocate_kv_cache

PEFT_NAMES = {"qkv": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
              "o": ("self_attn", ["o_proj"]), "gate_up": ("mlp", ["gate_proj", "up_proj"]),
              "down": ("mlp", ["down_proj"])}


def write_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A random rank-`rank` PEFT adapter of every projection of `cfg`'s layers."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for linear, (fan_in, rows) in linear_shapes(cfg, layer).items():
            block, names = PEFT_NAMES[linear]
            for name, (start, end) in zip(names, rows):
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * .01
                tensors[f"{key}.lora_B.weight"] = torch.randn(end - start, rank, generator=g) * .01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [n for _, ns in PEFT_NAMES.values() for n in ns]}, f)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lora-dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    loaded = load_model(args.model, quantization="auto")   # the engine's default
    model, cfg, bs = loaded.model, loaded.config, 16
    tmp = tempfile.mkdtemp()
    adapters = [load_adapter(write_adapter(f"{tmp}/a{i}", cfg, args.rank, i), cfg, args.rank,
                             dtype=getattr(torch, args.lora_dtype)) for i in range(args.rows)]
    per_seq = (args.context + args.steps + bs) // bs
    kv = allocate_kv_cache(cfg, per_seq * args.rows, bs, loaded.dtype, "cpu")
    paged = getattr(model.layers[0].self_attn.backend, "paged_decode", None) is not None
    work = [SeqWork(str(i), [7 + i], args.context, list(range(i * per_seq, (i + 1) * per_seq)),
                    True, lora_slot=i) for i in range(args.rows)]
    batch = build_step_batch(work, bs, paged_decode=paged, as_rows=chunk_rows(paged))
    lora = LoRABatch.from_rows(batch.lora_slots, adapters)

    def run(lora_batch, modules: bool = False) -> float:
        stack = model._stack
        if modules:
            model._stack = None
        try:
            with torch.inference_mode():
                for _ in range(3):
                    model(batch.input_ids, batch.positions, kv, batch.meta, lora_batch)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    model(batch.input_ids, batch.positions, kv, batch.meta, lora_batch)
                return (time.perf_counter() - t0) / args.steps * 1e3
        finally:
            model._stack = stack

    base = run(None)
    modules = run(None, modules=True)
    mixed = run(lora)
    print(f"{args.rows} decode rows, context {args.context}, rank {args.rank} "
          f"({args.lora_dtype}): "
          f"base {base:.2f} ms (native stack: {model._stack is not None}), base through the "
          f"modules {modules:.2f} ms, {args.rows} adapters {mixed:.2f} ms "
          f"({mixed / base:.2f}x base)")


if __name__ == "__main__":
    main()
