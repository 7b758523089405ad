"""How steady is this machine's arithmetic? (docs/simulator.md §3, r27: the limit of fidelity)

A calibrated simulator can only be as close to the engine as the machine is to itself:
a cost model measured at one minute predicts another minute's steps only if the hardware
runs the same work at the same speed. This times three fixed kernels, interleaved in
short bursts so that every window of the run samples all three at the same moment:

    bf16_gemm   512 x 576 @ 576 x 1536 in bfloat16 (AMX or AVX512-BF16 where present):
                the engine's prefill GEMMs under --dtype auto
    fp32_gemm   the same product in float32 (AVX-512 / AVX2 FMA): --dtype float32
    fp32_gemv   4 x 576 @ 576 x 12288 in float32: a memory-streaming decode-like product

For each kernel: the burst times' spread (min, p10, median, p90, max, p90 / p10), the
spread of their means over --window seconds (what one fidelity run of ~50 s sees: the
"level"), and the lag-1 autocorrelation of the burst times (near 1: the speed moves in
stretches of seconds, not step by step). The correlation between the kernels' window
means says whether one speed factor (the speed probe's assumption, sim/speed.py) follows
them all, or prefill and decode speeds drift apart.

    /tmp/gate.sh .venv/bin/python benchmarks/machine_drift.py --seconds 180 \
        --out out/machine_drift.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from duetserve.models.native import cpu_name


def kernels(torch) -> dict:
    """name -> a zero-argument callable running that kernel once (inputs made here)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 576, generator=g)
    b = torch.randn(576, 1536, generator=g)
    ab, bb = a.bfloat16(), b.bfloat16()
    x = torch.randn(4, 576, generator=g)
    w = torch.randn(576, 12288, generator=g)
    return {"bf16_gemm": lambda: ab @ bb, "fp32_gemm": lambda: a @ b,
            "fp32_gemv": lambda: x @ w}


def summary(times_s: list[float], stamps_s: list[float], window_s: float) -> dict:
    """The spread of one kernel's burst times (seconds each, taken at `stamps_s` seconds
    from the start): percentiles, p90/p10, the lag-1 autocorrelation, and the means over
    consecutive windows of `window_s` seconds (their max/min and relative std). ValueError
    on fewer than two bursts or mismatched lists."""
    if len(times_s) != len(stamps_s) or len(times_s) < 2:
        raise ValueError(f"need two or more bursts with a stamp each, got {len(times_s)} "
                         f"times and {len(stamps_s)} stamps")
    t = np.asarray(times_s, dtype=float)
    p10, p50, p90 = np.percentile(t, [10, 50, 90])
    d = t - t.mean()
    auto = float((d[:-1] * d[1:]).sum() / (d * d).sum()) if (d * d).sum() > 0 else 0.0
    win = np.floor(np.asarray(stamps_s) / window_s).astype(int)
    means = np.array([t[win == k].mean() for k in np.unique(win)])
    return {"bursts": len(t), "min_ms": 1e3 * float(t.min()), "p10_ms": 1e3 * float(p10),
            "median_ms": 1e3 * float(p50), "p90_ms": 1e3 * float(p90),
            "max_ms": 1e3 * float(t.max()), "p90_over_p10": float(p90 / p10),
            "lag1_autocorrelation": auto, "window_s": window_s,
            "window_means_ms": [1e3 * float(m) for m in means],
            "window_max_over_min": float(means.max() / means.min()),
            "window_rel_std": float(means.std() / means.mean()) if len(means) > 1 else 0.0}


def window_correlations(per_kernel: dict[str, list[float]]) -> dict:
    """Pearson correlation of every pair of kernels' window means (equal-length lists)."""
    names = sorted(per_kernel)
    out = {}
    for i, p in enumerate(names):
        for q in names[i + 1:]:
            x, y = np.asarray(per_kernel[p]), np.asarray(per_kernel[q])
            n = min(len(x), len(y))
            if n > 2 and x[:n].std() > 0 and y[:n].std() > 0:
                out[f"{p}~{q}"] = float(np.corrcoef(x[:n], y[:n])[0, 1])
    return out


def run(seconds: float, burst_s: float, threads: int) -> tuple[dict, dict]:
    """Time the kernels in turn, one burst of ~burst_s each, for `seconds` after a warm-up.
    Returns ({kernel: burst times}, {kernel: stamps})."""
    import torch
    torch.set_num_threads(threads)
    ks = kernels(torch)
    reps = {}
    for name, f in ks.items():            # warm up; size each burst to ~burst_s
        for _ in range(10):
            f()
        s = time.perf_counter()
        for _ in range(20):
            f()
        reps[name] = max(1, round(burst_s / ((time.perf_counter() - s) / 20)))
    times = {k: [] for k in ks}
    stamps = {k: [] for k in ks}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for name, f in ks.items():
            s = time.perf_counter()
            for _ in range(reps[name]):
                f()
            e = time.perf_counter()
            times[name].append((e - s) / reps[name])
            stamps[name].append(s - t0)
    return times, stamps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--burst", type=float, default=0.02, help="seconds per burst")
    ap.add_argument("--window", type=float, default=50.0,
                    help="seconds per window mean (a fidelity run's length)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="out/machine_drift.json")
    args = ap.parse_args()
    times, stamps = run(args.seconds, args.burst, args.threads)
    rows = {k: summary(times[k], stamps[k], args.window) for k in times}
    fine = {k: summary(times[k], stamps[k], 5.0)["window_means_ms"] for k in times}
    doc = {"cpu": cpu_name(), "threads": args.threads, "seconds": args.seconds,
           "kernels": rows, "correlation_5s_windows": window_correlations(fine)}
    print(f"{doc['cpu']}, {args.threads} threads, {args.seconds:.0f} s")
    print(f"| kernel | bursts | min ms | p10 | median | p90 | max | p90/p10 | lag-1 "
          f"| {args.window:g}-s means max/min |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['bursts']} | {r['min_ms']:.3f} | {r['p10_ms']:.3f} | "
              f"{r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['max_ms']:.3f} | "
              f"{r['p90_over_p10']:.2f} | {r['lag1_autocorrelation']:.2f} | "
              f"{r['window_max_over_min']:.2f} |")
    print("correlation of 5-s window means: " + ", ".join(
        f"{k} {v:.2f}" for k, v in doc["correlation_5s_windows"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
