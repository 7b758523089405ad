"""Microbenchmarks of this machine for the roofline: GEMM peaks (fp32, bf16, int8) and DRAM
read bandwidth.

torch is imported inside the functions only (duetserve.metrics stays torch-free at import).
Each benchmark warms up, repeats, and returns the median; threads are set explicitly.
"""
from __future__ import annotations

import statistics
import time

from duetserve.metrics.hardware import save_measured

GEMM_DTYPES = ("fp32", "bf16", "int8")


def measure_gemm_flops(n: int = 4096, repeats: int = 5, threads: int = 2,
                       dtype: str = "fp32") -> float:
    """Return the median FLOP/s (int8: multiply-add ops x 2, counted as FLOPs are) of an
    n x n x n matmul (2 n^3) in `dtype` (GEMM_DTYPES; int8 through torch._int_mm, int32
    sums), after one warm-up. Float dtypes: the faster of torch.mm and oneDNN's linear, the
    engine's dense GEMM (models/layers.py; on a Zen 5 torch.mm ran fp32 at 186 GFLOP/s,
    oneDNN at 405)."""
    import torch
    torch.set_num_threads(threads)
    if dtype == "int8":
        a = torch.randint(-128, 128, (n, n), dtype=torch.int8)
        b = torch.randint(-128, 128, (n, n), dtype=torch.int8)
        runs = [lambda: torch._int_mm(a, b)]
    else:
        kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        a, b = torch.randn(n, n).to(kind), torch.randn(n, n).to(kind)
        out = torch.empty(n, n, dtype=kind)
        runs = [lambda: torch.mm(a, b, out=out)]
        onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) \
            if torch.backends.mkldnn.is_available() else None
        if onednn is not None:
            runs.append(lambda: onednn(a, b, None, "none", [], ""))
    best = 0.0
    for run in runs:
        run()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * n ** 3 / statistics.median(times))
    return best


def measure_read_bandwidth(total_gib: float = 2.0, num_arrays: int = 8, repeats: int = 5,
                           threads: int = 2) -> float:
    """Return the median DRAM read bandwidth in bytes/s.

    Sums `num_arrays` fp32 arrays of `total_gib` GiB in all (>= 2 GiB so the L3 cannot hold
    them), cycling through them so each read comes from DRAM; one warm-up pass first.
    """
    import torch
    torch.set_num_threads(threads)
    per = int(total_gib * 2 ** 30 / num_arrays / 4)
    arrays = [torch.ones(per) for _ in range(num_arrays)]
    nbytes = per * 4 * num_arrays
    for x in arrays:  # warm-up: page in, first touch done by ones()
        x.sum()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x in arrays:
            x.sum()
        rates.append(nbytes / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure_and_cache(threads: int = 2) -> dict:
    """Measure the GEMM peaks and read bandwidth, cache them (hardware.json); return the
    figures. A dtype this torch cannot multiply in (RuntimeError) is left unmeasured."""
    peaks = {}
    for dtype in GEMM_DTYPES:
        try:
            peaks[dtype] = measure_gemm_flops(threads=threads, dtype=dtype)
        except RuntimeError:
            pass
    bw = measure_read_bandwidth(threads=threads)
    details = {"threads": threads, "gemm": "4096^3, the faster of torch.mm and oneDNN's linear "
                                           "(int8: torch._int_mm), median of 5",
               "bandwidth": "sum over 8 fp32 arrays, 2 GiB total, median of 5"}
    flops = peaks.pop("fp32")
    path = save_measured(flops, bw, details, peaks)
    return {"fp32_flops": flops, "peaks": peaks, "mem_bandwidth": bw, "path": str(path),
            **details}


def format_measure(m: dict) -> str:
    """Return one paragraph describing a `measure_and_cache` result."""
    others = "".join(f", {k} GEMM {v / 1e9:.1f} G{'FLOP' if k != 'int8' else 'op'}/s"
                     for k, v in m.get("peaks", {}).items())
    return (f"measured this machine ({m['threads']} threads): fp32 GEMM "
            f"{m['fp32_flops'] / 1e9:.1f} GFLOP/s{others}, DRAM read "
            f"{m['mem_bandwidth'] / 1e9:.1f} GB/s, ridge {m['fp32_flops'] / m['mem_bandwidth']:.1f}"
            f" FLOP/byte (fp32); cached in {m['path']}\n")
