"""Batch-1 decode and 512-token prefill, duetserve vs llama.cpp (llama-bench) vs
transformers, on the same GGUF file and the same thread count. Prints a table and writes
JSON. Each engine runs alone (one after another), warms up, and reports the median of
`--repeats` runs. With `--rounds N` the whole sequence runs N times, its order reversed
every other round, and each engine's median is over all its runs: this machine's memory
bandwidth drifts by 10-25% over minutes, and engines measured in separate minutes would
compare the drift (the rows keep each round's medians).

    .venv/bin/python benchmarks/cpu_speed.py --model FILE.gguf --threads 2 \
        [--llama-bin DIR] [--quantization auto none] [--transformers] [--rounds 3] \
        [--out out/cpu.json]

duetserve figures come from the engine itself (`LLM.generate`): decode tok/s is
(output tokens - 1) / (time after the first token), prefill tok/s is prompt tokens / TTFT
of a request with max_tokens=1 (so it includes one sampling step). llama-bench reports
pp512 and tg128 the same way (tg without the prompt).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def bench_duet(model: str, quantization: str, threads: int, prompt_len: int, gen_len: int,
               repeats: int, dtype: str) -> dict:
    from duetserve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=model, num_threads=threads, quantization=quantization, dtype=dtype,
              kv_cache_memory=0.5, max_num_batched_tokens=max(2048, prompt_len),
              enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    prompt = [[(7 * i + 13) % (vocab - 300) + 100 for i in range(prompt_len)]]
    short = [[(11 * i + 5) % (vocab - 300) + 100 for i in range(8)]]
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=1, **greedy))
    llm.generate(short, SamplingParams(max_tokens=16, **greedy))
    prefill, decode = [], []
    for _ in range(repeats):      # all prefill runs, then all decode runs (as llama-bench)
        out = llm.generate(prompt,
                           sampling_params=SamplingParams(max_tokens=1, **greedy))[0]
        prefill.append(prompt_len / (out.metrics.first_token_time - out.metrics.arrival_time))
    for _ in range(repeats):
        out = llm.generate(short,
                           sampling_params=SamplingParams(max_tokens=gen_len, **greedy))[0]
        m = out.metrics
        decode.append((gen_len - 1) / (m.finished_time - m.first_token_time))
    loaded = llm.engine.loaded
    return {"engine": f"duetserve ({quantization}, dtype {dtype})", "prefill_tok_s":
            _median(prefill), "decode_tok_s": _median(decode), "load_s": load_s,
            "prefill_runs": prefill, "decode_runs": decode,
            "weights": loaded.describe(), "weight_bytes": loaded.weight_bytes,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def bench_llama(bin_dir: str, model: str, threads: int, prompt_len: int, gen_len: int,
                repeats: int) -> dict:
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", model, "-t", str(threads),
           "-p", str(prompt_len), "-n", str(gen_len), "-r", str(repeats), "-o", "json"]
    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = {"engine": "llama.cpp (llama-bench)", "cmd": " ".join(cmd)}
    for r in res:
        key = "prefill_tok_s" if r.get("n_prompt", 0) else "decode_tok_s"
        out[key] = r["avg_ts"]
        out[key.replace("tok_s", "runs")] = r.get("samples_ts")
    return out


def bench_transformers(model: str, threads: int, prompt_len: int, gen_len: int,
                       repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    folder, name = os.path.split(model)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompt = torch.tensor([[(7 * i + 13) % (vocab - 300) + 100 for i in range(prompt_len)]])
    short = torch.tensor([[(11 * i + 5) % (vocab - 300) + 100 for i in range(8)]])
    prefill, decode = [], []
    with torch.inference_mode():
        hf(prompt)
        for _ in range(repeats):
            t = time.perf_counter()
            hf(prompt)
            prefill.append(prompt_len / (time.perf_counter() - t))
            t = time.perf_counter()
            hf.generate(short, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            first = time.perf_counter() - t
            t = time.perf_counter()
            hf.generate(short, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False)
            decode.append((gen_len - 1) / (time.perf_counter() - t - first))
    return {"engine": "transformers fp32", "prefill_tok_s": _median(prefill),
            "decode_tok_s": _median(decode), "prefill_runs": prefill, "decode_runs": decode}


def _duet_process(args, quantization: str) -> dict:
    """bench_duet in a fresh process (no state or cache shared between configurations)."""
    res = subprocess.run([sys.executable, "-c", (
        "import json,sys;sys.argv=['x'];from benchmarks.cpu_speed import bench_duet;"
        f"print(json.dumps(bench_duet({args.model!r},{quantization!r},{args.threads},"
        f"{args.prompt_len},{args.gen_len},{args.repeats},{args.dtype!r})))")],
        capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
    if res.returncode:
        sys.exit(res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _merge(results: list[dict]) -> dict:
    """One engine's rounds as one row: medians over all rounds' runs, and each round's
    own medians under "rounds" (when there is more than one)."""
    row = dict(results[0])
    if len(results) == 1:
        return row
    for key in ("prefill", "decode"):
        runs = [x for r in results for x in (r.get(f"{key}_runs") or [])]
        if runs:
            row[f"{key}_runs"] = runs
            row[f"{key}_tok_s"] = _median(runs)
    row["rounds"] = [{k: r.get(k) for k in ("prefill_tok_s", "decode_tok_s")}
                     for r in results]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", nargs="*", default=["auto"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-bin", default=None, help="directory with llama-bench")
    ap.add_argument("--transformers", action="store_true")
    ap.add_argument("--engines", nargs="*", default=None,
                    help="run only these: duet llama transformers (default: all asked for)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, alternating the order")
    args = ap.parse_args()
    want = set(args.engines or ["duet", "llama", "transformers"])
    jobs = []                      # (name, function returning a row)
    if "duet" in want:
        for q in args.quantization:
            jobs.append((f"duet-{q}", lambda q=q: _duet_process(args, q)))
    if "llama" in want and args.llama_bin:
        jobs.append(("llama", lambda: bench_llama(args.llama_bin, args.model, args.threads,
                                                  args.prompt_len, args.gen_len,
                                                  args.repeats)))
    if "transformers" in want and args.transformers:
        jobs.append(("transformers", lambda: bench_transformers(
            args.model, args.threads, args.prompt_len, args.gen_len, args.repeats)))
    by_job: dict[str, list[dict]] = {name: [] for name, _ in jobs}
    for r in range(args.rounds):
        for name, run in (jobs if r % 2 == 0 else jobs[::-1]):
            by_job[name].append(run())
    rows = [_merge(results) for results in by_job.values()]
    print(f"model {os.path.basename(args.model)}, {args.threads} threads, prefill "
          f"{args.prompt_len} tokens, decode {args.gen_len} tokens at batch 1 (medians)")
    print(f"{'engine':44} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for r in rows:
        print(f"{r['engine']:44} {r.get('prefill_tok_s', float('nan')):14.1f} "
              f"{r.get('decode_tok_s', float('nan')):13.1f}")
    for r in rows:
        if "rounds" in r:
            print(f"  {r['engine']} by round, prefill / decode: " + ", ".join(
                f"{x['prefill_tok_s']:.1f} / {x['decode_tok_s']:.1f}" for x in r["rounds"]))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
