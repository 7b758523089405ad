"""A cold step on an idle engine, with and without the idle malloc_trim (docs/simulator.md §3, r36).

    PYTHONPATH=. .venv/bin/python benchmarks/cold_step.py trim|keep [--threads 2]

Sends single requests (a --prompt-tokens prompt, 4 tokens out) one after another through
one engine (float32, KV prefaulted), idle for --idle seconds between them as a served
engine is between arrivals, so every request's first step is a cold prefill-only one
(EngineCore._on_idle ran before it). Prints the cold step's median and p90 and the
decode steps' median, skipping --warmup requests, and writes them to --out. `keep`
replaces the engine's release_free_memory with a no-op: the refaults after malloc_trim
are then absent, so trim against keep is their cost.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import duetserve.engine.engine_core as engine_core
from duetserve.engine.llm import LLM
from duetserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("trim", "keep"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--idle", type=float, default=0.3, help="seconds idle between requests")
    ap.add_argument("--out", default=None, help="JSON (default out/cold_step-MODE.json)")
    args = ap.parse_args()
    if args.mode == "keep":
        engine_core.release_free_memory = lambda: None
    engine = LLM(dtype="float32", kv_prefault=True, num_threads=args.threads).engine
    step_ms: list[float] = []
    engine.step_observers.append(lambda stats: step_ms.append(stats.step_seconds * 1e3))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    cold, decode = [], []
    for i in range(args.requests):
        step_ms.clear()
        engine.add_request(str(i), [rng.randrange(100, 20000) for _ in range(args.prompt_tokens)],
                           params)
        while engine.has_unfinished_requests():
            engine.step_deltas()
        time.sleep(args.idle)          # the idle spell the next request's first step follows
        if i >= args.warmup:
            cold.append(step_ms[0])
            decode.append(statistics.median(step_ms[1:]))
    p90 = sorted(cold)[int(0.9 * len(cold))]
    print(f"| mode | cold step median (ms) | cold step p90 (ms) | decode step median (ms) |\n"
          f"|---|---|---|---|\n"
          f"| {args.mode} | {statistics.median(cold):.1f} | {p90:.1f} | "
          f"{statistics.median(decode):.1f} |")
    out = Path(args.out or f"out/cold_step-{args.mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": args.mode, "threads": args.threads, "idle_s": args.idle,
                               "prompt_tokens": args.prompt_tokens, "cold_step_ms": cold,
                               "decode_step_median_ms": decode}))


if __name__ == "__main__":
    main()
