"""Two or more builds of csrc/lowbit_gemv.cpp against each other on the 1.5B's one-row
GEMVs in model order (random weights in its forms: per layer qkv int8 / int4k, o int4k,
gate_up int4k, down int6 / int4k, alternating as in the Q4_K_M file, then the int6 LM head;
1,018 MB in 2 MiB pages), with an rms_norm, an add and every fourth call a paged
attention between calls as a decode step has. The builds run interleaved, round after
round, so the machine's memory speed (which moves 30-50% within minutes on these VMs)
meets them alike; outputs must equal the first build's bit for bit. Prints each build's
median and the per-round ratio of the second to the first.

    .venv/bin/python benchmarks/gemv_sequence_ab.py A.cpp B.cpp [--rounds 31]

(A.cpp, B.cpp: copies of duetserve/csrc/lowbit_gemv.cpp with the change under test; they
include "simd_sum.h", so keep them beside it or copy that header along.)
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import torch
from torch.utils import cpp_extension

from duetserve.models.kernels import probe_forms
from duetserve.models.native import ops

_BIND = """#include <torch/extension.h>
torch::Tensor q4k_gemv(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q6_gemv(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q8_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto ng = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("q4k_gemv", &q4k_gemv, ng); m.def("q6_gemv", &q6_gemv, ng);
  m.def("q8_gemv", &q8_gemv, ng);
}
"""


def _build(path: str, i: int, bind: str):
    src = os.path.abspath(path)
    out = os.path.join(os.path.dirname(bind), f"build{i}")
    os.makedirs(out, exist_ok=True)
    return cpp_extension.load(name=f"gemv_ab_{i}", sources=[bind, src], build_directory=out,
                              extra_include_paths=[os.path.dirname(src)],
                              extra_cflags=["-O3", "-march=native", "-fopenmp"],
                              extra_ldflags=["-fopenmp"])


def _sequence() -> list:
    g = torch.Generator().manual_seed(0)
    seq = []
    for layer in range(28):
        seq.append(probe_forms(2048, 1536, g)["int8" if layer % 2 == 0 else "int4k"])
        seq.append(probe_forms(1536, 1536, g)["int4k"])
        seq.append(probe_forms(17920, 1536, g)["int4k"])
        seq.append(probe_forms(1536, 8960, g)["int6" if layer % 2 == 0 else "int4k"])
    seq.append(probe_forms(151936, 1536, g)["int6"])
    # one 2 MiB-page arena, as the loader places weights
    hp = 2 << 20
    total = sum(-(-w.packed.numel() // 64) * 64 for w in seq)
    area = mmap.mmap(-1, total + 2 * hp, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)
    cur = (-raw.data_ptr()) % hp
    area.madvise(mmap.MADV_HUGEPAGE, cur, total)
    for w in seq:
        p = w.packed
        v = raw[cur:cur + p.numel()].view(p.dtype).view(p.shape)
        v.copy_(p)
        w.packed = v
        cur += -(-p.numel() // 64) * 64
    seq.append(area)      # keeps the mapping alive with the list
    return seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="gemv_ab_")
    bind = os.path.join(tmp, "bind.cpp")
    with open(bind, "w") as f:
        f.write(_BIND)
    exts = [_build(b, i, bind) for i, b in enumerate(args.builds)]
    *seq, _area = _sequence()
    nbytes = sum(w.nbytes for w in seq)
    xs = {k: torch.randn(1, k) for k in (1536, 8960)}
    nat = ops()
    kc, vc = torch.randn(2, 64, 16, 128), torch.randn(2, 64, 16, 128)
    q, tables = torch.randn(1, 12, 128), torch.arange(64).view(1, -1)
    lens, norm, h = torch.tensor([100]), torch.randn(1536), torch.randn(1, 1536)

    def run(ext) -> list:
        out = []
        for i, w in enumerate(seq):
            if nat is not None:       # the small ops between a decode step's GEMVs
                nat.rms_norm(h, norm, 1e-6)
                if i % 4 == 1:
                    nat.paged_decode_attention(q, kc, vc, tables, lens, 0.088)
            h + h
            x = xs[w.shape[1]]
            kind = type(w).__name__
            if kind == "Int8Weight":
                out.append(ext.q8_gemv(x, w.packed, w.scale32))
            elif kind == "Int4KWeight":
                out.append(ext.q4k_gemv(x, w.packed, w.shape[0]))
            else:
                out.append(ext.q6_gemv(x, w.packed, w.shape[0]))
        return out

    ref = run(exts[0])
    for b, ext in zip(args.builds[1:], exts[1:]):
        bad = sum(not torch.equal(a, c) for a, c in zip(ref, run(ext)))
        print(f"{b}: {bad} of {len(ref)} outputs differ from {args.builds[0]}'s")
    times: list[list[float]] = [[] for _ in exts]
    for _ in range(args.rounds):
        for i, ext in enumerate(exts):
            run(ext)
            t = time.perf_counter()
            for _ in range(3):
                run(ext)
            times[i].append((time.perf_counter() - t) / 3)
    for b, ts in zip(args.builds, times):
        t = statistics.median(ts)
        print(f"{b}: {t * 1e3:.2f} ms, {nbytes / t / 1e9:.1f} GB/s (median of {len(ts)}); "
              "rounds " + " ".join(f"{x * 1e3:.1f}" for x in ts))
    for b, ts in zip(args.builds[1:], times[1:]):
        r = [y / x for x, y in zip(times[0], ts)]
        print(f"{b} / {args.builds[0]} per round: median {statistics.median(r):.3f} ("
              + " ".join(f"{v:.3f}" for v in r) + ")")


if __name__ == "__main__":
    main()
