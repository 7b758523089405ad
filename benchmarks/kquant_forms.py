"""One-row GEMV time of the four low-bit forms on the 1.5B's decode shapes, over weights
read from DRAM: int4 (float16 d and m per 32) against int4k (Q4_K's own codes), int8 per
row against int6 (Q6_K's own codes). The load-time probe (models/kernels.py:
exact_kquant_forms) makes the same comparison on one shape to choose the forms.

    .venv/bin/python benchmarks/kquant_forms.py [--threads 2] [--out out/kquant_forms.json]

Each form's weight is cloned until the copies hold 96 MiB of int8 (more than the L3), the
forms timed in turn, best of 8 passes over the copies. Prints ms per matrix, GB/s and the
exact / widened time ratios.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from duetserve.models.kernels import _clone, probe_forms

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]
PROBE_BYTES = 96 * 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--out", default="kquant_forms.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'N x K':>14} {'copies':>6} " + " ".join(f"{f:>16}" for f in
          ("int4", "int4k", "int8", "int6")) + "  int4k/int4  int6/int8")
    for n, k in SHAPES:
        f = probe_forms(n, k, g)
        copies = max(1, -(-PROBE_BYTES // f["int8"].nbytes))
        ws = {name: [w] + [_clone(w) for _ in range(copies - 1)] for name, w in f.items()}
        x = torch.randn(1, k)
        best = {name: float("inf") for name in ws}
        for _ in range(args.passes):
            for name, cs in ws.items():
                t = time.perf_counter()
                for w in cs:
                    w.matmul(x)
                best[name] = min(best[name], time.perf_counter() - t)
        r = {"n": n, "k": k, "copies": copies,
             **{f"{nm}_ms": best[nm] / copies * 1e3 for nm in best},
             **{f"{nm}_gb_s": f[nm].nbytes * copies / best[nm] / 1e9 for nm in best},
             "int4k_over_int4": best["int4k"] / best["int4"],
             "int6_over_int8": best["int6"] / best["int8"]}
        rows.append(r)
        cell = lambda nm: f"{r[nm + '_ms']:7.3f} {r[nm + '_gb_s']:5.1f}GB/s"  # noqa: E731
        print(f"{n:>6} x {k:<6} {copies:>6} " + " ".join(f"{cell(nm):>16}" for nm in
              ("int4", "int4k", "int8", "int6"))
              + f"  {r['int4k_over_int4']:10.2f}  {r['int6_over_int8']:9.2f}", flush=True)
        del ws, f
    with open(args.out, "w") as fh:
        json.dump({"threads": args.threads, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
