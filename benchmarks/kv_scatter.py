"""What scattered KV blocks cost a decode step (docs/simulator.md §3, r25: the row tilt).

A fresh engine hands out KV blocks in pool order, so a sequence's blocks sit next to each
other; after serving for a while, requests free their blocks in any order and a new
sequence's blocks land all over the pool. The paged decode attention reads each
sequence's blocks plane by plane (2 KiB per block and head on SmolLM2), so the scattered
layout loses the hardware prefetcher's streams and, in 4 KiB pages, a TLB entry per block.

This times decode-only steps of B streams (prompts of --context tokens, 24 decoded
tokens, as the calibration grid's "served decode" scenario) on one engine, alternating
the free queue's order before each scenario: pool order, then shuffled (a benchmark's
reach into core/block_pool.BlockPool's free queue; the engine never reorders it).
Prints the median step time per batch and layout, and the ratio.

    /tmp/gate.sh env PYTHONPATH=. .venv/bin/python benchmarks/kv_scatter.py \
        [--kv-prefault] --reps 6 --out out/kv_scatter.json
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
from collections import OrderedDict
from pathlib import Path

from duetserve.bench.calibrate import _Driver, _scenario
from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore


def reorder_free_queue(pool, scatter: bool, seed: int) -> None:
    """Put the pool's free blocks in id order, or shuffled. Mutates pool's free queue."""
    ids = sorted(pool._free)
    if scatter:
        random.Random(seed).shuffle(ids)
    pool._free = OrderedDict((i, pool._free[i]) for i in ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--batches", default="1,4,12")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--kv-prefault", action="store_true",
                    help="map the KV cache at start (EngineConfig.kv_prefault)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    engine = EngineCore(EngineConfig(num_threads=args.threads, kv_prefault=args.kv_prefault))
    pool = engine.scheduler.kv_cache_manager.pool
    d = _Driver({"served": engine}, (1000, 40000), 0)
    _scenario(d, "ramp", (4, 48, 1))                         # warm-up
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[tuple[int, bool], list[float]] = {}
    for rep in range(args.reps):
        for b in batches:
            for scatter in (False, True):
                reorder_free_queue(pool, scatter, rep)
                gc.collect()
                mark = len(d.cal.samples)
                _scenario(d, "decode", (b, args.context, 24))
                # decode-only steps with (nearly) every stream in: the batch's shape
                steps = [dt for sl, dt in d.cal.samples[mark:]
                         if all(n == 1 for n, _, _ in sl) and len(sl) >= max(1, b - 2)]
                times.setdefault((b, scatter), []).append(statistics.median(steps))
    rows = []
    print(f"| streams | in pool order (ms) | scattered (ms) | scattered / in order |\n"
          f"|---|---|---|---|")
    for b in batches:
        inorder = statistics.median(times[(b, False)])
        scattered = statistics.median(times[(b, True)])
        rows.append({"streams": b, "in_order_ms": 1e3 * inorder,
                     "scattered_ms": 1e3 * scattered, "ratio": scattered / inorder,
                     "in_order_reps_ms": [1e3 * x for x in times[(b, False)]],
                     "scattered_reps_ms": [1e3 * x for x in times[(b, True)]]})
        print(f"| {b} | {1e3 * inorder:.2f} | {1e3 * scattered:.2f} | "
              f"{scattered / inorder:.3f} |")
    print(f"(medians over {args.reps} alternating repeats of each scenario's median "
          f"decode step; context {args.context}, {args.threads} threads, kv_prefault "
          f"{args.kv_prefault}; {engine.loaded.describe()})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
