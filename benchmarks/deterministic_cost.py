"""What `--deterministic` costs a lone request: prefill tok/s of one 512- and one
2,048-token prompt (max_tokens=1, median of 3 after a warm-up) and batch-1 decode tok/s
(128 tokens after a 64-token prompt, end to end), default and deterministic engines
alternated `--rounds` times in one process. Prints a table and writes JSON.

    .venv/bin/python benchmarks/deterministic_cost.py [--model FILE] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from duetserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="out/deterministic_cost.json")
    args = ap.parse_args()
    res: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for det in (False, True):
            llm = LLM(args.model, deterministic=det, num_threads=args.threads,
                      enable_prefix_caching=False)
            vocab = llm.engine.model_config.vocab_size
            row = res.setdefault("deterministic" if det else "default", {})
            for n in (512, 2048):
                ids = [[(7919 * j + 11 * r) % (vocab - 200) + 100 for j in range(n)]
                       for r in range(4)]
                one = SamplingParams(max_tokens=1, temperature=0)
                llm.generate([ids[3]], one)                           # warm-up
                ts = []
                for r in range(3):
                    t = time.perf_counter()
                    llm.generate([ids[r]], one)
                    ts.append(time.perf_counter() - t)
                row.setdefault(f"prefill_{n}_tok_s", []).append(round(n / statistics.median(ts), 1))
            t = time.perf_counter()
            llm.generate([ids[0][:64]], SamplingParams(max_tokens=129, temperature=0,
                                                       ignore_eos=True))
            row.setdefault("decode_tok_s", []).append(round(129 / (time.perf_counter() - t), 1))
            del llm
    print(f"{'':24s}" + "".join(f"{k:>26s}" for k in res["default"]))
    for mode, row in res.items():
        print(f"{mode:24s}" + "".join(f"{', '.join(map(str, v)):>26s}" for v in row.values()))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
