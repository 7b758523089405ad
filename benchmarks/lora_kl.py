"""KL divergence of a LoRA adapter on the low-bit base (the QLoRA serving case) against the
same adapter on the float32 base, next to the low-bit base's own KL against the float32
base, on the same text (issue 65).

    PYTHONPATH=. .venv/bin/python benchmarks/lora_kl.py [--model FILE.gguf] [--ctx 512]
        [--chunks 4] [--rank 16] [--train-steps 30] [--lr 1e-3] [--adapter PEFT_DIR]
        [--lora-dtypes float32 int8] [--out out/lora_kl.json]

No real adapter can be downloaded here, so the script trains one: transformers loads the
GGUF (dequantized to float32), peft puts a rank-R LoRA on every attention and MLP
projection and takes --train-steps AdamW steps on one text (docs/serving.md) from B = 0,
then saves it in the PEFT format (seeded: the same adapter each run; `--adapter` takes a
saved one instead). Evaluation is on another text (docs/architecture.md,
benchmarks/kl_divergence.py's chunks: the second half of each is scored). The float32
base is the same file with `--quantization none` (exact dequantization; with a float32
adapter it equals transformers' merged model, tests/models/test_lora.py). Rows:

  adapter effect        KL(float32 base || float32 base + adapter): the adapter matters
  low-bit base          KL(float32 base || low-bit base): the file's own error
  low-bit + adapter D   KL(float32 base + float32 adapter || low-bit base + adapter in D)

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kl_divergence import Forward, chunks, kl  # noqa: E402

from duetserve.loader import load_model, resolve_model_path  # noqa: E402
from duetserve.models.lora import LoRABatch, load_adapter  # noqa: E402
from duetserve.worker.batch import SeqWork  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_TEXT = os.path.join(HERE, "..", "docs", "serving.md")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def train_adapter(model_file: str, out: str, rank: int, steps: int, ctx: int,
                  lr: float = 1e-3) -> float:
    """A rank-`rank` adapter trained `steps` AdamW steps at learning rate `lr` on TRAIN_TEXT;
    returns the last step's loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.dirname(model_file), os.path.basename(model_file)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                          target_modules=TARGETS))
    with open(TRAIN_TEXT, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[0]
    n = min(ctx, 256)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        start = (step * n) % max(1, len(ids) - n - 1)
        x = ids[start:start + n][None]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    return float(loss.detach())


class LoRAForward(Forward):
    """Forward with every row under one adapter."""

    def __init__(self, loaded, ctx: int, adapter) -> None:
        super().__init__(loaded, ctx)
        self.adapter = adapter

    @torch.inference_mode()
    def logprobs(self, tokens: list[int], first: int, one_by_one: bool) -> torch.Tensor:
        assert not one_by_one, "prefill rows only"
        model = self.loaded.model
        b = self._batch([SeqWork("c", tokens, 0, self.block_ids, True, lora_slot=0)], False)
        hidden = model(b.input_ids, b.positions, self.kv, b.meta,
                       LoRABatch.from_rows(b.lora_slots, [self.adapter]))
        return torch.log_softmax(model.compute_logits(hidden[first - 1:-1]), -1)


def mean_kl(p: Forward, q: Forward, token_chunks: list[list[int]], ctx: int) -> dict:
    first = ctx // 2
    ks, same = [], []
    for toks in token_chunks:
        a, b = p.logprobs(toks, first, False), q.logprobs(toks, first, False)
        ks.append(kl(a, b))
        same.append((a.argmax(-1) == b.argmax(-1)).float())
    k = torch.cat(ks)
    return {"mean_kld": float(k.mean()), "p99_kld": float(k.quantile(0.99)),
            "same_top1": float(torch.cat(same).mean()), "tokens": int(k.numel())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3, help="the training's learning rate")
    ap.add_argument("--adapter", default=None, help="a PEFT folder instead of training one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-dtypes", nargs="+", default=["float32", "int8"],
                    choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--out", default="out/lora_kl.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model_path(args.model)
    folder, loss = args.adapter, float("nan")
    if folder is None:
        torch.manual_seed(0)
        folder = tempfile.mkdtemp()
        loss = train_adapter(model, folder, args.rank, args.train_steps, args.ctx, args.lr)
        print(f"adapter saved in {folder}")
    f32, low = load_model(model, quantization="none"), load_model(model, quantization="auto")
    token_chunks = chunks(f32.tokenizer, args.ctx, args.chunks)
    adapter = {d: load_adapter(folder, low.config, args.rank, dtype=getattr(torch, d))
               for d in set(args.lora_dtypes) | {"float32"}}
    ref_base, ref = Forward(f32, args.ctx), LoRAForward(f32, args.ctx, adapter["float32"])
    rows = {"adapter effect": mean_kl(ref_base, ref, token_chunks, args.ctx),
            "low-bit base": mean_kl(ref_base, Forward(low, args.ctx), token_chunks, args.ctx)}
    for d in args.lora_dtypes:
        rows[f"low-bit + adapter {d}"] = mean_kl(
            ref, LoRAForward(low, args.ctx, adapter[d]), token_chunks, args.ctx)
    made = f"from {args.adapter}" if args.adapter else \
        f"{args.train_steps} AdamW steps at lr {args.lr:g} (last loss {loss:.3f})"
    print(f"{os.path.basename(model)}, adapter rank {args.rank} on every projection, {made}; "
          f"{len(token_chunks)} chunks of {args.ctx}, second halves scored")
    print(f"| {'row':<26} | mean KLD | p99 KLD | same top-1 |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name:<26} | {r['mean_kld']:.5f} | {r['p99_kld']:.5f} | "
              f"{r['same_top1']:.3f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": model, "ctx": args.ctx, "chunks": len(token_chunks),
                   "rank": args.rank, "adapter": args.adapter,
                   "train_steps": args.train_steps, "lr": args.lr, "train_loss": loss,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
