"""Prefill speed with the engine's default step budget against fixed small budgets: does a
long prompt run slower in one step than in the chunks a small budget cuts it into (issue
67: the default must be at least the best of max_num_batched_tokens 64 / 128 / 256)?

For each configuration (the defaults, then each --budgets value as
max_num_batched_tokens) a fresh process builds one `LLM` with --threads threads and
prefix caching off, warms up with one request of each prompt length, then for each
prompt length times --repeats fresh requests (unique prompts, max_tokens=1): prefill
tok/s = prompt tokens / TTFT (arrival to first token, so it includes the one sampling
step), the median reported. With --alternate, every configuration is built in one process
and they take turns prompt by prompt (the order rotated each round), so the machine's drift
falls on all alike; what it cannot remove is the instances' own spread (two engines of the
same configuration in one process differed by 3-10% on a Zen 4, the first built faster):
ratios within that are ties. Prints a table and writes JSON: every run, and per
configuration the start-up's kernel decision (the weights line of the log), its few-row
limit and its step budget.

    .venv/bin/python benchmarks/prefill_paths.py \\
        --model ~/.cache/duetserve-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --threads 2 --repeats 3 --out out/prefill_paths.json

Run it alone on the machine: another process's load spoils every timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT_PROMPT_LENS = (64, 512, 2048)
DEFAULT_BUDGETS = (64, 128, 256)


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    """A prompt no other run shares a block with (the seed changes every token)."""
    return [(7919 * (i + 1) + 104729 * seed) % (vocab - 300) + 100 for i in range(length)]


def _build(model: str, threads: int, budget: int | None, prompt_lens: list[int],
           quantization: str, dtype: str, amx: bool = True):
    """(LLM, load seconds) of one configuration, warmed up with one request of each
    prompt length."""
    from duetserve import LLM
    t0 = time.perf_counter()
    llm = LLM(model=model, num_threads=threads, quantization=quantization, dtype=dtype,
              kv_cache_memory=0.5, max_model_len=max(prompt_lens) + 16,
              max_num_batched_tokens=budget, enable_prefix_caching=False, amx=amx)
    load_s = time.perf_counter() - t0
    for i, n in enumerate(prompt_lens):
        _tok_s(llm, n, 10_000 * (budget or 1) + i)
    return llm, load_s


def _tok_s(llm, n: int, seed: int) -> float:
    """Prefill tok/s of one fresh n-token prompt: n / TTFT."""
    from duetserve import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    out = llm.generate([_prompt(n, seed, vocab)], params)[0]
    return n / (out.metrics.first_token_time - out.metrics.arrival_time)


def _row(llm, budget: int | None, amx: bool, load_s: float, runs: dict) -> dict:
    from duetserve.config import describe_row_limit
    from duetserve.models.kernels import few_row_limit
    engine = llm.engine
    step_budget = getattr(engine, "step_budget", None)
    return {"budget": budget, "amx": amx, "load_s": load_s, "kernels": engine.loaded.describe(),
            "few_row_limit": describe_row_limit(few_row_limit(engine.loaded.model)),
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "step_budget": step_budget.describe() if step_budget is not None else None,
            "runs": runs, "tok_s": {k: statistics.median(v) for k, v in runs.items()}}


def bench_config(model: str, threads: int, budget: int | None, prompt_lens: list[int],
                 repeats: int, quantization: str, dtype: str, amx: bool = True) -> dict:
    """One configuration in this process: {"budget", "load_s", "kernels", "few_row_limit",
    "max_num_batched_tokens", "step_budget", "runs": {len: [tok/s]}, "tok_s": {len:
    median}}."""
    llm, load_s = _build(model, threads, budget, prompt_lens, quantization, dtype, amx)
    runs = {str(n): [_tok_s(llm, n, 100 * n + r) for r in range(repeats)]
            for n in prompt_lens}
    return _row(llm, budget, amx, load_s, runs)


def bench_alternated(model: str, threads: int, budgets: list[int | None],
                     prompt_lens: list[int], repeats: int, quantization: str, dtype: str
                     ) -> list[dict]:
    """Every configuration built side by side in this process, then `repeats` rounds in
    which each prompt length runs once on each configuration, the order rotated every
    round: a drift in the machine's speed (10-20% within an hour on these VMs) falls on
    all of them alike instead of on whichever ran last. Rows as bench_config's."""
    built = [_build(model, threads, b, prompt_lens, quantization, dtype) for b in budgets]
    runs = [{str(n): [] for n in prompt_lens} for _ in budgets]
    for r in range(repeats):
        for n in prompt_lens:
            for k in range(len(budgets)):
                i = (k + r) % len(budgets)
                runs[i][str(n)].append(_tok_s(built[i][0], n, 100 * n + 10 * r + i))
    return [_row(llm, b, True, load_s, run)
            for (llm, load_s), b, run in zip(built, budgets, runs)]


