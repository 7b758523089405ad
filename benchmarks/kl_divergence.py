"""KL divergence of the low-bit path against the float32 path on a fixed text, next to
llama.cpp's own on the same file (`llama-perplexity --kl-divergence`), in one run.

    .venv/bin/python benchmarks/kl_divergence.py --model FILE.gguf [--ctx 512] [--chunks 8]

The text (default: docs/architecture.md) is cut into chunks of --ctx tokens, each starting
with BOS where the model adds one, as llama-perplexity does; the next-token distributions
of the second half of every chunk are compared, KL(p_float32 || p_lowbit) averaged over
them. duetserve's side is computed twice:

  prefill  the whole chunk in one step (many rows: the engine's prompt path)
  decode   teacher-forced one token a step (few rows: the low-bit GEMVs that generate)

and its float32 base is the same file with `--quantization none` (weights dequantized
exactly). llama.cpp's base is an F32 copy of the file (benchmarks/peers/make_f32_gguf.py),
its comparison the file itself, both with the same tokens (`--kl-divergence-base`).
Prints a table and writes JSON.

`--kv-dtypes int8,int4` compares KV cache dtypes instead (issue 64): the file's own weights
with a float32 KV cache as the base, against the same weights with each KV dtype (both
duetserve paths), next to llama.cpp's q8_0 / q4_0 KV (`-ctk/-ctv`, flash attention on)
against its default f16 KV on the same file.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import torch

from duetserve.loader import load_model
from duetserve.worker.batch import SeqWork, build_step_batch
from duetserve.worker.kv_cache import allocate_kv_cache, kv_storage_dtype

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "docs", "architecture.md")


class Forward:
    """One loaded model over its own paged KV cache: a chunk's next-token log-probs."""

    def __init__(self, loaded, ctx: int, kv_dtype: str = "float32") -> None:
        self.loaded, self.bs = loaded, 16
        self.windows = tuple(g.window for g in loaded.config.kv_groups())
        blocks = (ctx // self.bs + 2) * len(self.windows)
        self.kv = allocate_kv_cache(loaded.config, blocks, self.bs,
                                    kv_storage_dtype(kv_dtype, torch.float32), "cpu")
        self.block_ids = list(range(blocks))
        self.paged = loaded.model.layers[0].self_attn.backend.paged_decode is not None

    @torch.inference_mode()
    def logprobs(self, tokens: list[int], first: int, one_by_one: bool) -> torch.Tensor:
        """log p(. | tokens[:i+1]) for i in [first - 1, len - 1): [n, vocab]."""
        model, out = self.loaded.model, []
        if not one_by_one:
            b = self._batch([SeqWork("c", tokens, 0, self.block_ids, True)], rows=False)
            hidden = model(b.input_ids, b.positions, self.kv, b.meta)
            return torch.log_softmax(model.compute_logits(hidden[first - 1:-1]), -1)
        b = self._batch([SeqWork("c", tokens[:first], 0, self.block_ids, True)], rows=False)
        hidden = model(b.input_ids, b.positions, self.kv, b.meta)
        out.append(model.compute_logits(hidden[-1:]))
        for pos in range(first, len(tokens) - 1):
            b = self._batch([SeqWork("c", [tokens[pos]], pos, self.block_ids, True)], True)
            out.append(model.compute_logits(model(b.input_ids, b.positions, self.kv, b.meta)))
        return torch.log_softmax(torch.cat(out), -1)

    def _batch(self, work, rows: bool):
        return build_step_batch(work, self.bs, paged_decode=self.paged and rows,
                                windows=self.windows)


def chunks(tokenizer, ctx: int, count: int) -> list[list[int]]:
    with open(TEXT, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None \
        else []
    n = ctx - len(bos)
    return [bos + ids[i * n:(i + 1) * n] for i in range(min(count, len(ids) // n))]


def kl(base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return (base.exp() * (base - other)).sum(-1)


def ours(model: str, token_chunks: list[list[int]], ctx: int, **switches) -> dict:
    """The low-bit path (with `switches`, load_model's kernel switches) against float32."""
    return compare(Forward(load_model(model, quantization="none"), ctx),
                   Forward(load_model(model, quantization="auto", **switches), ctx),
                   token_chunks, ctx)


def ours_kv(model: str, token_chunks: list[list[int]], ctx: int, kv_dtypes: list[str]
            ) -> dict:
    """Per KV dtype: the file's weights over that cache against a float32 cache."""
    loaded = load_model(model, quantization="auto")
    base = Forward(loaded, ctx, "float32")
    return {d: compare(base, Forward(loaded, ctx, d), token_chunks, ctx) for d in kv_dtypes}


def compare(f32: Forward, low: Forward, token_chunks: list[list[int]], ctx: int) -> dict:
    first = ctx // 2
    res = {}
    for mode, one in (("prefill", False), ("decode", True)):
        kls, agree = [], []
        for toks in token_chunks:
            p = f32.logprobs(toks, first, one)
            q = low.logprobs(toks, first, one)
            kls.append(kl(p, q))
            agree.append((p.argmax(-1) == q.argmax(-1)).float())
        k = torch.cat(kls)
        res[mode] = {"mean_kld": float(k.mean()), "p99_kld": float(k.quantile(0.99)),
                     "same_top1": float(torch.cat(agree).mean()), "tokens": int(k.numel())}
    return res


def llama_cpp(model: str, token_chunks: list[list[int]], ctx: int, bin_dir: str,
              threads: int, workdir: str) -> dict:
    """llama-perplexity's KL divergence of `model` against its F32 copy on the same text
    (its own tokenizer; chunk count limited like ours)."""
    f32 = os.path.join(workdir, os.path.basename(model).replace(".gguf", ".F32.gguf"))
    if not os.path.exists(f32):
        subprocess.run([sys.executable, os.path.join(HERE, "peers", "make_f32_gguf.py"),
                        "--input", model, "--output", f32], check=True)
    base = os.path.join(workdir, "kld_base.bin")
    common = ["-f", TEXT, "-c", str(ctx), "--chunks", str(len(token_chunks)), "-t",
              str(threads), "-b", str(ctx)]
    exe = os.path.join(bin_dir, "llama-perplexity")
    subprocess.run([exe, "-m", f32, "--kl-divergence-base", base] + common, check=True,
                   capture_output=True)
    run = subprocess.run([exe, "-m", model, "--kl-divergence-base", base, "--kl-divergence"]
                         + common, check=True, capture_output=True, text=True)
    return _parse_kld(run.stdout + run.stderr)


def _llama_bin(args) -> str:
    return args.llama_bin or subprocess.run(
        ["bash", os.path.join(HERE, "peers", "build_llama_cpp.sh")], check=True,
        capture_output=True, text=True).stdout.strip().splitlines()[-1]


# llama.cpp's KV types at the same bits as ours
LLAMA_KV = {"int8": "q8_0", "int4": "q4_0"}


def llama_cpp_kv(model: str, token_chunks: list[list[int]], ctx: int, bin_dir: str,
                 threads: int, workdir: str, kv_dtypes: list[str]) -> dict:
    """llama-perplexity's KL divergence of `model` with q8_0 / q4_0 KV against its
    default f16 KV (flash attention on in both: quantized V needs it)."""
    base = os.path.join(workdir, "kld_kv_base.bin")
    common = ["-m", model, "-f", TEXT, "-c", str(ctx), "--chunks", str(len(token_chunks)),
              "-t", str(threads), "-b", str(ctx), "-fa", "on", "--kl-divergence-base", base]
    exe = os.path.join(bin_dir, "llama-perplexity")
    subprocess.run([exe] + common, check=True, capture_output=True)
    out = {}
    for d in kv_dtypes:
        t = LLAMA_KV[d]
        run = subprocess.run([exe] + common + ["--kl-divergence", "-ctk", t, "-ctv", t],
                             check=True, capture_output=True, text=True)
        out[d] = _parse_kld(run.stdout + run.stderr)
    return out


def _parse_kld(text: str) -> dict:
    mean = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", text)
    same = re.search(r"Same top p:\s+([0-9.]+)", text)
    p99 = re.search(r"99\.0%\s+KLD:\s+([0-9.eE+-]+)", text)
    return {"mean_kld": float(mean.group(1)) if mean else None,
            "p99_kld": float(p99.group(1)) if p99 else None,
            "same_top1": float(same.group(1)) / 100 if same else None, "log_tail": text[-2000:]}


def _row(name: str, r: dict) -> None:
    # llama-perplexity prints no mean/p99/top-1 on some short runs (--ctx 128 --chunks 1)
    mean, p99, top1 = (float("nan") if r[k] is None else r[k]
                       for k in ("mean_kld", "p99_kld", "same_top1"))
    print(f"{name:<28} {mean:>10.5f} {p99:>10.5f} {top1:>10.3f}")


def main_kv(args, token_chunks: list[list[int]], workdir: str, bin_dir: str) -> dict:
    kv = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
    bad = [d for d in kv if d not in LLAMA_KV]
    if bad:
        raise SystemExit(f"--kv-dtypes: unknown {bad}; known {sorted(LLAMA_KV)}")
    result = {"model": args.model, "ctx": args.ctx, "chunks": len(token_chunks),
              "base": "float32 KV (llama.cpp: f16 KV)",
              "duetserve": ours_kv(args.model, token_chunks, args.ctx, kv),
              "llama.cpp": llama_cpp_kv(args.model, token_chunks, args.ctx, bin_dir,
                                        args.threads, workdir, kv)}
    print(f"{'KV dtype, path':<28} {'mean KLD':>10} {'p99 KLD':>10} {'same top-1':>10}")
    for d in kv:
        for mode in ("prefill", "decode"):
            _row(f"duetserve {d} {mode}", result["duetserve"][d][mode])
        _row(f"llama.cpp {LLAMA_KV[d]}", result["llama.cpp"][d])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bin", default=None, help="llama.cpp bin/ (default: build it)")
    ap.add_argument("--out", default="out/kl_divergence.json")
    ap.add_argument("--kv-dtypes", default=None,
                    help="compare KV cache dtypes (e.g. int8,int4) against float32 KV "
                         "instead of the low-bit weights against float32 ones")
    ap.add_argument("--compare-amx", action="store_true",
                    help="also the low-bit path with --no-amx (on an AMX CPU: its many-row "
                         "steps on the dense path, prompt attention in float32)")
    ap.add_argument("--compare-prefill-attention", action="store_true",
                    help="also the low-bit path with --prefill-attention float32 (where the "
                         "default runs prompt attention in bfloat16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    workdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(workdir, exist_ok=True)
    tokenizer = load_model(args.model, quantization="none").tokenizer
    token_chunks = chunks(tokenizer, args.ctx, args.chunks)
    if args.kv_dtypes:
        result = main_kv(args, token_chunks, workdir, _llama_bin(args))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    result = {"model": args.model, "ctx": args.ctx, "chunks": len(token_chunks),
              "duetserve": ours(args.model, token_chunks, args.ctx)}
    if args.compare_amx:
        result["duetserve_no_amx"] = ours(args.model, token_chunks, args.ctx, amx=False)
    if args.compare_prefill_attention:
        result["duetserve_f32_attention"] = ours(args.model, token_chunks, args.ctx,
                                                 prefill_attention="float32")
    bin_dir = _llama_bin(args)
    result["llama.cpp"] = llama_cpp(args.model, token_chunks, args.ctx, bin_dir,
                                    args.threads, workdir)
    print(f"{'path':<28} {'mean KLD':>10} {'p99 KLD':>10} {'same top-1':>10}")
    rows = [("duetserve prefill", result["duetserve"]["prefill"]),
            ("duetserve decode", result["duetserve"]["decode"])]
    if args.compare_amx:
        rows += [("duetserve prefill, --no-amx", result["duetserve_no_amx"]["prefill"]),
                 ("duetserve decode, --no-amx", result["duetserve_no_amx"]["decode"])]
    if args.compare_prefill_attention:
        r = result["duetserve_f32_attention"]
        rows += [("duetserve prefill, f32 attn", r["prefill"]),
                 ("duetserve decode, f32 attn", r["decode"])]
    for name, r in rows + [("llama.cpp", result["llama.cpp"])]:
        _row(name, r)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
