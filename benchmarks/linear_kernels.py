"""One linear layer, every kernel duetserve can pick, at several row counts: the
measurement behind the kernel-by-phase policy (docs/performance.md).

    .venv/bin/python benchmarks/linear_kernels.py [--threads 2] [--out out/linear.json]

Columns (ms per call, median): fp32 and bf16 dense GEMM (oneDNN), torch's int4/int8
packed kernels (bf16 activations, torch's own int4 packing), duetserve's native q4/q8
GEMVs (int8 activations per group of 32, VNNI; few rows only), and the q4
dequantize-then-bf16-GEMM path used without a dense copy.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from duetserve.models.native import ops
from duetserve.models.quant import (Int4Weight, Int8Weight, int4_groups_from_float,
                                    quantize_int8)

SHAPES = [(3072, 576), (576, 1536), (49152, 576), (17920, 1536), (1536, 8960)]
ROWS = (1, 4, 16, 64, 512)


def median_ms(fn, budget_s: float = 0.4) -> float:
    fn()
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    times = []
    for _ in range(max(3, min(50, int(budget_s / max(one, 1e-6))))):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = ops()
    rows = []
    print(f"{'N x K':>13} {'M':>4} {'fp32':>8} {'bf16':>8} {'t-int4':>8} {'d-int4':>8} "
          f"{'t-int8':>8} {'d-int8':>8} {'deq+bf16':>9}")
    for n, k in SHAPES:
        w = torch.randn(n, k)
        q, d, mn = int4_groups_from_float(w)
        w4 = Int4Weight(q, d, mn)
        # torch's own int4 CPU packing of the same groups, for its kernel's column:
        # w = (q - 8) * scale + zero with zero = m + 8 d
        t4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        t4sz = torch.stack([d.t(), (mn + 8 * d).t()], -1).to(torch.bfloat16).contiguous()
        q8, s8 = quantize_int8(w)
        w8 = Int8Weight(q8, s8)
        wb = w.bfloat16()
        for m in ROWS:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            r = {"n": n, "k": k, "m": m,
                 "fp32": median_ms(lambda: F.linear(x, w)),
                 "bf16": median_ms(lambda: F.linear(xb, wb)),
                 "torch_int4": median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                     xb, t4, 32, t4sz)),
                 "torch_int8": median_ms(lambda: torch.ops.aten._weight_int8pack_mm(
                     xb, q8, w8.scale)),
                 "dequant_bf16": median_ms(lambda: F.linear(xb, w4.dequantize(torch.bfloat16)))}
            if native is not None and m <= 16:
                r["duet_int4"] = median_ms(lambda: native.q4_gemv(x, w4.packed, w4.shape[0]))
                r["duet_int8"] = median_ms(lambda: native.q8_gemv(x, w8.packed, w8.scale32))
            rows.append(r)
            f = lambda key: f"{r[key]:8.3f}" if key in r else f"{'':>8}"  # noqa: E731
            print(f"{n:>6} x {k:<5} {m:>4} {f('fp32')} {f('bf16')} {f('torch_int4')} "
                  f"{f('duet_int4')} {f('torch_int8')} {f('duet_int8')} {r['dequant_bf16']:9.3f}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
