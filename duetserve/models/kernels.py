"""What this CPU is fast at, measured once and cached, and the kernel policy built on it.

- `bf16_gemm_speedup()`: bfloat16 GEMM time / float32 GEMM time on a 256 x 1024 x 1024
  product (oneDNN uses AMX or AVX512-BF16 where the CPU has them, and emulates otherwise,
  where bf16 is *slower*). `--dtype auto` computes many-row steps in bfloat16 only when
  this says it pays (>= 1.3x).
- `calibrate_lowbit_rows(layer)`: for one of the model's own linears, the largest row
  count at which the low-bit kernel beats the dense path; decode steps up to that many
  rows use low-bit weights, bigger steps the dense GEMM.
- `exact_kquant_forms()`: whether GGUF Q4_K and Q6_K weights run faster in their exact
  packed forms (int4k, int6: fewer bytes, more instructions a byte) than widened to int4
  with float16 scales and int8 per row: one-row GEMVs of each pair over weights read from
  DRAM. On the 2-core EPYC the widened forms won (the exact kernels run out of
  instructions before memory runs out of bytes); where compute per byte is cheaper, the
  exact ones.
- `calibrate_dense_gemv_rows(model)`: for a model's float32 linears, the largest row count
  at which the native GEMV beats oneDNN's GEMM over its own layers' weights (read from
  DRAM, as in a step); `finish_dense` sets that bound on the model.

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
from duetserve.models.quant import (Int4KWeight, Int4Weight, Int6Weight, Int8Weight,
                                    KernelPolicy, QuantLinear)

log = logging.getLogger("duetserve")

BF16_MIN_SPEEDUP = 1.3
_ROWS = (1, 2, 4, 8, 16, 32, 64)
_DENSE_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
# The dense calibration times whole layers' linears until they hold this many bytes: more
# than any L3 here, so the weights come from DRAM as in a step (SmolLM2: all 30 layers).
_DENSE_PROBE_BYTES = 256 * 2**20


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
    if key in cache:
        log.info("kernel measurement %s = %s (cached in %s)", key, cache[key], path)
    else:
        cache[key] = measure()
        log.info("kernel measurement %s = %s (measured now, cached in %s)", key, cache[key],
                 path)
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


def _crossover(rows: tuple[int, ...], make_input, run, reps: int) -> int:
    """Largest count of `rows` up to which run(x, bound=count) (the few-row kernel) is at
    least as fast as run(x, bound=0) (the GEMM) at every count measured; the first count
    where the GEMM wins ends the search; 0 if it wins at the first. x = make_input(count).
    The two are timed alternately (best of `reps` each, one untimed call of each first:
    oneDNN builds its primitive then), so a load that comes and goes during the
    measurement slows both alike."""
    def elapsed(x, bound: int) -> float:
        t = time.perf_counter()
        run(x, bound)
        return time.perf_counter() - t

    best = 0
    for count in rows:
        x = make_input(count)
        run(x, count), run(x, 0)
        t_few = t_many = float("inf")
        for _ in range(reps):
            t_few = min(t_few, elapsed(x, count))
            t_many = min(t_many, elapsed(x, 0))
        if t_few > t_many:
            break
        best = count
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


# The exact-form probe: copies of one 4096 x 2048 weight (fresh memory each) until the
# widened form holds this many bytes, more than any L3 here.
_FORM_PROBE_BYTES = 96 * 2**20


def _form_probe_seconds(weights: dict[str, object]) -> dict[str, float]:
    """Best-of-5 time of one-row GEMVs over each form's copies, the forms timed in turn
    per repeat (a load that comes and goes slows them alike)."""
    x = torch.randn(1, 2048)
    best = {name: float("inf") for name in weights}
    for _ in range(6):
        for name, copies in weights.items():
            t = time.perf_counter()
            for w in copies:
                w.matmul(x)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def probe_forms(n: int, k: int, g: torch.Generator) -> dict[str, object]:
    """One random n x k weight in each low-bit form (int4, int4k, int6, int8; values do
    not matter to the kernels' speed)."""
    q4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    codes = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g)
    half = torch.full((n, k // 256), 1e-3, dtype=torch.float16)
    return {
        "int4": Int4Weight(q4, torch.rand(n, k // 32, generator=g),
                           torch.rand(n, k // 32, generator=g)),
        "int4k": Int4KWeight(q4, codes, codes, half, half),
        "int6": Int6Weight(torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g),
                           torch.randint(-127, 128, (n, k // 16), dtype=torch.int8,
                                         generator=g), half.repeat_interleave(2, 1)),
        "int8": Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                           torch.rand(n, generator=g)),
    }


def exact_kquant_forms(choice: str = "measure") -> dict[str, float]:
    """{"Q4_K": t(int4k) / t(int4), "Q6_K": t(int6) / t(int8)} for the same weights
    (below 1: the exact form is faster here). Measured once per CPU and thread count;
    0 for both without the native kernels (plain torch dequantizes either way: the exact
    form is the nearer one). `choice` "exact" / "widened" (EngineConfig.kquant_forms)
    overrides the measurement (0 / 2)."""
    def measure() -> dict[str, float]:
        forms = probe_forms(4096, 2048, torch.Generator().manual_seed(0))
        copies = max(2, -(-_FORM_PROBE_BYTES // forms["int8"].nbytes))
        t = _form_probe_seconds({name: [w] + [_clone(w) for _ in range(copies - 1)]
                                 for name, w in forms.items()})
        return {"Q4_K": round(t["int4k"] / t["int4"], 3), "Q6_K": round(t["int6"] / t["int8"], 3)}
    if choice in ("exact", "widened"):     # an override (benchmarks compare the two)
        r = 0.0 if choice == "exact" else 2.0
        return {"Q4_K": r, "Q6_K": r}
    if ops() is None:
        return {"Q4_K": 0.0, "Q6_K": 0.0}
    return _cached(_key("exact_kquant_forms", "native-v7"), measure)


def _clone(w):
    """The same weight in fresh memory (the probe's copies must not share cache lines)."""
    out = object.__new__(type(w))
    out.__dict__.update({k: (v.clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in vars(w).items()})
    return out


def calibrate_lowbit_rows(layer: QuantLinear) -> int:
    """Largest row count of _ROWS up to which `layer`'s low-bit kernel is at least as fast
    as its dense path at every count measured (the first count where dense wins ends the
    search); 0 if dense wins at 1 row. Uses the layer as it is (dense copy or not).
    Timed by `_crossover`, best of 5. A start-up measured while the machine was busy once
    returned 64 on a model whose crossover is 4-16 (the old search only stopped at a loss
    from 8 rows on, so one noisy win carried it on)."""
    policy = layer.policy
    kind = "dense" if layer.dense is not None else "dequant"

    def run(x: torch.Tensor, lowbit_rows: int) -> None:
        policy.lowbit_max_rows = lowbit_rows
        layer(x)

    def measure() -> int:
        saved = policy.lowbit_max_rows
        try:
            return _crossover(_ROWS, lambda m: torch.randn(m, layer.in_features), run, reps=5)
        finally:
            policy.lowbit_max_rows = saved
    gemv = "native-v13" if ops() is not None else "torch"   # bump when kernels change
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


def _dense_linears(model: torch.nn.Module) -> list:
    from duetserve.models.layers import DenseLinear
    return [m for m in model.modules()
            if type(m) is DenseLinear and m.weight.dtype == torch.float32]


def calibrate_dense_gemv_rows(model: torch.nn.Module) -> int:
    """Largest row count of _DENSE_ROWS up to which the native float32 GEMV runs the
    model's layer linears at least as fast as oneDNN's GEMM (the search stops at the first
    count where oneDNN wins); 0 if oneDNN wins at 1 row. Timed over the first layers'
    linears holding _DENSE_PROBE_BYTES, by `_crossover`, best of 3.

    Measured on the AMD EPYC (Zen 4), 2 threads, SmolLM2-135M's float32 weights: the GEMV
    wins up to 16 rows on the gate/up projection and 4 on the down projection, and over
    whole layers up to 12; it reads the weights once for up to 4 rows at a time."""
    from duetserve.models.layers import dense_linear
    linears = [m for m in _dense_linears(model) if m is not getattr(model, "lm_head", None)]
    probe, nbytes = [], 0
    for m in linears:
        if nbytes >= _DENSE_PROBE_BYTES:
            break
        probe.append(m)
        nbytes += m.weight.numel() * 4

    def run(xs: dict, gemv_rows: int) -> None:
        for m in probe:
            dense_linear(xs[m.in_features], m.weight.detach(), None, gemv_rows)

    def inputs(rows: int) -> dict:
        return {k: torch.randn(rows, k) for k in {m.in_features for m in probe}}

    @torch.inference_mode()
    def measure() -> int:
        return _crossover(_DENSE_ROWS, inputs, run, reps=3)
    if not probe or ops() is None:
        return 0
    shapes = sorted({tuple(m.weight.shape) for m in probe})
    return int(_cached(_key("dense_gemv_rows", shapes, len(probe), "native-v1"), measure))


def finish_dense(model: torch.nn.Module) -> str:
    """Set the float32 GEMV's row bound (calibrate_dense_gemv_rows) on every float32
    DenseLinear and on the model (its tied LM head and decode stack). Mutates `model`.
    Returns the reason for the log line ("" without float32 linears or native kernels)."""
    linears = _dense_linears(model)
    if not linears or ops() is None:
        return ""
    rows = calibrate_dense_gemv_rows(model)
    for m in linears:
        m.gemv_rows = rows
    if hasattr(model, "dense_gemv_rows"):
        model.dense_gemv_rows = rows
    return f"float32 linears: native GEMV up to {rows} rows, oneDNN GEMM above (measured)"


def few_row_limit(model: torch.nn.Module) -> int:
    """The most rows a step may have for this model's linears to run their few-row kernels
    (low-bit GEMVs: the policies' `lowbit_max_rows`; float32 linears: the native GEMV's
    `dense_gemv_rows`); above it they run dense GEMMs. The one place the simulator's cost
    model (core/step_time.Layout.few_rows, engine/step_probe.py) reads the engine's kernel
    switch from."""
    limits = {m.policy.lowbit_max_rows for m in model.modules() if isinstance(m, QuantLinear)}
    if limits:
        return min(limits)
    return int(getattr(model, "dense_gemv_rows", 0) or 0)
