"""Baseline for `duet bench throughput`: the same requests through transformers `generate()`
with static batches.

    python benchmarks/hf_static_batch.py --num-prompts 256 --batch-sizes 1,8,32 \
        --max-prompts-for-bs1 16 --duet-json out/bench_duet.json --output-json out/bench_hf.json

Workload: built by duetserve.bench.throughput.build_requests with the checkpoint's own
duetserve tokenizer, so the flags --num-prompts/--input-len/--output-len/--seed/
--prefix-len/--dataset-path give exactly the prompts `duet bench throughput` runs (the
JSON carries a digest of them; a mismatch with --duet-json is reported).

Static batching: requests in their given order, `batch_size` at a time; prompts padded on
the left with pad = EOS and an attention mask; greedy; min_new_tokens = max_new_tokens =
the batch's largest requested output length, so every row generates that many tokens.
Only each request's own requested output tokens count as useful output
(`num_output_tokens`); `num_generated_tokens` counts every row's tokens (padding work).
The best batch size is the one with the highest useful output tokens/s.

A batch size smaller than --num-prompts may be timed on the first --max-prompts-for-bs1
requests only (batch size 1 is slow); its elapsed time over all requests is then
extrapolated with a least-squares fit time = a * input_tokens + b * output_tokens per
request (falling back to scaling by the number of requests), and marked "extrapolated".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from duetserve.bench.throughput import (BenchRequest, add_workload_arguments, build_requests,
                                        format_table, load_tokenizer, requests_digest)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: the duetserve default GGUF)")
    p.add_argument("--seed", type=int, default=0)
    add_workload_arguments(p)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-prompts-for-bs1", type=int, default=16,
                   help="time batch size 1 on this many requests and extrapolate (0: all)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default 2)")
    p.add_argument("--duet-json", default=None, help="result of duet bench throughput")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def load_hf_model(model: str | None) -> Any:
    from transformers import AutoModelForCausalLM

    from duetserve.loader import resolve_model_path
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    folder, name = os.path.split(os.path.abspath(path))
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()


def run_batch(model: Any, batch: list[BenchRequest], pad_id: int) -> int:
    """Generate the batch; returns the number of tokens generated (all rows)."""
    width = max(len(r.prompt_token_ids) for r in batch)
    n_new = max(r.output_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):   # left padding
        n = len(r.prompt_token_ids)
        ids[i, width - n:] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n:] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=n_new, min_new_tokens=n_new,
                             pad_token_id=pad_id)
    return int((out.shape[1] - width) * len(batch))


def _extrapolate(timed: list[BenchRequest], batch_seconds: list[float], bs: int,
                 reqs: list[BenchRequest]) -> tuple[float, str]:
    """Elapsed time over all `reqs`, from batches of `timed` (batch i took batch_seconds[i])."""
    if bs == 1 and len(timed) >= 3:
        a = np.array([[len(r.prompt_token_ids), r.output_len] for r in timed], dtype=float)
        coef, *_ = np.linalg.lstsq(a, np.array(batch_seconds), rcond=None)
        if (coef >= 0).all():
            total = float(sum(coef[0] * len(r.prompt_token_ids) + coef[1] * r.output_len
                              for r in reqs))
            return total, (f"least squares t = {coef[0]:.3g} s * input + {coef[1]:.3g} s * "
                           f"output per request, fit on {len(timed)} requests")
    total = sum(batch_seconds) * len(reqs) / len(timed)
    return total, f"scaled by requests ({len(timed)} timed of {len(reqs)})"


def bench_batch_size(model: Any, reqs: list[BenchRequest], bs: int, pad_id: int,
                     max_subset: int) -> dict[str, Any]:
    timed = reqs if (bs > 1 or max_subset <= 0) else reqs[:max_subset]
    batch_seconds, generated = [], 0
    for i in range(0, len(timed), bs):
        t0 = time.perf_counter()
        generated += run_batch(model, timed[i:i + bs], pad_id)
        batch_seconds.append(time.perf_counter() - t0)
        print(f"  bs={bs} batch {i // bs + 1}/{-(-len(timed) // bs)}: "
              f"{batch_seconds[-1]:.1f} s", file=sys.stderr, flush=True)
    elapsed, note = sum(batch_seconds), "measured on all requests"
    if len(timed) < len(reqs):
        elapsed, note = _extrapolate(timed, batch_seconds, bs, reqs)
        generated = int(generated * len(reqs) / len(timed))
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    num_out = sum(r.output_len for r in reqs)
    return {
        "batch_size": bs, "num_requests": len(reqs), "num_timed_requests": len(timed),
        "extrapolated": len(timed) < len(reqs), "timing_note": note,
        "elapsed_s": elapsed, "requests_per_s": len(reqs) / elapsed,
        "num_input_tokens": num_in, "num_output_tokens": num_out,
        "num_generated_tokens": generated,
        "input_tokens_per_s": num_in / elapsed, "output_tokens_per_s": num_out / elapsed,
        "generated_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads or 2)
    torch.manual_seed(args.seed)
    tokenizer, cfg = load_tokenizer(args.model)
    reqs = build_requests(args, tokenizer, cfg.vocab_size)
    digest = requests_digest(reqs)
    model = load_hf_model(args.model)
    pad_id = (cfg.eos_token_ids or tokenizer.eos_token_ids)[0]
    # warm-up, untimed
    run_batch(model, [BenchRequest(r.prompt_token_ids[:16], 4) for r in reqs[:2]], pad_id)
    results = []
    for bs in [int(x) for x in args.batch_sizes.split(",") if x.strip()]:
        r = bench_batch_size(model, reqs, bs, pad_id, args.max_prompts_for_bs1)
        results.append(r)
        print(format_table(r, f"transformers generate, static batch {bs}"
                              + (" (EXTRAPOLATED: " + r["timing_note"] + ")"
                                 if r["extrapolated"] else "")))
    best = max(results, key=lambda r: r["output_tokens_per_s"])
    doc: dict[str, Any] = {
        "backend": "transformers", "model": args.model or "default GGUF",
        "num_threads": torch.get_num_threads(), "requests_digest": digest,
        "output_counting": ("num_output_tokens = sum of each request's requested output "
                            "length; rows generate the batch max (min_new_tokens = "
                            "max_new_tokens), extra tokens are in num_generated_tokens"),
        "workload": {"num_prompts": len(reqs), "input_len": args.input_len,
                     "output_len": args.output_len, "prefix_len": args.prefix_len,
                     "seed": args.seed, "dataset_path": args.dataset_path},
        "batch_sizes": results, "best": best}
    print(f"best: batch size {best['batch_size']} "
          f"({best['output_tokens_per_s']:.1f} output tokens/s)")
    if args.duet_json:
        with open(args.duet_json, encoding="utf-8") as f:
            duet = json.load(f)
        same = duet.get("workload", {}).get("requests_digest") == digest
        ratios = {k: duet[k] / best[k] for k in
                  ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
                   "total_tokens_per_s")}
        doc["duet"] = {"path": args.duet_json, "same_requests": same, "ratio": ratios}
        print(f"duetserve / transformers (best static batch {best['batch_size']}):"
              + ("" if same else "  WARNING: the duet run used different requests"))
        for k, v in ratios.items():
            print(f"  {k:<22} {duet[k]:10.2f} / {best[k]:10.2f} = {v:.2f}x")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
