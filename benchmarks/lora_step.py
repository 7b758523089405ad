"""Cost of LoRA adapters in a decode step: B decode rows (context C) with no adapter, and
with one adapter per row (B distinct adapters, rank R, all attention and MLP projections),
each of the given weight dtypes; both run on the native decode stack. Rounds alternate
base and adapter runs (the machine's speed drifts: each round's ratio is of neighbours),
then the table gives each round and the medians. Random adapters are written in the PEFT
format and loaded as the engine loads them (in 2 MiB pages).

    PYTHONPATH=. .venv/bin/python benchmarks/lora_step.py [--model PATH] [--rows 8]
        [--rank 16] [--context 256] [--steps 30] [--rounds 3]
        [--lora-dtypes int8 bfloat16 float32] [--out out/lora_step.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from duetserve.loader import load_model
from duetserve.models.lora import LoRABatch, linear_shapes
from duetserve.worker.lora_slots import load_adapter_placed
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
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-dtypes", nargs="+", default=["int8"],
                   choices=["float32", "bfloat16", "int8"])
    p.add_argument("--out", default="out/lora_step.json")
    args = p.parse_args()
    loaded = load_model(args.model, quantization="auto")   # the engine's default
    model, cfg, bs = loaded.model, loaded.config, 16
    tmp = tempfile.mkdtemp()
    paths = [write_adapter(f"{tmp}/a{i}", cfg, args.rank, i) for i in range(args.rows)]
    per_seq = (args.context + args.steps + bs) // bs
    kv = allocate_kv_cache(cfg, per_seq * args.rows, bs, loaded.dtype, "cpu")
    paged = getattr(model.layers[0].self_attn.backend, "paged_decode", None) is not None
    work = [SeqWork(str(i), [7 + i], args.context, list(range(i * per_seq, (i + 1) * per_seq)),
                    True, lora_slot=i) for i in range(args.rows)]
    batch = build_step_batch(work, bs, paged_decode=paged, as_rows=chunk_rows(paged))
    loras = {dt: LoRABatch.from_rows(batch.lora_slots, [
        load_adapter_placed(path, cfg, args.rank, getattr(torch, dt), True) for path in paths])
        for dt in args.lora_dtypes}

    def run(lora_batch) -> float:
        with torch.inference_mode():
            for _ in range(3):
                model(batch.input_ids, batch.positions, kv, batch.meta, lora_batch)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                model(batch.input_ids, batch.positions, kv, batch.meta, lora_batch)
            return (time.perf_counter() - t0) / args.steps * 1e3

    rounds = []
    for _ in range(args.rounds):
        base = run(None)
        rounds.append({"base_ms": base, **{dt: run(lora) for dt, lora in loras.items()}})
    print(f"{args.rows} decode rows, context {args.context}, rank {args.rank}, one adapter "
          f"per row; step ms (ratio to the round's base); native stack: "
          f"{model._stack is not None}")
    print("| round | base | " + " | ".join(args.lora_dtypes) + " |")
    print("|---" * (2 + len(args.lora_dtypes)) + "|")
    for i, r in enumerate(rounds):
        print(f"| {i + 1} | {r['base_ms']:.2f} | " + " | ".join(
            f"{r[dt]:.2f} ({r[dt] / r['base_ms']:.2f}x)" for dt in args.lora_dtypes) + " |")
    med = {dt: statistics.median(r[dt] / r["base_ms"] for r in rounds)
           for dt in args.lora_dtypes}
    print("| median ratio | 1.00 | " + " | ".join(f"{med[dt]:.2f}x" for dt in args.lora_dtypes)
          + " |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "rows": args.rows, "rank": args.rank,
                   "context": args.context, "steps": args.steps, "rounds": rounds,
                   "median_ratio": med}, f, indent=1)


if __name__ == "__main__":
    main()
