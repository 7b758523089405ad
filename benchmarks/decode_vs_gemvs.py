"""A batch-1 decode step against the GEMVs it runs, interleaved in one process: the
model's own packed weights in model order (every layer's qkv, o, gate_up, down, then the
LM head) at one row, then a greedy decode on the engine, round after round. The step's
time minus the GEMVs' is everything else a decode step does (attention, norms, rotary,
Python, sampling); the GEMVs' bytes over their time is the weight stream's rate. With a
512 MiB `torch.sum` at the start and the end as the machine's read ceiling
(`decode_modes.memory_probe`), this says
whether batch-1 decode is at the memory's limit (docs/benchmarks.md, 2026-11-25).

    .venv/bin/python benchmarks/decode_vs_gemvs.py --model M [--threads 2] [--rounds 8]
        [--out F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from duetserve import LLM, SamplingParams
from duetserve.models.layers import dense_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_modes import memory_probe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--out", default="decode_vs_gemvs.json")
    args = ap.parse_args()
    probe_before = memory_probe(args.threads)
    llm = LLM(model=args.model, max_model_len=1024, num_threads=args.threads,
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    # each projection's weight as the decode step reads it: a packed low-bit weight, or a
    # dense float32 one (run by the same native GEMV the step uses); the LM head last
    # (the embedding when tied and dense).
    mods = [mod for layer in model.layers
            for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    head = getattr(model, "lm_head", None)
    weights = [getattr(m, "qweight", None) if getattr(m, "qweight", None) is not None
               else m.weight.detach() for m in mods]
    if head is not None:
        weights.append(head.qweight if getattr(head, "qweight", None) is not None
                       else head.weight.detach())
    else:
        weights.append(model.embed_tokens.weight.detach())
    if any(w is None for w in weights):
        raise SystemExit("a projection has neither a packed nor a dense weight")
    dense = [isinstance(w, torch.Tensor) for w in weights]
    if any(d and w.dtype != torch.float32 for d, w in zip(dense, weights)):
        raise SystemExit("dense weights must be float32 (the native GEMV's)")
    nbytes = sum(w.nbytes for w in weights)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}

    def gemvs() -> None:
        for w, d in zip(weights, dense):
            if d:
                dense_linear(xs[w.shape[1]], w)
            else:
                w.matmul(xs[w.shape[1]])

    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    prompt = [[(11 * i + 5) % 150000 + 100 for i in range(8)]]
    llm.generate(prompt, params)
    rows = []
    print(f"{'round':>5} {'GEMVs ms':>9} {'GB/s':>6} {'step ms':>8} {'other ms':>9}")
    for r in range(args.rounds):
        gemvs()
        t = time.perf_counter()
        for _ in range(10):
            gemvs()
        g = (time.perf_counter() - t) / 10
        m = llm.generate(prompt, params)[0].metrics
        step = (m.finished_time - m.first_token_time) / (args.gen_len - 1)
        rows.append({"gemvs_ms": g * 1e3, "step_ms": step * 1e3, "other_ms": (step - g) * 1e3,
                     "gemv_gb_s": nbytes / g / 1e9})
        print(f"{r:>5} {g * 1e3:9.2f} {nbytes / g / 1e9:6.1f} {step * 1e3:8.2f} "
              f"{(step - g) * 1e3:9.2f}")
    probe_after = memory_probe(args.threads)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(f"median: GEMVs {med['gemvs_ms']:.2f} ms ({nbytes / 1e6:.0f} MB, "
          f"{med['gemv_gb_s']:.1f} GB/s), step {med['step_ms']:.2f} ms, other "
          f"{med['other_ms']:.2f} ms; torch.sum 512 MiB {probe_before:.1f} / "
          f"{probe_after:.1f} GB/s (before / after)")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "threads": args.threads, "weight_mb": nbytes / 1e6,
                   "sum_probe_gb_s": [probe_before, probe_after], "rounds": rows,
                   "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
