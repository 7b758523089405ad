"""The decode attention kernel alone, by KV cache dtype: `paged_decode_attention` over one
cache per layer (so the caches stream from DRAM as a model's do), B sequences of L tokens
each through random block tables. Prints a table and writes JSON.

    .venv/bin/python benchmarks/decode_attention.py [--batch 1] [--context 8192] \\
        [--heads 12 --kv-heads 2 --head-dim 128 --layers 28] [--threads 2] \\
        [--kv-dtypes float32 bfloat16 int8 int4] [--out out/decode_attention.json]

The defaults are Qwen2.5-Coder-1.5B's attention. Times are the median of 7 passes over
all layers after one warm-up pass; GB/s counts the cache bytes the pass reads.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from duetserve.models.kv_quant import quantize
from duetserve.models.native import ops

STORE = {"float32": lambda x: x, "bfloat16": lambda x: x.bfloat16(),
         "int8": lambda x: quantize(x, torch.int8), "int4": lambda x: quantize(x, torch.uint8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtypes", nargs="+", default=list(STORE))
    ap.add_argument("--out", default="out/decode_attention.json")
    args = ap.parse_args()
    native = ops()
    if native is None:
        raise SystemExit("native kernels are not built here")
    torch.set_num_threads(args.threads)
    B, L, D, bs = args.batch, args.context, args.head_dim, args.block_size
    nb = B * (L // bs + 1)
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(nb, generator=g).view(B, -1).contiguous()
    lens = torch.full((B,), L, dtype=torch.int64)
    q = torch.randn(B, args.heads, D, generator=g)
    rows = []
    for name in args.kv_dtypes:
        layers = [tuple(STORE[name](torch.randn(args.kv_heads, nb, bs, D, generator=g))
                        for _ in range(2)) for _ in range(args.layers)]

        def run() -> None:
            for kc, vc in layers:
                native.paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, 0)
        run()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        ms = sorted(times)[3] * 1e3
        kc = layers[0][0]
        read = kc.numel() * kc.element_size() * 2 * args.layers * L * B / (nb * bs)
        rows.append({"kv_dtype": name, "ms": ms, "gb_s": read / ms / 1e6, "times_s": times})
        print(f"{name:<9} {ms:8.1f} ms  {read / ms / 1e6:6.1f} GB/s", flush=True)
        del layers
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
