"""Greedy tokens of a real checkpoint against transformers, through the engine as a user
runs it: float32 with dequantized weights (`--quantization none`), each prompt alone,
all prompts batched, force-chunked (a 16-token budget), and prefix-cached (every prompt
served twice: the second run hits the cache). Prompts shorter and longer than a sliding
window where the model has one.

    .venv/bin/python benchmarks/family_equivalence.py --model $(../shared/models/fetch.sh gemma3-270m)

Prints one row per mode (prompts equal / total, first mismatch) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from duetserve import LLM, SamplingParams

TEXT = os.path.join(os.path.dirname(__file__), "..", "docs", "architecture.md")


def prompts(tokenizer, window: int | None) -> list[list[int]]:
    """Token prompts of several lengths: short ones and, for a sliding-window model, ones
    from just under to twice past the window."""
    with open(TEXT, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    lengths = [5, 23, 100, 300]
    if window:
        lengths += [window - 3, window + 1, window + 37, 2 * window + 50]
    return [ids[i * 7:i * 7 + n] for i, n in enumerate(lengths)]


def reference(model_path: str, token_prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(os.path.abspath(model_path))
    kwargs = {"gguf_file": name} if name.endswith(".gguf") else {}
    hf = AutoModelForCausalLM.from_pretrained(folder if kwargs else model_path,
                                              dtype=torch.float32, **kwargs).eval()
    out = []
    with torch.no_grad():
        for p in token_prompts:
            g = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def run_modes(model_path: str, token_prompts: list[list[int]], n: int,
              threads: int) -> dict[str, list[list[int]]]:
    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
    modes = {}
    common = dict(model=model_path, quantization="none", num_threads=threads,
                  kv_cache_memory=0.5)
    llm = LLM(**common, enable_prefix_caching=False)
    modes["alone"] = [llm.generate([p], sp)[0].outputs[0].token_ids
                      for p in token_prompts]
    modes["batched"] = [o.outputs[0].token_ids for o in
                        llm.generate([list(p) for p in token_prompts], sp)]
    del llm
    llm = LLM(**common, max_num_batched_tokens=16, enable_prefix_caching=False)
    modes["chunked_16"] = [o.outputs[0].token_ids for o in
                           llm.generate([list(p) for p in token_prompts], sp)]
    del llm
    llm = LLM(**common, max_num_batched_tokens=64)
    for p in token_prompts:                      # the first pass fills the prefix cache
        llm.generate([p], sp)
    modes["prefix_cached"] = [llm.generate([p], sp)[0]
                              .outputs[0].token_ids for p in token_prompts]
    modes["prefix_hit_tokens"] = [[llm.engine.scheduler.kv_cache_manager.prefix_cache_hits]]
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="out/family_equivalence.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from duetserve.loader import load_model_config
    from duetserve.loader.tokenizer import Tokenizer  # noqa: F401 (the engine's own)
    cfg = load_model_config(args.model)
    llm_tok = LLM(model=args.model, quantization="none", num_threads=args.threads,
                  kv_cache_memory=0.1).tokenizer
    token_prompts = prompts(llm_tok, cfg.sliding_window)
    ref = reference(args.model, token_prompts, args.tokens)
    modes = run_modes(args.model, token_prompts, args.tokens, args.threads)
    rows = {}
    print(f"{'mode':<16} {'equal':>7}  first mismatch (prompt length)")
    for mode, outs in modes.items():
        if mode == "prefix_hit_tokens":
            continue
        equal = [o == r for o, r in zip(outs, ref)]
        bad = [len(p) for p, e in zip(token_prompts, equal) if not e]
        rows[mode] = {"equal": sum(equal), "total": len(equal), "mismatch_lengths": bad}
        print(f"{mode:<16} {sum(equal):>3}/{len(equal):<3}  {bad[0] if bad else '-'}")
    print(f"prefix cache hit tokens in the second pass run: {modes['prefix_hit_tokens'][0][0]}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "prompt_lengths": [len(p) for p in token_prompts],
                   "tokens": args.tokens, "modes": rows, "reference": ref}, f, indent=1)


if __name__ == "__main__":
    main()
