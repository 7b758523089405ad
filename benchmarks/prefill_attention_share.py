"""How much of a long prompt's prefill goes to attention: the engine with its defaults
prefills prompts of the given lengths (max_tokens 1, no shared prefix) and the wall time
of the attention backend's calls (the KV write included) is summed against the TTFT.
Prints a table and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_attention_share.py --model M \\
        [--prompt-lens 2048 8192] [--repeats 2] [--threads 2] \\
        [--prefill-attention auto|float32|bfloat16] [--out out/prefill_attention_share.json]

Attention MACs are counted as a causal prompt's (2 x T^2 / 2 x heads x head_dim x layers),
so GMAC/s compares the kernels' rate across lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.prefill_paths import _prompt
from benchmarks.profile_step import Timers
from duetserve import LLM, SamplingParams
from duetserve.models import attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-attention", default="auto",
                    help="EngineConfig.prefill_attention (auto, float32, bfloat16)")
    ap.add_argument("--out", default="out/prefill_attention_share.json")
    args = ap.parse_args()
    # the decoder layers call the backend through forward_qkv only (forward is inside it)
    timers = Timers()
    timers.wrap(attention.TorchAttention, "forward_qkv", "attention")
    llm = LLM(model=args.model, num_threads=args.threads, max_model_len=max(args.prompt_lens) + 16,
              prefill_attention=args.prefill_attention)
    cfg = llm.engine.model_config
    vocab = cfg.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([_prompt(64, 1, vocab)], params)                      # warm-up
    rows = []
    for n in args.prompt_lens:
        for r in range(args.repeats):
            timers.t["attention"] = 0.0
            out = llm.generate([_prompt(n, 1000 * n + r, vocab)], params)[0]
            ttft = out.metrics.first_token_time - out.metrics.arrival_time
            rows.append({"tokens": n, "ttft_s": ttft, "tok_s": n / ttft,
                         "attention_s": timers.t["attention"],
                         "share": timers.t["attention"] / ttft})
    per_t2 = cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    macs = {n: n * n * per_t2 for n in args.prompt_lens}         # 2 products x T^2 / 2
    print(f"{'tokens':>7} {'TTFT s':>8} {'tok/s':>7} {'attention s':>12} {'share':>6} {'attn GMAC/s':>12}")
    for row in rows:
        rate = macs[row["tokens"]] / row["attention_s"] / 1e9
        row["attention_gmac_s"] = rate
        print(f"{row['tokens']:7d} {row['ttft_s']:8.2f} {row['tok_s']:7.1f} "
              f"{row['attention_s']:12.2f} {row['share']:6.3f} {rate:12.1f}")
    summary = {str(n): statistics.median(r["share"] for r in rows if r["tokens"] == n)
               for n in args.prompt_lens}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "threads": args.threads, "rows": rows,
                   "median_share": summary}, f, indent=1)


if __name__ == "__main__":
    main()
