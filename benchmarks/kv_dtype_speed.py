"""Decode TPOT by KV cache dtype at a long context (issue 64): batch 1 and batch B with
`--kv-cache-dtype bfloat16 / int8 / int4` on one GGUF file, optionally next to llama.cpp
with the same bits of KV (`llama-batched-bench -ctk/-ctv q8_0 | q4_0 | f16`, flash
attention on). Prints a table and writes JSON.

    .venv/bin/python benchmarks/kv_dtype_speed.py --model FILE.gguf --context 8192 \
        [--batches 1 8] [--kv-dtypes bfloat16 int8 int4] [--steps 32] [--threads 2] \
        [--llama-bin DIR [--llama-kv-dtypes int8]] [--out out/kv_dtype_speed.json]

Each sequence gets its own random prompt of --context tokens (prefix caching off: every
sequence reads its own KV, as separate conversations do); the prompts are prefilled, then
--steps decode steps of the whole batch are timed with the engine's own step loop
(EngineCore.step). TPOT = time of those steps / steps. The prefill of B x context tokens
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
    probe = EngineCore(EngineConfig(model=model, num_threads=threads, kv_cache_memory=0.05,
                                    kv_cache_dtype=kv_dtype))
    per_tok = kv_bytes_per_token(probe.model_config, kv_storage_dtype(kv_dtype, torch.float32))
    loaded, vocab = probe.loaded, probe.model_config.vocab_size
    del probe
    gc.collect()
    # A sequence whose prefill ends early decodes while the others still prefill (one
    # token per step): room for that (`extra`), so that none finishes before the timed
    # steps, where all `batch` sequences decode.
    extra = steps + 64 + batch * 256
    need_gib = batch * (context + extra) * per_tok * 1.1 / 2**30
    eng = EngineCore(EngineConfig(model=model, num_threads=threads, kv_cache_dtype=kv_dtype,
                                  kv_cache_memory=max(0.1, need_gib),
                                  max_model_len=context + extra,
                                  enable_prefix_caching=False), loaded=loaded)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=extra - 8, ignore_eos=True)
    for b in range(batch):
        eng.add_request(f"s{b}", torch.randint(10, vocab - 10, (context,), generator=g)
                        .tolist(), params)
    t0 = time.perf_counter()
    produced: dict[str, int] = {}
    while len(produced) < batch or min(produced.values()) < 1:     # prefills
        for o in eng.step():
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.outputs[0].token_ids)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = []                       # sequences with output in each timed step
    for _ in range(steps):
        rows.append(len(eng.step()))
    tpot = (time.perf_counter() - t0) / steps
    if min(rows) < batch:           # seen at batch 8 (3 of 8), cause not yet found
        print(f"warning: {kv_dtype} batch {batch}: timed steps output {min(rows)}-{max(rows)}"
              f" of {batch} sequences")
    for b in range(batch):
        eng.abort_request(f"s{b}")
    return {"kv_dtype": kv_dtype, "batch": batch, "context": context,
            "tpot_ms": tpot * 1e3, "tok_s": batch / tpot, "prefill_s": prefill_s,
            "rows_min": min(rows), "rows_max": max(rows),
            "kv_bytes_per_token": per_tok}


def bench_llama(bin_dir: str, model: str, kv_dtype: str, batch: int, context: int,
                steps: int, threads: int) -> dict:
    t = LLAMA_KV[kv_dtype]
    cmd = [os.path.join(bin_dir, "llama-batched-bench"), "-m", model, "-c",
           str(batch * (context + steps) + 64), "-npp", str(context), "-ntg", str(steps),
           "-npl", str(batch), "-t", str(threads), "-fa", "on", "-ctk", t, "-ctv", t]
    run = subprocess.run(cmd, capture_output=True, text=True)
    # table rows: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [r for r in (run.stdout + run.stderr).splitlines()
            if re.match(r"\|\s*\d+\s*\|\s*\d+\s*\|\s*\d+\s*\|", r)]
    if run.returncode or not rows:
        return {"kv_dtype": t, "batch": batch, "error": (run.stdout + run.stderr)[-1500:]}
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    tg_s = float(cells[7])
    return {"kv_dtype": t, "batch": batch, "context": context, "tok_s": tg_s,
            "tpot_ms": batch / tg_s * 1e3}


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
                    args.threads)})
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
