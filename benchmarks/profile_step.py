"""Where a step's time goes: a batch-1 decode step, a 64-sequence decode step and a
512-token prefill, split into GEMMs, attention, other tensor ops, the model's Python,
input preparation, scheduler, sampling and output handling (detokenize + outputs).

    .venv/bin/python benchmarks/profile_step.py [--model M] [--quantization auto] [--threads 2]

Stage times are wall-clock timers around the engine's own functions (patched in this
process only); the split of the model forward into op kinds comes from torch.profiler's
self-CPU times, scaled to the forward's wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from duetserve import LLM, SamplingParams

GEMM = ("aten::mm", "aten::addmm", "aten::linear", "aten::_weight_int4pack_mm_for_cpu",
        "aten::_weight_int8pack_mm", "aten::matmul", "aten::bmm")
ATTN = ("aten::_scaled_dot_product", "aten::index_copy_", "aten::softmax", "aten::_softmax",
        "aten::masked_fill_", "aten::index_select", "duet")


class Timers:
    def __init__(self) -> None:
        self.t = defaultdict(float)

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[label] += time.perf_counter() - t0
        setattr(obj, name, timed)


def instrument(llm) -> Timers:
    import duetserve.worker.model_runner as mr
    eng = llm.engine
    tm = Timers()
    tm.wrap(eng.scheduler, "schedule", "scheduler")
    tm.wrap(eng.scheduler, "update_from_output", "scheduler")
    tm.wrap(eng.executor, "_execute", "runner (all)")
    tm.wrap(eng.runner.model, "forward", "model forward")
    tm.wrap(eng.runner.model, "compute_logits", "logits (LM head)")
    tm.wrap(eng.runner.sampler, "sample", "sampling")
    tm.wrap(mr, "build_step_batch", "input preparation")
    tm.wrap(eng, "_make_outputs", "output handling")
    return tm


def op_split(prof) -> dict[str, float]:
    split = defaultdict(float)
    for e in prof.key_averages():
        if not e.key.startswith("aten::") and not e.key.startswith("duet"):
            continue
        kind = ("GEMM" if e.key.startswith(GEMM) else
                "attention" if e.key.startswith(ATTN) or "paged" in e.key else "other ops")
        split[kind] += e.self_cpu_time_total / 1e6
    return split


def profile_case(llm, prompts, max_tokens, warm_steps, steps, warm_runs=0) -> dict:
    """Profiles `steps` steps after `warm_steps` of the prompts; `warm_runs` earlier
    whole runs of the same prompts (a prefill's first run of a shape creates oneDNN
    primitives and pages in buffers, seconds at 512 tokens)."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for r in range(warm_runs):
        for i, p in enumerate(prompts):
            eng.add_request(f"w{r}-{time.time_ns()}-{i}", p, params)
        while eng.has_unfinished_requests():
            eng.step()
    for i, p in enumerate(prompts):
        eng.add_request(f"p{time.time_ns()}-{i}", p, params)
    for _ in range(warm_steps):
        eng.step()
    tm = instrument_state["tm"]
    tm.t.clear()
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t0)
    stages = {k: v / steps for k, v in tm.t.items()}    # before draining the rest
    while eng.has_unfinished_requests():
        eng.step()
    wall = sum(walls)
    ops = {k: v / steps for k, v in op_split(prof).items()}
    fwd = stages.get("model forward", 0.0)
    # Ops the profiler sees are aten ops; duetserve's native kernels (GEMVs, paged
    # attention, norms) are not recorded, so they are the rest of the forward's time.
    # Profiler-visible times are scaled down by its own overhead (visible <= forward).
    visible = sum(ops.values())
    scale = min(1.0, fwd / visible) if visible else 1.0
    split = {k: v * scale for k, v in ops.items()}
    split["native kernels (not profiled)"] = max(0.0, fwd - visible * scale)
    return {"step_ms": 1e3 * statistics.median(walls), "mean_step_ms": 1e3 * wall / steps,
            "stages_ms": {k: 1e3 * v for k, v in stages.items()},
            "forward_split_ms": {k: 1e3 * v for k, v in split.items()}}


instrument_state: dict = {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(model=args.model, num_threads=args.threads, quantization=args.quantization,
              dtype=args.dtype, kv_cache_memory=1.0, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    instrument_state["tm"] = instrument(llm)
    vocab = llm.engine.model_config.vocab_size

    def prompt(n, seed):
        return [(seed * 7919 + 31 * i) % (vocab - 300) + 100 for i in range(n)]
    cases = {
        "decode, batch 1 (ctx ~300)": profile_case(llm, [prompt(300, 1)], 200, 4, 32),
        "decode, 64 seqs (ctx ~300)": profile_case(llm, [prompt(300, s) for s in range(64)],
                                                   64, 20, 8),
        "prefill, 512 tokens": profile_case(llm, [prompt(512, 99)], 2, 0, 1,
                                            warm_runs=2),
    }
    print(llm.engine.loaded.describe())
    for name, c in cases.items():
        print(f"\n{name}: step {c['step_ms']:.2f} ms (median)")
        for k, v in sorted(c["stages_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:22} {v:9.2f} ms")
        for k, v in sorted(c["forward_split_ms"].items(), key=lambda kv: -kv[1]):
            print(f"    forward: {k:12} {v:9.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"weights": llm.engine.loaded.describe(), "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