def _no_amx_env() -> dict:
    """The environment of a CPU without AMX on this one: oneDNN capped below AMX (its own
    ONEDNN_MAX_CPU_ISA switch), and a kernel-measurement cache of its own (the cached
    crossovers were measured with oneDNN's AMX) sharing the built native kernels."""
    from duetserve.config import cache_dir
    own = os.path.join(cache_dir(), "no-amx")
    os.makedirs(own, exist_ok=True)
    ext = os.path.join(own, "ext")
    if not os.path.exists(ext):
        os.symlink(os.path.join(cache_dir(), "ext"), ext)
    return {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DUET_CACHE_DIR": own}


def _in_fresh_process(args, budget: int | None, amx: bool = True) -> dict:
    """bench_config in a new interpreter (no weights, caches or allocator state shared
    between configurations); without `amx`, as on a CPU without AMX (_no_amx_env)."""
    call = (f"bench_config({args.model!r}, {args.threads}, {budget!r}, "
            f"{list(args.prompt_lens)!r}, {args.repeats}, {args.quantization!r}, "
            f"{args.dtype!r}, {amx!r})")
    res = subprocess.run([sys.executable, "-c", (
        "import json,sys;sys.argv=['x'];from benchmarks.prefill_paths import bench_config;"
        f"print(json.dumps({call}))")], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=None if amx else _no_amx_env())
    if res.returncode:
        sys.exit(res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _name(budget: int | None, amx: bool = True) -> str:
    name = "default" if budget is None else f"max_num_batched_tokens={budget}"
    return name if amx else f"{name}, no AMX"


def report(rows: list[dict], prompt_lens: list[int], alternated: bool = False) -> dict:
    """Print the table; return per prompt length the default's tok/s over the best fixed
    budget's (>= 1: the default is not slower than its chunks); `alternated` (the runs
    took turns, round by round): also the ratios of each round's pair and their median
    ("<len>_paired"), which a drift between rounds does not move."""
    print(f"{'configuration':30} " + " ".join(f"{f'{n} tok/s':>12}" for n in prompt_lens))
    for r in rows:
        print(f"{_name(r['budget'], r.get('amx', True)):30} "
              + " ".join(f"{r['tok_s'][str(n)]:12.1f}" for n in prompt_lens))
    ratios = {}
    default = next((r for r in rows if r["budget"] is None and r.get("amx", True)), None)
    fixed = [r for r in rows if r["budget"] is not None]
    if default is not None and fixed:
        for n in prompt_lens:
            best = max(fixed, key=lambda r: r["tok_s"][str(n)])
            ratios[str(n)] = default["tok_s"][str(n)] / best["tok_s"][str(n)]
            line = (f"{n} tokens: default / best fixed ({_name(best['budget'])}) = "
                    f"{ratios[str(n)]:.2f}")
            if alternated:
                pairs = [a / b for a, b in zip(default["runs"][str(n)], best["runs"][str(n)])]
                ratios[f"{n}_paired"] = statistics.median(pairs)
                line += (f"; round by round {', '.join(f'{x:.2f}' for x in pairs)} "
                         f"(median {ratios[f'{n}_paired']:.2f})")
            print(line)
    no_amx = next((r for r in rows if r["budget"] is None and not r.get("amx", True)), None)
    if default is not None and no_amx is not None:
        for n in prompt_lens:
            ratios[f"{n}_over_no_amx"] = default["tok_s"][str(n)] / no_amx["tok_s"][str(n)]
            print(f"{n} tokens: default / default without AMX = "
                  f"{ratios[f'{n}_over_no_amx']:.2f}")
    for r in rows:
        print(f"{_name(r['budget'], r.get('amx', True))}: few-row limit {r['few_row_limit']}, step budget "
              f"{r['max_num_batched_tokens']} tokens")
    for r in rows:
        if r["budget"] is None:
            print(f"kernels ({_name(None, r.get('amx', True))}): {r['kernels']}")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=list(DEFAULT_PROMPT_LENS))
    ap.add_argument("--budgets", type=int, nargs="*", default=list(DEFAULT_BUDGETS),
                    help="fixed max_num_batched_tokens to compare with the default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-amx-row", action="store_true",
                    help="add the defaults as on a CPU without AMX (--no-amx, oneDNN capped "
                         "at AVX512_CORE_BF16) and report the default over it")
    ap.add_argument("--alternate", action="store_true",
                    help="build every configuration in one process and alternate them "
                         "prompt by prompt (drift falls on all alike) instead of one "
                         "fresh process each")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.model = os.path.expanduser(args.model)
    if args.alternate:
        rows = bench_alternated(args.model, args.threads, [None, *args.budgets],
                                args.prompt_lens, args.repeats, args.quantization, args.dtype)
    else:
        rows = [_in_fresh_process(args, b) for b in [None, *args.budgets]]
    if args.no_amx_row:
        rows.append(_in_fresh_process(args, None, amx=False))
    print(f"model {os.path.basename(args.model)}, {args.threads} threads, prefill tok/s "
          f"(prompt tokens / TTFT, median of {args.repeats} fresh prompts)")
    ratios = report(rows, args.prompt_lens, args.alternate)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "threads": args.threads,
                       "prompt_lens": args.prompt_lens, "repeats": args.repeats,
                       "alternated": args.alternate, "rows": rows,
                       "default_over_best_fixed": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
