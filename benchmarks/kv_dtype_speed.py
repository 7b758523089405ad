"""Decode TPOT by KV cache dtype at a long context (issue 64): batch 1 and batch B with
`--kv-cache-dtype bfloat16 / int8 / int4` on one GGUF file, optionally next to llama.cpp
with the same bits of KV (`llama-batched-bench -ctk/-ctv q8_0 | q4_0 | f16`, flash
attention on). Prints a table and writes JSON.

    .venv/bin/python benchmarks/kv_dtype_speed.py --model FILE.gguf --context 8192 \
        [--batches 1 8] [--kv-dtypes bfloat16 int8 int4] [--steps 32] [--threads 2] \
        [--llama-bin DIR [--llama-kv-dtypes int8] [--llama-shared-prompt]] \
        [--out out/kv_dtype_speed.json]

Each sequence gets its own random prompt of --context tokens (no two share a block: every
sequence reads its own KV, as separate conversations do); the prompts are prefilled as
one-token requests, then sent again (their blocks found in the prefix cache) so that all
decode from the same context, and --steps decode steps of the whole batch are timed with
the engine's own step loop (EngineCore.step). TPOT = time of those steps / steps. The prefill of B x context tokens
is the slow part (minutes at 8 x 8,192 on 2 cores); it is not timed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import time

import torch

LLAMA_KV = {"bfloat16": "f16", "float32": "f16", "int8": "q8_0", "int4": "q4_0"}


def bench_duet(model: str, kv_dtype: str, batch: int, context: int, steps: int,
               threads: int) -> dict:
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.sampling_params import SamplingParams
    from duetserve.worker.kv_cache import kv_bytes_per_token, kv_storage_dtype
    probe_gib = 0.25
    probe = EngineCore(EngineConfig(model=model, num_threads=threads,
                                    kv_cache_memory=probe_gib, kv_cache_dtype=kv_dtype))
    per_tok = kv_bytes_per_token(probe.model_config, kv_storage_dtype(kv_dtype, torch.float32))
    tokens_per_gib = probe.kv_capacity_tokens / probe_gib    # as the engine lays it out
    loaded, vocab = probe.loaded, probe.model_config.vocab_size
    del probe
    gc.collect()
    # The prompts are prefilled first as requests of one token each, their blocks left in
    # the prefix cache, then sent again to decode: every sequence starts decoding at the
    # same context. (Sent once, a sequence whose prefill ended early decoded while the
    # others prefilled, and at 8 x 8,192 seven of eight had reached max_tokens and ended
    # before the timed steps, which then decoded one sequence.) The prompts are random
    # and unique: no two sequences share a block, each reads its own KV.
    tail = steps + 64
    need_tokens = batch * (context + tail)
    eng = EngineCore(EngineConfig(model=model, num_threads=threads, kv_cache_dtype=kv_dtype,
                                  kv_cache_memory=max(0.1, 1.1 * need_tokens / tokens_per_gib),
                                  max_model_len=context + tail,
                                  enable_prefix_caching=True), loaded=loaded)
    assert eng.kv_capacity_tokens >= need_tokens, (eng.kv_capacity_tokens, need_tokens)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab - 10, (context,), generator=g).tolist()
               for _ in range(batch)]
    t0 = time.perf_counter()
    for b, prompt in enumerate(prompts):
        eng.add_request(f"p{b}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    prefill_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=tail - 8, ignore_eos=True)
    t0 = time.perf_counter()
    for b, prompt in enumerate(prompts):
        eng.add_request(f"s{b}", prompt, params)
    produced: set[str] = set()
    while len(produced) < batch:          # the prompts' uncached tails, then a token each
        produced.update(o.request_id for o in eng.step() if o.outputs[0].token_ids)
    resume_s = time.perf_counter() - t0
    preempted = eng.scheduler.num_preemptions
    t0 = time.perf_counter()
    rows = []                       # sequences with output in each timed step
    for _ in range(steps):
        rows.append(len(eng.step()))
    tpot = (time.perf_counter() - t0) / steps
    if min(rows) < batch:
        print(f"warning: {kv_dtype} batch {batch}: timed steps output {min(rows)}-{max(rows)}"
              f" of {batch} sequences ({eng.scheduler.num_preemptions} preemptions)")
    for b in range(batch):
        eng.abort_request(f"s{b}")
    return {"kv_dtype": kv_dtype, "batch": batch, "context": context,
            "tpot_ms": tpot * 1e3, "tok_s": batch / tpot, "prefill_s": prefill_s,
            "resume_s": resume_s,
            "rows_min": min(rows), "rows_max": max(rows), "preemptions_before": preempted,
            "preemptions_timed": eng.scheduler.num_preemptions - preempted,
            "kv_capacity_tokens": eng.kv_capacity_tokens,
            "kv_bytes_per_token": per_tok}


def bench_llama(bin_dir: str, model: str, kv_dtype: str, batch: int, context: int,
                steps: int, threads: int, shared_prompt: bool = False) -> dict:
    t = LLAMA_KV[kv_dtype]
    cmd = [os.path.join(bin_dir, "llama-batched-bench"), "-m", model, "-c",
           str(batch * (context + steps) + 64), "-npp", str(context), "-ntg", str(steps),
           "-npl", str(batch), "-t", str(threads), "-fa", "on", "-ctk", t, "-ctv", t]
    if shared_prompt:
        cmd.append("-pps")
    run = subprocess.run(cmd, capture_output=True, text=True)
    # table rows: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [r for r in (run.stdout + run.stderr).splitlines()
            if re.match(r"\|\s*\d+\s*\|\s*\d+\s*\|\s*\d+\s*\|", r)]
    if run.returncode or not rows:
        return {"kv_dtype": t, "batch": batch, "error": (run.stdout + run.stderr)[-1500:]}
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    tg_s = float(cells[7])
    return {"kv_dtype": t, "batch": batch, "context": context, "tok_s": tg_s,
            "tpot_ms": batch / tg_s * 1e3, "shared_prompt": shared_prompt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "int8", "int4"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bin", default=None, help="llama.cpp bin/ (omit: ours only)")
    ap.add_argument("--llama-kv-dtypes", nargs="+", default=None,
                    help="the --kv-dtypes llama.cpp also runs (default: all of them)")
    ap.add_argument("--llama-shared-prompt", action="store_true",
                    help="llama.cpp's sequences share one prompt (-pps): one prefill instead "
                         "of B (8 x 8,192 tokens take it ~20 min on 2 cores); its decode "
                         "then reads one KV B times, which can only flatter llama.cpp")
    ap.add_argument("--out", default="out/kv_dtype_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for b in args.batches:
        for d in args.kv_dtypes:
            r = {"engine": "duetserve", **bench_duet(args.model, d, b, args.context,
                                                     args.steps, args.threads)}
            rows.append(r)
            gc.collect()
            if args.llama_bin and d in (args.llama_kv_dtypes or args.kv_dtypes):
                rows.append({"engine": "llama.cpp", **bench_llama(
                    args.llama_bin, args.model, d, b, args.context, args.steps,
                    args.threads, args.llama_shared_prompt and b > 1)})
    base = {(r["engine"], r["batch"]): r for r in rows if r["kv_dtype"] in ("bfloat16", "f16")}
    print(f"{'engine':<10} {'KV':<9} {'batch':>5} {'TPOT ms':>9} {'tok/s':>8} {'vs bf16':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<10} {r['kv_dtype']:<9} {r['batch']:>5}  failed")
            continue
        ref = base.get((r["engine"], r["batch"]))
        ratio = r["tpot_ms"] / ref["tpot_ms"] if ref and "tpot_ms" in ref else float("nan")
        print(f"{r['engine']:<10} {r['kv_dtype']:<9} {r['batch']:>5} {r['tpot_ms']:>9.2f} "
              f"{r['tok_s']:>8.2f} {ratio:>8.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "context": args.context, "threads": args.threads,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
