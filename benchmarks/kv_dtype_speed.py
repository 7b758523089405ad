"""Decode TPOT by KV cache dtype at a long context (issue 64): batch 1 and batch B with
`--kv-cache-dtype bfloat16 / int8 / int4` on one GGUF file, optionally next to llama.cpp
with the same bits of KV (`llama-batched-bench -ctk/-ctv q8_0 | q4_0 | f16`, flash
attention on). Prints a table and writes JSON.

    .venv/bin/python benchmarks/kv_dtype_speed.py --model FILE.gguf --context 8192 \
        [--batches 1 8] [--kv-dtypes bfloat16 int8 int4] [--steps 32] [--threads 2] \
        [--llama-bin DIR [--llama-kv-dtypes int8] [--llama-shared-prompt]] \
        [--context-fill prefill|random] [--rounds 1] [--out out/kv_dtype_speed.json]

Each sequence gets its own random prompt of --context tokens (no two share a block: every
sequence reads its own KV, as separate conversations do); the prompts are prefilled as
one-token requests, then sent again (their blocks found in the prefix cache) so that all
decode from the same context, and --steps decode steps of the whole batch are timed with
the engine's own step loop (EngineCore.step). TPOT = time of those steps / steps. The prefill of B x context tokens
is the slow part (~15 min at 8 x 8,192 on 2 cores); it is not timed.

`--context-fill random` skips that prefill's compute: the prompt steps return zero hidden
states, and the KV cache is then filled with random values stored in the cache's dtype
(int8 / int4 through the engine's own quantizer). The timed decode steps are the engine's
real ones over a context of the same length, block layout and dtype; only the values
differ, and the decode kernels' work does not depend on them (at 8 x 2,048 a real cache
and the same cache overwritten with random values decoded in 73 and 79 ms). It takes
seconds where the prefill takes minutes.

All --kv-dtypes' engines are prepared before any step is timed, and `--rounds R` alternates
R timed runs of --steps steps between them: the VM's drift (10-25% an hour here) then lands
on both sides of each ratio alike, and each ratio is against the bfloat16 run of its round.
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


class _ZeroPrefill(torch.nn.Module):
    """The model with prompt steps skipped (--context-fill random): a step with prefills
    returns zero hidden states and writes no KV; decode steps run the model."""

    def __init__(self, model: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.model, self.hidden = model, hidden

    def forward(self, ids, positions, kv_caches, meta, lora):
        if meta.prefills:
            return torch.zeros(ids.shape[0], self.hidden)
        return self.model(ids, positions, kv_caches, meta, lora)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def _fill_random(kv_caches, head_dim: int, seed: int = 0) -> None:
    """Every layer's K and V cache overwritten with N(0, 1) values as the cache stores
    them (quantized rows through models/kv_quant.quantize)."""
    from duetserve.models.kv_quant import quantize
    g = torch.Generator().manual_seed(seed)
    for pair in kv_caches:
        for c in pair:
            if c.dtype in (torch.int8, torch.uint8):
                c.copy_(quantize(torch.randn(*c.shape[:-1], head_dim, generator=g), c.dtype))
            else:
                c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))


class DuetRun:
    """One engine with `batch` sequences of `context` tokens each, resumed and decoding;
    `time(steps)` times `steps` of its decode steps. Several runs share the loaded weights
    and wait side by side, so that their timed steps can alternate."""

    def __init__(self, model: str, kv_dtype: str, batch: int, context: int, steps: int,
                 threads: int, fill: str = "prefill", loaded=None) -> None:
        from duetserve.config import EngineConfig
        from duetserve.engine.engine_core import EngineCore
        from duetserve.sampling_params import SamplingParams
        from duetserve.worker.kv_cache import kv_bytes_per_token, kv_storage_dtype
        probe_gib = 0.25
        probe = EngineCore(EngineConfig(model=model, num_threads=threads,
                                        kv_cache_memory=probe_gib, kv_cache_dtype=kv_dtype),
                           loaded=loaded)
        self.per_tok = kv_bytes_per_token(probe.model_config,
                                          kv_storage_dtype(kv_dtype, torch.float32))
        tokens_per_gib = probe.kv_capacity_tokens / probe_gib    # as the engine lays it out
        self.loaded, vocab = probe.loaded, probe.model_config.vocab_size
        del probe
        gc.collect()
        # The prompts are prefilled first as requests of one token each, their blocks left
        # in the prefix cache, then sent again to decode: every sequence starts decoding at
        # the same context. (Sent once, a sequence whose prefill ended early decoded while
        # the others prefilled, and at 8 x 8,192 seven of eight had reached max_tokens and
        # ended before the timed steps, which then decoded one sequence.) The prompts are
        # random and unique: no two sequences share a block, each reads its own KV.
        tail = steps + 64
        need_tokens = batch * (context + tail)
        eng = EngineCore(EngineConfig(model=model, num_threads=threads, kv_cache_dtype=kv_dtype,
                                      kv_cache_memory=max(0.1, 1.1 * need_tokens / tokens_per_gib),
                                      max_model_len=context + tail,
                                      enable_prefix_caching=True), loaded=self.loaded)
        assert eng.kv_capacity_tokens >= need_tokens, (eng.kv_capacity_tokens, need_tokens)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, vocab - 10, (context,), generator=g).tolist()
                   for _ in range(batch)]
        t0 = time.perf_counter()
        real = eng.runner.model
        if fill == "random":
            eng.runner.model = _ZeroPrefill(real, eng.model_config.hidden_size)
        for b, prompt in enumerate(prompts):
            eng.add_request(f"p{b}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
        if fill == "random":
            eng.runner.model = real
            _fill_random(eng.runner.kv_caches, eng.model_config.head_dim)
        self.prefill_s = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=tail - 8, ignore_eos=True)
        t0 = time.perf_counter()
        for b, prompt in enumerate(prompts):
            eng.add_request(f"s{b}", prompt, params)
        produced: set[str] = set()
        while len(produced) < batch:      # the prompts' uncached tails, then a token each
            produced.update(o.request_id for o in eng.step() if o.outputs[0].token_ids)
        self.resume_s = time.perf_counter() - t0
        self.eng, self.kv_dtype, self.batch, self.context, self.fill = \
            eng, kv_dtype, batch, context, fill

    def time(self, steps: int) -> dict:
        eng, batch = self.eng, self.batch
        preempted = eng.scheduler.num_preemptions
        t0 = time.perf_counter()
        rows = []                       # sequences with output in each timed step
        for _ in range(steps):
            rows.append(len(eng.step()))
        tpot = (time.perf_counter() - t0) / steps
        if min(rows) < batch:
            print(f"warning: {self.kv_dtype} batch {batch}: timed steps output "
                  f"{min(rows)}-{max(rows)} of {batch} sequences "
                  f"({eng.scheduler.num_preemptions} preemptions)")
        return {"kv_dtype": self.kv_dtype, "batch": batch, "context": self.context,
                "tpot_ms": tpot * 1e3, "tok_s": batch / tpot, "prefill_s": self.prefill_s,
                "resume_s": self.resume_s, "context_fill": self.fill,
                "rows_min": min(rows), "rows_max": max(rows),
                "preemptions_timed": eng.scheduler.num_preemptions - preempted,
                "kv_capacity_tokens": eng.kv_capacity_tokens,
                "kv_bytes_per_token": self.per_tok}

    def close(self) -> None:
        for b in range(self.batch):
            self.eng.abort_request(f"s{b}")
        del self.eng
        gc.collect()


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
    ap.add_argument("--context-fill", choices=["prefill", "random"], default="prefill",
                    help="how the context gets into the cache: the model's prefill, or "
                         "random values without the prefill's compute (see above)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time --steps this many times per dtype, alternated between the "
                         "dtypes' engines, which are all prepared first (ours only)")
    ap.add_argument("--out", default="out/kv_dtype_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for b in args.batches:
        # every dtype's engine is prepared first, then their timed steps alternate
        # (--rounds): the VM's drift lands on all sides of a ratio alike
        runs, loaded = [], None
        for d in args.kv_dtypes:
            runs.append(DuetRun(args.model, d, b, args.context, args.steps * args.rounds,
                                args.threads, args.context_fill, loaded))
            loaded = runs[-1].loaded
        for rnd in range(args.rounds):
            for run in runs:
                rows.append({"engine": "duetserve", **run.time(args.steps), "round": rnd})
                print(f"duetserve {run.kv_dtype} batch {b} round {rnd}: "
                      f"{rows[-1]['tpot_ms']:.1f} ms", flush=True)
        for run in runs:
            run.close()
        del runs
        gc.collect()
        for d in args.kv_dtypes:
            if args.llama_bin and d in (args.llama_kv_dtypes or args.kv_dtypes):
                rows.append({"engine": "llama.cpp", **bench_llama(
                    args.llama_bin, args.model, d, b, args.context, args.steps,
                    args.threads, args.llama_shared_prompt and b > 1), "round": 0})
    # each ratio against the bfloat16 row of its own round (alternated: minutes apart)
    base = {(r["engine"], r["batch"], r["round"]): r for r in rows
            if r["kv_dtype"] in ("bfloat16", "f16")}
    print(f"{'engine':<10} {'KV':<9} {'batch':>5} {'round':>5} {'TPOT ms':>9} {'tok/s':>8} "
          f"{'vs bf16':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<10} {r['kv_dtype']:<9} {r['batch']:>5} {r['round']:>5}  failed")
            continue
        ref = base.get((r["engine"], r["batch"], r["round"]))
        ratio = r["tpot_ms"] / ref["tpot_ms"] if ref and "tpot_ms" in ref else float("nan")
        print(f"{r['engine']:<10} {r['kv_dtype']:<9} {r['batch']:>5} {r['round']:>5} "
              f"{r['tpot_ms']:>9.2f} "
              f"{r['tok_s']:>8.2f} {ratio:>8.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "context": args.context, "threads": args.threads,
                   "context_fill": args.context_fill,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
