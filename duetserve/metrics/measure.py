"""Microbenchmarks of this machine for the roofline: fp32 GEMM FLOP/s and DRAM read bandwidth.

torch is imported inside the functions only (duetserve.metrics stays torch-free at import).
Each benchmark warms up, repeats, and returns the median; threads are set explicitly.
"""
from __future__ import annotations

import statistics
import time

from duetserve.metrics.hardware import save_measured


def measure_gemm_flops(n: int = 4096, repeats: int = 5, threads: int = 2) -> float:
    """Return the median fp32 FLOP/s of an n x n x n matmul (2 n^3 FLOPs), after one warm-up."""
    import torch
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


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
    """Measure fp32 GEMM and read bandwidth, cache them (hardware.json); return the figures."""
    flops = measure_gemm_flops(threads=threads)
    bw = measure_read_bandwidth(threads=threads)
    details = {"threads": threads, "gemm": "fp32 4096^3 torch.mm, median of 5",
               "bandwidth": "sum over 8 fp32 arrays, 2 GiB total, median of 5"}
    path = save_measured(flops, bw, details)
    return {"fp32_flops": flops, "mem_bandwidth": bw, "path": str(path), **details}


def format_measure(m: dict) -> str:
    """Return one paragraph describing a `measure_and_cache` result."""
    return (f"measured this machine ({m['threads']} threads): fp32 GEMM "
            f"{m['fp32_flops'] / 1e9:.1f} GFLOP/s, DRAM read {m['mem_bandwidth'] / 1e9:.1f} GB/s, "
            f"ridge {m['fp32_flops'] / m['mem_bandwidth']:.1f} FLOP/byte; cached in {m['path']}\n")
