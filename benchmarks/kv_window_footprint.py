"""KV bytes a long context holds on a model with sliding-window layers, read from the
engine's own KV metrics (blocks in use per attention kind), against full attention's.

    .venv/bin/python benchmarks/kv_window_footprint.py --model $(../shared/models/fetch.sh gemma3-270m) --context 8192

Runs one request of --context prompt tokens (+ a few generated) and records, after every
step, the blocks each kind holds. Reports what the context holds once its prompt is in
(the decode steps: each sliding group keeps the window of the next token) next to what
full attention on every layer would hold for the same tokens, and the bound
    full_layers / layers + sliding_layers / layers * W / context   (plus block rounding);
and the peak while the prompt is prefilled, when a sliding group also holds the chunk
being computed (W + chunk tokens: --max-num-batched-tokens bounds it).
"""
from __future__ import annotations

import argparse
import json
import os

from duetserve import LLM, SamplingParams
from duetserve.worker.kv_cache import kv_block_bytes, kv_bytes_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--generate", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the largest prefill chunk (default: the engine's budget)")
    ap.add_argument("--out", default="out/kv_window_footprint.json")
    args = ap.parse_args()
    llm = LLM(model=args.model, num_threads=args.threads, kv_cache_memory=1.0,
              max_model_len=args.context + args.generate + 16,
              max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.engine
    peak: dict[str, int] = {}
    held: dict[str, int] = {}      # after the prompt: decode-only steps

    def observe(st) -> None:
        seen = held if st.num_prefill_tokens == 0 else peak
        seen.update({k: max(v, seen.get(k, 0)) for k, v in st.used_blocks_by_kind.items()})
    eng.add_step_observer(observe)
    prompt = [(7 * i + 11) % 30000 + 100 for i in range(args.context)]
    llm.generate([prompt], SamplingParams(max_tokens=args.generate, temperature=0,
                                          ignore_eos=True))
    cfg, bs = eng.model_config, eng.config.block_size
    block = kv_block_bytes(cfg, eng.kv_dtype, bs)
    tokens = args.context + args.generate
    used = sum(held.values()) * block
    peak_used = sum(peak.values()) * block
    full = kv_bytes_per_token(cfg, eng.kv_dtype) * tokens
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    n_full, n = kinds.count("full"), len(kinds)
    bound = n_full / n + (n - n_full) / n * (cfg.sliding_window or tokens) / tokens
    res = {"model": os.path.basename(args.model), "tokens": tokens, "block_size": bs,
           "held_blocks_by_kind": held, "block_bytes": block, "kv_bytes": used,
           "full_attention_bytes": full, "ratio": used / full, "bound": bound,
           "prefill_peak_blocks_by_kind": peak, "prefill_peak_ratio": peak_used / full,
           "max_num_batched_tokens": eng.max_num_batched_tokens,
           "groups": len(cfg.kv_groups()), "layers_per_block": cfg.kv_layers_per_block}
    print(f"{tokens} tokens held: {held} blocks x {block} B = {used / 2**20:.1f} MiB; full "
          f"attention {full / 2**20:.1f} MiB; ratio {res['ratio']:.4f} (bound {bound:.4f} "
          f"plus block rounding); while prefilling in chunks of up to "
          f"{eng.max_num_batched_tokens}: peak {peak}, ratio {res['prefill_peak_ratio']:.4f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
