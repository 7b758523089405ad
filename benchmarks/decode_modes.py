"""Batch-1 decode speed of one process, pass by pass, with what might set it: run it a few
times in a row to see what a machine's decode speed moves with (on the 2-core EPYC it
came out bimodal between processes, 29-30 or 35.5-37 tok/s on the 1.5B, and followed the
DRAM bandwidth of the moment: docs/benchmarks.md, "The activations kept in L1").

    .venv/bin/python benchmarks/decode_modes.py --model M [--passes 3] [--threads 2]

Prints the median step rate of each pass of 64 greedy tokens (after one warm-up pass),
a compute probe (256 x 256 float32 matmuls, in cache) and a memory probe (a sum over
512 MiB),
the process's Rss and AnonHugePages (kB), the spread over physical memory (GiB ->
pages; needs root for /proc/self/pagemap, else empty) of the 2 MiB pages of the storage
holding the first layer's gate_up weight (the loader's one arena), and the CPU each
thread last ran on.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import struct
import time

from duetserve import LLM, SamplingParams


def _pass(eng, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    eng.add_request(f"r{time.time_ns()}", [(31 * i) % 150000 + 100 for i in range(64)], params)
    steps = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    return 1 / statistics.median(steps[2:])


def _probes(threads: int) -> tuple[float, float]:
    """(GFLOP/s of a cache-resident fp32 matmul, GB/s of a sum over 512 MiB): is a slow
    process short of compute or of memory bandwidth?"""
    import torch
    torch.set_num_threads(threads)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(20):
        a @ b
    t = time.perf_counter()
    for _ in range(400):
        a @ b
    flops = 400 * 2 * 256**3 / (time.perf_counter() - t) / 1e9
    return flops, memory_probe(threads)


def memory_probe(threads: int) -> float:
    """GB/s of `torch.sum` over 512 MiB (one warm-up, then 5 sums timed together): the
    machine's read rate of the moment (benchmarks/decode_vs_gemvs.py uses it too)."""
    import torch
    torch.set_num_threads(threads)
    big = torch.ones(128 * 2**20)
    big.sum()
    t = time.perf_counter()
    for _ in range(5):
        big.sum()
    return 5 * big.numel() * 4 / (time.perf_counter() - t) / 1e9


def _physical_spread(addr: int, nbytes: int) -> list[tuple[int, int]]:
    hist: collections.Counter = collections.Counter()
    try:
        with open("/proc/self/pagemap", "rb") as f:
            for off in range(0, nbytes, 2 << 20):
                f.seek(((addr + off) // 4096) * 8)
                pfn = struct.unpack("Q", f.read(8))[0] & ((1 << 55) - 1)
                if pfn:
                    hist[pfn * 4096 >> 30] += 1
    except OSError:
        pass
    return sorted(hist.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(model=args.model, max_model_len=1024, num_threads=args.threads)
    eng = llm.engine
    _pass(eng, 64)
    rates = [_pass(eng, 64) for _ in range(args.passes)]
    mem = {line.split(":")[0]: line.split()[1] for line in open("/proc/self/smaps_rollup")
           if line.startswith(("Rss", "AnonHugePages"))}
    w = eng.runner.model.layers[0].mlp.gate_up_proj
    w = getattr(getattr(w, "qweight", None), "packed", getattr(w, "weight", None))
    spread = [] if w is None else _physical_spread(w.untyped_storage().data_ptr(),
                                                   w.untyped_storage().nbytes())
    cpus = [open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[36]
            for t in os.listdir("/proc/self/task")]
    flops, gbs = _probes(args.threads)
    print("tok/s", " ".join(f"{r:.1f}" for r in rates), f"| matmul {flops:.0f} GFLOP/s, "
          f"sum {gbs:.1f} GB/s", "| Rss", mem.get("Rss"),
          "AnonHugePages", mem.get("AnonHugePages"), "| physical GiB:pages", spread,
          "| thread CPUs", cpus, flush=True)


if __name__ == "__main__":
    main()
