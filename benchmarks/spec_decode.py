"""Batch-1 decode speed with speculative decoding (issue 13): off vs n-gram vs draft model.

Each request runs alone (batch 1), greedy, through an in-process EngineCore. Decode speed
is the request's TPOT (time from its first token to its last / (tokens - 1)); figures are
medians over prompts and repeats, after one untimed warm-up request per engine. Engines
alternate per repeat so drift on this shared machine hits every configuration alike.

    python benchmarks/spec_decode.py --workload edit --methods off,ngram
    python benchmarks/spec_decode.py --workload edit-local --methods off,ngram --max-tokens 512
    python benchmarks/spec_decode.py --workload chat --methods off,draft \
        --draft /root/.cache/duetserve-models/qwen2.5-coder-0.5b-instruct.gguf

Prints a table and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_edit_local import EDIT_LOCAL_PROMPTS  # noqa: E402

TARGET = "/root/.cache/duetserve-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = "/root/.cache/duetserve-models/qwen2.5-coder-0.5b-instruct.gguf"

_CODE = [
    '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None
''',
    '''def parse_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
''',
    '''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
]
_EDITS = ["Add type hints to every function signature", "Add a docstring to each function",
          "Rename the variables to longer descriptive names", "Add a comment above each loop"]

# `edit`: edits that rewrite most lines of short snippets. `edit-local`
# (benchmarks/spec_edit_local.py): one local edit of a 40-80 line file, the whole file back.
EDIT_PROMPTS = [[{"role": "user", "content": f"{edit}. Reply with the whole modified code "
                  f"only.\n\n```python\n{code}```"}] for code, edit in zip(_CODE, _EDITS)]

CHAT_PROMPTS = [[{"role": "user", "content": q}] for q in (
    "Explain what a Python generator is and when to use one.",
    "How do I read a CSV file with pandas and compute the mean of one column?",
    "What is the difference between a list and a tuple in Python?",
    "Write a short function that checks whether a string is a palindrome, and explain it.",
)]

WORKLOADS = {"edit": EDIT_PROMPTS, "edit-local": EDIT_LOCAL_PROMPTS, "chat": CHAT_PROMPTS}


def _engine(loaded, spec: dict | None, threads: int) -> LLM:
    cfg = EngineConfig(model=loaded.path, num_threads=threads, kv_cache_memory=0.5,
                       max_num_batched_tokens=2048, enable_prefix_caching=False,
                       speculative_config=spec)
    return LLM.from_engine(EngineCore(cfg, loaded=loaded))


def _spec_of(method: str, args) -> dict | None:
    if method == "off":
        return None
    spec = {"method": "ngram" if method == "ngram" else "draft",
            "num_speculative_tokens": args.k, "adaptive": not args.fixed}
    if method == "draft":
        spec["model"] = args.draft
        if args.draft_quantization:
            spec["quantization"] = args.draft_quantization
    return spec


def _one(llm: LLM, conv, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    spec0 = llm.engine.scheduler.make_stats().spec
    t0 = time.perf_counter()
    out = llm.chat(conv, params)[0]
    wall = time.perf_counter() - t0
    spec1 = llm.engine.scheduler.make_stats().spec
    m = out.metrics
    row = {"tokens": len(out.outputs[0].token_ids), "wall_s": wall, "tpot_ms": m.tpot * 1e3,
           "decode_tok_s": 1.0 / m.tpot, "token_ids": out.outputs[0].token_ids}
    if spec1 is not None:
        drafts = spec1.num_drafts - spec0.num_drafts
        drafted = spec1.num_draft_tokens - spec0.num_draft_tokens
        accepted = spec1.num_accepted_tokens - spec0.num_accepted_tokens
        row.update(num_drafts=drafts, draft_tokens=drafted, accepted_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   mean_accepted_length=1 + accepted / drafts if drafts else 0.0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="edit")
    ap.add_argument("--methods", default="off,ngram")
    ap.add_argument("--draft-quantization", default=None,
                    help="the draft model's quantization (default: the engine's, int4)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--fixed", action="store_true", help="adaptive off (always k drafts)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="spec_decode.json")
    args = ap.parse_args()
    loaded = load_model(args.model, "auto", quantization="auto")
    prompts = WORKLOADS[args.workload][:args.num_prompts]
    methods = args.methods.split(",")
    engines = {m: _engine(loaded, _spec_of(m, args), args.threads) for m in methods}
    for llm in engines.values():                        # warm-up, untimed
        _one(llm, prompts[0], 8)
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for i, conv in enumerate(prompts):
            for m in methods:
                r = _one(engines[m], conv, args.max_tokens)
                r["prompt"] = i
                rows[m].append(r)
    base = statistics.median(r["tpot_ms"] for r in rows[methods[0]])
    summary = {}
    print(f"workload {args.workload}, model {args.model}, k={args.k} "
          f"({'fixed' if args.fixed else 'adaptive'}), {args.threads} threads, batch 1")
    print(f"{'method':8} {'TPOT p50 ms':>12} {'tok/s':>7} {'speedup':>8} {'accept':>7} "
          f"{'mean acc len':>13} {'same tokens':>12}")
    for m in methods:
        tpot = statistics.median(r["tpot_ms"] for r in rows[m])
        drafts = sum(r.get("num_drafts", 0) for r in rows[m])
        drafted = sum(r.get("draft_tokens", 0) for r in rows[m])
        accepted = sum(r.get("accepted_tokens", 0) for r in rows[m])
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows[m], rows[methods[0]]))
        summary[m] = {"tpot_p50_ms": tpot, "decode_tok_s": 1e3 / tpot,
                      "speedup": base / tpot,
                      "acceptance_rate": accepted / drafted if drafted else None,
                      "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                      "identical_outputs": f"{same}/{len(rows[m])}"}
        s = summary[m]
        acc = f"{s['acceptance_rate']:.2f}" if drafted else "-"
        mal = f"{s['mean_accepted_length']:.2f}" if drafts else "-"
        print(f"{m:8} {tpot:12.1f} {1e3 / tpot:7.2f} {base / tpot:7.2f}x {acc:>7} {mal:>13} "
              f"{s['identical_outputs']:>12}")
    for m in methods:
        for r in rows[m]:
            r.pop("token_ids")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
