"""How close low-bit weights stay to the float32 path: top-1 agreement and mean KL
divergence KL(p_float32 || p_lowbit) of next-token distributions, teacher-forced on the
float32 model's own greedy continuation (16 prompts x 64 positions by default).

Both kernels are measured, as the engine runs them: "decode" feeds the sequence one token
per step (the low-bit GEMV kernels), "prefill" runs it in one pass (the dense GEMM path).

    .venv/bin/python benchmarks/quant_accuracy.py [--model FILE.gguf] [--quantization auto]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from duetserve.loader import load_model
from duetserve.worker.batch import SeqWork, build_step_batch
from duetserve.worker.kv_cache import allocate_kv_cache

PROMPTS = [
    "The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The capital of France is", "To make a cup of tea, first", "import numpy as np\n",
    "The theory of relativity states that", "In 1969, the first humans",
    "Here is a list of fruits:", "The best way to learn a language is",
    "SELECT name FROM users WHERE", "Photosynthesis is the process by which",
    "My favourite book is", "The quick brown fox", "Water boils at",
    "A neural network is",
]


class Runner:
    def __init__(self, loaded, max_tokens: int) -> None:
        self.loaded, self.bs = loaded, 16
        blocks = len(PROMPTS) * ((max_tokens + 15) // 16) + 8
        self.kv = allocate_kv_cache(loaded.config, blocks, self.bs, loaded.dtype, "cpu")
        self.next = 0
        attn = loaded.model.layers[0].self_attn.backend
        self.paged = attn.paged_decode is not None

    def blocks(self, n: int) -> list[int]:
        k = (n + self.bs - 1) // self.bs
        self.next += k
        return list(range(self.next - k, self.next))

    @torch.inference_mode()
    @torch.inference_mode()
    def greedy(self, tokens: list[int], n: int) -> list[int]:
        """tokens + n greedy tokens (one decode step each)."""
        model, blocks, out = self.loaded.model, self.blocks(len(tokens) + n), list(tokens)
        b = build_step_batch([SeqWork("g", out, 0, blocks, True)], self.bs)
        logits = model.compute_logits(model(b.input_ids, b.positions, self.kv, b.meta)[-1:])
        for _ in range(n):
            out.append(int(logits[-1].argmax()))
            b = build_step_batch([SeqWork("g", [out[-1]], len(out) - 1, blocks, True)],
                                 self.bs, paged_decode=self.paged)
            logits = model.compute_logits(model(b.input_ids, b.positions, self.kv, b.meta))
        return out

    @torch.inference_mode()
    def logits(self, tokens: list[int], one_at_a_time: bool, start: int) -> torch.Tensor:
        """Next-token logits at positions start-1 .. len-2 (predicting tokens[start:])."""
        model, blocks = self.loaded.model, self.blocks(len(tokens))
        if not one_at_a_time:
            b = build_step_batch([SeqWork("x", tokens, 0, blocks, True)], self.bs)
            hidden = model(b.input_ids, b.positions, self.kv, b.meta)
            return model.compute_logits(hidden[start - 1:len(tokens) - 1])
        b = build_step_batch([SeqWork("x", tokens[:start], 0, blocks, True)], self.bs)
        hidden = model(b.input_ids, b.positions, self.kv, b.meta)
        rows = [model.compute_logits(hidden[-1:])]
        for pos in range(start, len(tokens) - 1):
            b = build_step_batch([SeqWork("x", [tokens[pos]], pos, blocks, True)], self.bs,
                                 paged_decode=self.paged)
            rows.append(model.compute_logits(model(b.input_ids, b.positions, self.kv, b.meta)))
        return torch.cat(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref = load_model(args.model, "float32", quantization="none")
    low = load_model(args.model, "auto", quantization=args.quantization)
    tok = ref.tokenizer
    seqs = []
    r = Runner(ref, 128 + args.positions)
    for p in PROMPTS:           # the float32 model's greedy continuation, as the text
        ids = tok.encode(p)
        seqs.append((r.greedy(ids, args.positions), len(ids)))
    result = {"model": ref.path, "quantization": args.quantization,
              "weights": low.describe(), "positions": args.positions * len(PROMPTS)}
    for mode in ("decode", "prefill"):
        rr, rl = Runner(ref, 128 + args.positions), Runner(low, 128 + args.positions)
        agree, kls = 0, []
        for ids, start in seqs:
            a = rr.logits(ids, mode == "decode", start).float().log_softmax(-1)
            b = rl.logits(ids, mode == "decode", start).float().log_softmax(-1)
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            kls.append((a.exp() * (a - b)).sum(-1))
        kl = torch.cat(kls)
        result[mode] = {"top1_agreement": agree / kl.numel(), "mean_kl": float(kl.mean()),
                        "p99_kl": float(kl.quantile(0.99))}
    print(f"{os.path.basename(ref.path)}: {low.describe()}")
    print(f"{'path':8} {'top-1 agreement':>16} {'mean KL':>10} {'p99 KL':>10}  "
          f"({result['positions']} positions, teacher-forced, vs float32)")
    for mode in ("decode", "prefill"):
        m = result[mode]
        print(f"{mode:8} {m['top1_agreement']:16.2%} {m['mean_kl']:10.4f} {m['p99_kl']:10.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
