"""One-row GEMV time per projection of a loaded model, over its own packed weights (in the
loader's 2 MiB pages, read from DRAM): for each (projection, form) all layers' weights in
turn, then the LM head. This is how the 1.5B's down projections (K = 8960) were found to
stream at 25-30 GB/s against 39-47 for the K = 1536 ones (docs/benchmarks.md).

    .venv/bin/python benchmarks/gemv_by_projection.py --model M [--threads 2] [--out F]

Median of 15 timings of 3 passes each; prints ms per token for the projection, MB, GB/s
and microseconds per call, and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from duetserve import LLM


def _median_seconds(fn, reps: int = 15, inner: int = 3) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="gemv_by_projection.json")
    args = ap.parse_args()
    llm = LLM(model=args.model, max_model_len=1024, num_threads=args.threads)
    model = llm.engine.runner.model
    groups: dict[tuple[str, str], list] = {}
    for layer in model.layers:
        for name, mod in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                          ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            w = getattr(mod, "qweight", None)
            if w is not None:
                groups.setdefault((name, type(w).__name__), []).append(w)
    head = getattr(getattr(model, "lm_head", None), "qweight", None)
    if head is not None:
        groups[("lm_head", type(head).__name__)] = [head]
    rows = []
    print(f"{'projection':>10} {'form':>12} {'n':>3} {'N x K':>14} {'ms':>7} {'MB':>6} "
          f"{'GB/s':>6} {'us/call':>8}")
    for (name, form), ws in groups.items():
        x = torch.randn(1, ws[0].shape[1])
        t = _median_seconds(lambda: [w.matmul(x) for w in ws])
        nbytes = sum(w.nbytes for w in ws)
        row = {"projection": name, "form": form, "layers": len(ws), "shape": list(ws[0].shape),
               "ms": t * 1e3, "mb": nbytes / 1e6, "gb_s": nbytes / t / 1e9,
               "us_per_call": t / len(ws) * 1e6}
        rows.append(row)
        print(f"{name:>10} {form:>12} {len(ws):>3} {ws[0].shape[0]:>7}x{ws[0].shape[1]:<6} "
              f"{row['ms']:7.2f} {row['mb']:6.0f} {row['gb_s']:6.1f} {row['us_per_call']:8.0f}")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
