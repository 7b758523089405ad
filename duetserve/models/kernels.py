"""What this CPU is fast at, measured once and cached, and the kernel policy built on it.

- `bf16_gemm_speedup()`: bfloat16 GEMM time / float32 GEMM time on a 256 x 1024 x 1024
  product (oneDNN uses AMX or AVX512-BF16 where the CPU has them, and emulates otherwise,
  where bf16 is *slower*). `--dtype auto` computes many-row steps in bfloat16 only when
  this says it pays (>= 1.3x).
- `calibrate_lowbit_rows(layer)`: for one of the model's own linears, the largest row
  count at which the low-bit kernel beats the dense path; decode steps up to that many
  rows use low-bit weights, bigger steps the dense GEMM.

Results are cached in $DUET_CACHE_DIR (~/.cache/duetserve)/cpu_kernels.json (key: CPU
model, torch version, threads, shape), so start-up measures each thing once per machine.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch

from duetserve.models.native import cache_dir, cpu_flags, cpu_name, ops
from duetserve.models.quant import KernelPolicy, QuantLinear

log = logging.getLogger("duetserve")

BF16_MIN_SPEEDUP = 1.3
_ROWS = (1, 2, 4, 8, 16, 32, 64)


def _key(*parts) -> str:
    return "|".join(str(p) for p in (cpu_name(), torch.__version__, torch.get_num_threads(),
                                      *parts))


def _cached(key: str, measure):
    path = os.path.join(cache_dir(), "cpu_kernels.json")
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(cache, f, indent=1)
            os.replace(tmp, path)
        except OSError:
            pass
    return cache[key]


def _best_of(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bf16_gemm_speedup() -> float:
    def measure() -> float:
        a = torch.randn(256, 1024)
        b = torch.randn(1024, 1024)
        ab, bb = a.bfloat16(), b.bfloat16()
        return _best_of(lambda: a @ b) / _best_of(lambda: ab @ bb)
    return float(_cached(_key("bf16_gemm_speedup"), measure))


# --dtype name -> torch dtype (the one map; the loader uses it too)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


def choose_dense_dtype(dtype: str) -> tuple[torch.dtype, str]:
    """The dtype of dense GEMMs for many-row steps, and why."""
    if dtype != "auto":
        return TORCH_DTYPES[dtype], f"--dtype {dtype}"
    speedup = bf16_gemm_speedup()
    flags = cpu_flags()
    has = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or ["no bf16 instructions"]
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, f"bf16 GEMM {speedup:.2f}x fp32 ({', '.join(has)})"
    return torch.float32, f"bf16 GEMM only {speedup:.2f}x fp32 ({', '.join(has)}): fp32"


def calibrate_lowbit_rows(layer: QuantLinear) -> int:
    """Largest row count of _ROWS up to which `layer`'s low-bit kernel is at least as fast
    as its dense path at every count measured (the first count where dense wins ends the
    search); 0 if dense wins at 1 row. Uses the layer as it is (dense copy or not).

    The two paths are timed alternately (best of 5 each, one untimed call first), so a
    load that comes and goes during the measurement slows both alike. A start-up measured
    while the machine was busy once returned 64 on a model whose crossover is 4-16 (the
    old search only stopped at a loss from 8 rows on, so one noisy win carried it on)."""
    policy = layer.policy
    kind = "dense" if layer.dense is not None else "dequant"

    def timed(x: torch.Tensor, rows: int) -> float:
        policy.lowbit_max_rows = rows
        t = time.perf_counter()
        layer(x)
        return time.perf_counter() - t

    def measure() -> int:
        best = 0
        saved = policy.lowbit_max_rows
        try:
            for m in _ROWS:
                x = torch.randn(m, layer.in_features)
                timed(x, m), timed(x, 0)            # warm-up (oneDNN builds its primitive)
                low = dense = float("inf")
                for _ in range(5):
                    low = min(low, timed(x, m))
                    dense = min(dense, timed(x, 0))
                if low > dense:
                    break
                best = m
        finally:
            policy.lowbit_max_rows = saved
        return best
    gemv = "native-v4" if ops() is not None else "torch"   # bump when kernels change
    return int(_cached(_key("lowbit_rows", layer.out_features, layer.in_features,
                            f"int{layer.qweight.bits}", kind, policy.dense_dtype, gemv),
                       measure))


def finish_policy(model: torch.nn.Module, policy: KernelPolicy) -> None:
    """Calibrate `policy.lowbit_max_rows` on the model's largest quantized linear.
    Mutates `policy` (shared by every QuantLinear)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return
    # The MLP's gate/up projection: the most common shape in a step's weight bytes.
    big = max((m for m in layers if m is not getattr(model, "lm_head", None)),
              key=lambda m: m.out_features * m.in_features, default=layers[0])
    policy.lowbit_max_rows = calibrate_lowbit_rows(big)
    policy.reason += (f"; low-bit kernels for steps of <= {policy.lowbit_max_rows} rows "
                      f"(measured on {big.out_features}x{big.in_features} "
                      f"int{big.qweight.bits}, dense path "
                      f"{'resident' if big.dense is not None else 'dequantized per call'})")
