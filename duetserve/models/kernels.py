"""What this CPU is fast at, measured once and cached, and the kernel policy built on it.

- `bf16_gemm_speedup()`: bfloat16 GEMM time / float32 GEMM time on a 256 x 1024 x 1024
  product (oneDNN uses AMX or AVX512-BF16 where the CPU has them, and emulates otherwise,
  where bf16 is *slower*). `--dtype auto` computes many-row steps in bfloat16 only when
  this says it pays (>= 1.3x).
- `calibrate_lowbit_rows(layer)`: for one of the model's own linears, the largest row
  count at which the low-bit kernel beats the dense path (a resident dense copy, or the
  weights dequantized for the call, dequantization included), measured over the row
  counts steps really have (1 to 2,048: decode batches and prefill chunks); steps up to
  that many rows use low-bit weights, bigger steps the dense GEMM; UNBOUNDED_ROWS (every
  step on the low-bit kernels) when the dense path wins at no count.
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
from collections.abc import Callable

import torch

from duetserve.config import UNBOUNDED_ROWS
from duetserve.models.native import cache_dir, cpu_flags, cpu_name, ops
from duetserve.models.quant import (Int4KWeight, Int4Weight, Int6Weight, Int8Weight,
                                    KernelPolicy, QuantLinear)

log = logging.getLogger("duetserve")

BF16_MIN_SPEEDUP = 1.3
AMX_PROBE_ROWS = 512     # rows of the AMX / dense comparison (a prefill chunk)
# Row counts of the low-bit / dense crossover: up to the largest step a derived token
# budget gives (core/step_budget.IDLE_BUDGET, 2,048; a test keeps the two equal).
LOWBIT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# best of this many timed calls up to 64 rows, of _LOWBIT_REPS_MANY above (a 2,048-row call
# on a 1.5B model's gate/up projection takes 0.1-0.4 s on 2 cores)
_LOWBIT_REPS, _LOWBIT_REPS_MANY = 5, 3
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


def _crossover(rows: tuple[int, ...], make_input, run, reps: int | Callable[[int], int],
               confirm: bool = False) -> int:
    """Largest count of `rows` up to which run(x, bound=count) (the few-row kernel) is at
    least as fast as run(x, bound=0) (the GEMM); 0 if the GEMM wins at the first.
    x = make_input(count). The two are timed alternately (best of `reps`, or of
    reps(count), each; one untimed call of each first: oneDNN builds its primitive then),
    so a load that comes and goes during the measurement slows both alike.

    Without `confirm` the first count where the GEMM wins ends the search. With it, a GEMM
    win ends the search only when the GEMM wins the next count too (at the last count:
    wins it again, measured once more); else the few-row kernel keeps both counts and the
    search goes on. So one lucky sample of the GEMM cannot cut the bound short, and one of
    the few-row kernel carries it at most one count past the real crossover."""
    def gemm_wins(count: int) -> bool:
        x = make_input(count)
        run(x, count), run(x, 0)
        t_few = t_many = float("inf")
        for _ in range(reps(count) if callable(reps) else reps):
            t_few = min(t_few, _elapsed(run, x, count))
            t_many = min(t_many, _elapsed(run, x, 0))
        return t_few > t_many

    best, i = 0, 0
    while i < len(rows):
        if not gemm_wins(rows[i]):
            best, i = rows[i], i + 1
            continue
        if not confirm:
            break
        again = rows[min(i + 1, len(rows) - 1)]       # the next count, or the last again
        if gemm_wins(again):
            break
        best, i = again, i + 2
    return best


def _elapsed(run, x, bound: int) -> float:
    t = time.perf_counter()
    run(x, bound)
    return time.perf_counter() - t


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
    """The most rows a step may have for `layer`'s low-bit kernel to run it rather than its
    dense path (the layer as it is: a resident dense copy, or the weights dequantized for
    the call; both timed as whole calls, so the dequantization is priced). Timed at
    LOWBIT_ROWS by `_crossover` with confirmation (best of 5 up to 64 rows, of 3 above):
    the last count before the dense path wins two counts in a row; 0 if that starts at 1
    row; UNBOUNDED_ROWS when it never does. The low-bit kernels' time grows with the rows
    (each row's products are its own), so a step past 2,048 rows on them costs what its
    chunks would; the dense path's there is not measured.

    A start-up measured while the machine was busy once returned 64 on a model whose
    crossover is 4-16; and on the 1.5B Q4_K_M the old search, which stopped at 64 rows,
    sent 512-row prefill steps to the dense path 2.8x slower than eight 64-row chunks on
    the low-bit kernels (issue 67)."""
    policy = layer.policy
    kind = ("amx" if policy.many_rows == "amx" and layer.qweight.amx else
            "dense" if layer.dense is not None else "dequant")

    def run(x: torch.Tensor, lowbit_rows: int) -> None:
        policy.lowbit_max_rows = lowbit_rows
        layer(x)

    @torch.inference_mode()
    def measure() -> int:
        saved = policy.lowbit_max_rows
        try:
            return _crossover(LOWBIT_ROWS, lambda m: torch.randn(m, layer.in_features), run,
                              lambda m: _LOWBIT_REPS if m <= 64 else _LOWBIT_REPS_MANY,
                              confirm=True)
        finally:
            policy.lowbit_max_rows = saved
    gemv = "native-v16" if ops() is not None else "torch"   # bump when kernels change
    rows = int(_cached(_key("lowbit_rows", layer.out_features, layer.in_features,
                            f"int{layer.qweight.bits}", kind, policy.dense_dtype, gemv,
                            f"upto{LOWBIT_ROWS[-1]}-confirmed"), measure))
    return UNBOUNDED_ROWS if rows >= LOWBIT_ROWS[-1] else rows


def amx_speedup(layer: QuantLinear) -> float:
    """Time of `layer` at AMX_PROBE_ROWS rows on its dense path (a resident dense copy, or
    the weights dequantized for the call) / on AMX bf16 tiles: above 1, AMX is faster.
    The two are timed alternately, best of 3 each (a load that comes and goes slows both
    alike). Measured once per CPU, thread count and shape."""
    policy = layer.policy
    kind = "dense" if layer.dense is not None else "dequant"

    @torch.inference_mode()
    def measure() -> float:
        saved = policy.lowbit_max_rows, policy.many_rows
        x = torch.randn(AMX_PROBE_ROWS, layer.in_features)
        best = {"amx": float("inf"), "dense": float("inf")}
        try:
            policy.lowbit_max_rows = 0
            for i in range(4):
                for path in best:
                    policy.many_rows = path
                    t = time.perf_counter()
                    layer(x)
                    if i:               # the first call of each builds oneDNN's primitive
                        best[path] = min(best[path], time.perf_counter() - t)
        finally:
            policy.lowbit_max_rows, policy.many_rows = saved
        return round(best["dense"] / best["amx"], 3)
    return float(_cached(_key("amx_speedup", layer.out_features, layer.in_features,
                              f"int{layer.qweight.bits}", kind, policy.dense_dtype,
                              AMX_PROBE_ROWS, "native-v1"), measure))


def choose_many_rows(layer: QuantLinear, amx: bool) -> tuple[str, str]:
    """The many-row path ("amx" or "dense") for the model's linears, and why: AMX bf16
    tiles where the native kernels have them, EngineConfig.amx allows them and
    `amx_speedup` finds them faster than the dense path on `layer`."""
    native = ops()
    if not amx:
        return "dense", "--no-amx"
    if native is None or not native.amx_available():
        return "dense", "no AMX (CPU flags, compiler or kernel permission)"
    if not layer.qweight.amx:
        return "dense", f"no AMX kernel for int{layer.qweight.bits} weights"
    speedup = amx_speedup(layer)
    if speedup > 1.0:
        return "amx", f"AMX bf16 tiles, {speedup:.2f}x the dense path at {AMX_PROBE_ROWS} rows"
    return "dense", f"dense path, AMX bf16 tiles only {speedup:.2f}x it at {AMX_PROBE_ROWS} rows"


def bf16_attention_kernel(policy: KernelPolicy, heads: int, kv_heads: int,
                          head_dim: int) -> str | None:
    """Which bfloat16 prompt attention this build and CPU offer for these heads: "native"
    (the AVX512-BF16 kernel, csrc/prefill_attention.cpp, where it covers the head size),
    "torch" (torch's bf16 flash SDPA, oneDNN's AMX tiles: only where the many-row steps
    run on AMX), or None."""
    native = ops()
    if native is not None and native.bf16_attention_available():
        one = [torch.zeros(1, h, head_dim) for h in (heads, kv_heads, kv_heads)]
        if native.prefill_attention_bf16(*one, 1.0).numel():
            return "native"
    return "torch" if policy.many_rows == "amx" else None


def bf16_attention_speedup(heads: int, kv_heads: int, head_dim: int,
                           kernel: str = "torch") -> float:
    """Time of the float32 causal prefill attention this engine runs on a fresh
    AMX_PROBE_ROWS-token chunk (the native kernel where built, else torch's flash SDPA) /
    the same chunk in bfloat16 (`kernel` "native": csrc's vdpbf16ps kernel; "torch": torch's
    flash SDPA, oneDNN's AMX tiles). Best of 3, alternated. Measured once per CPU, thread
    count, head shape and kernel."""
    import torch.nn.functional as F

    def measure() -> float:
        n = AMX_PROBE_ROWS
        q, k, v = (torch.randn(n, h, head_dim) for h in (heads, kv_heads, kv_heads))
        native = ops()
        gqa = heads != kv_heads
        scale = head_dim ** -0.5

        def sdpa(dtype):
            qt, kt, vt = (t.transpose(0, 1)[None].to(dtype) for t in (q, k, v))
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)

        def fp32():
            o = native.prefill_attention(q, k, v, scale) if native else None
            if o is None or o.numel() == 0:
                sdpa(torch.float32)

        def bf16():
            if kernel == "native":
                native.prefill_attention_bf16(q, k, v, scale)
            else:
                sdpa(torch.bfloat16)
        best = {"fp32": float("inf"), "bf16": float("inf")}
        for i in range(4):
            for name, fn in (("fp32", fp32), ("bf16", bf16)):
                t = time.perf_counter()
                fn()
                if i:
                    best[name] = min(best[name], time.perf_counter() - t)
        return round(best["fp32"] / best["bf16"], 3)
    return float(_cached(_key("bf16_attention_speedup", heads, kv_heads, head_dim,
                              AMX_PROBE_ROWS, kernel, "native-v2"), measure))


def finish_prefill_attention(model: torch.nn.Module, policy: KernelPolicy,
                             mode: str = "auto") -> str:
    """Prompt chunks' attention on the full-attention backends (EngineConfig.
    prefill_attention): in bfloat16 dot products (`bf16_attention_kernel`: the native
    kernel sets TorchAttention.bf16_kernel, every chunk with or without cached context;
    torch's sets TorchAttention.bf16_prefill, its flash calls in bf16) when `mode` is
    "bfloat16", or "auto" and `bf16_attention_speedup` finds it faster; else float32.
    Sliding-window backends stay float32. Mutates the backends. Returns the reason ("" for
    a model without full-attention backends)."""
    from duetserve.models.attention import TorchAttention
    backends = {id(b): b for m in model.modules()
                if isinstance(b := getattr(m, "backend", None), TorchAttention)
                and b.window is None}
    if not backends:
        return ""
    b = next(iter(backends.values()))
    kernel = bf16_attention_kernel(policy, b.num_heads, b.num_kv_heads, b.head_dim)
    if mode == "float32" or kernel is None:
        use, why = False, ("--prefill-attention float32" if mode == "float32" else
                           "no bf16 kernel here for these heads (AVX512-BF16 or AMX)")
    elif mode == "bfloat16":
        use, why = True, "--prefill-attention bfloat16"
    else:
        speedup = bf16_attention_speedup(b.num_heads, b.num_kv_heads, b.head_dim, kernel)
        use = speedup > 1.0
        why = f"{kernel} bf16 kernel {speedup:.2f}x float32 at {AMX_PROBE_ROWS} tokens"
    native = ops()
    for b in backends.values():
        b.bf16_kernel = native.prefill_attention_bf16 if use and kernel == "native" else None
        b.bf16_prefill = use and kernel == "torch"
    return f"prompt attention in {'bf16' if use else 'float32'} ({why})"


def finish_policy(model: torch.nn.Module, policy: KernelPolicy, amx: bool = True,
                  prefill_attention: str = "auto") -> None:
    """Choose the many-row path (`choose_many_rows`), then calibrate
    `policy.lowbit_max_rows` against it on the model's largest quantized linear, then
    the prompt attention's dtype (`finish_prefill_attention`, `prefill_attention` its mode),
    and say what was decided and why in `policy.reason` (the start-up log's kernel line).
    Mutates `policy` (shared by every QuantLinear) and the attention backends."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return
    # The MLP's gate/up projection: the most common shape in a step's weight bytes.
    big = max((m for m in layers if m is not getattr(model, "lm_head", None)),
              key=lambda m: m.out_features * m.in_features, default=layers[0])
    policy.many_rows, why = choose_many_rows(big, amx)
    policy.reason += f"; many-row steps: {why}"
    rows = policy.lowbit_max_rows = calibrate_lowbit_rows(big)
    many = ("AMX tiles" if policy.many_rows == "amx" else
            "dense path, resident" if big.dense is not None else
            "dense path, dequantized per call")
    measured = (f"measured on {big.out_features}x{big.in_features} int{big.qweight.bits} "
                f"at 1..{LOWBIT_ROWS[-1]} rows")
    if rows >= UNBOUNDED_ROWS:
        policy.reason += (f"; low-bit kernels at every step size (faster than the many-row "
                          f"path, {many}, at every row count {measured})")
    elif rows == 0:
        policy.reason += (f"; many-row path ({many}) at every step size (faster than the "
                          f"low-bit kernels from 1 row, {measured})")
    else:
        policy.reason += (f"; low-bit kernels for steps of <= {rows} rows, many-row path "
                          f"({many}) above (faster there, {measured})")
    attention = finish_prefill_attention(model, policy, prefill_attention)
    if attention:
        policy.reason += f"; {attention}"


def make_row_invariant(model: torch.nn.Module, policy: KernelPolicy | None) -> str:
    """Deterministic mode (EngineConfig.deterministic): every row-count switch of the
    model's kernels is lifted, so each row of a step is computed by the same per-row
    kernel, in the same order, whatever the step's rows: low-bit linears always run their
    GEMVs (activations quantized per row and group, sums in a fixed order), float32
    linears the native GEMV, MLP activations and MoE routers their fused per-row ops. The
    worker lays prompt tokens out as decode rows of the paged attention (one row's sum over
    its context in a fixed order). Mutates `policy`, the model's modules and its
    `dense_gemv_rows`. Returns the reason for the log line."""
    from duetserve.models.layers import DenseLinear, GatedMLP
    from duetserve.models.moe import MoEFFN
    if policy is not None:
        policy.lowbit_max_rows = UNBOUNDED_ROWS
        policy.reason += "; deterministic: low-bit kernels at every step size"
    for m in model.modules():
        if type(m) is DenseLinear:
            m.gemv_rows = UNBOUNDED_ROWS
        elif isinstance(m, GatedMLP):
            m.act_rows = UNBOUNDED_ROWS
        elif isinstance(m, MoEFFN):
            m.router_rows = UNBOUNDED_ROWS
    if hasattr(model, "dense_gemv_rows"):
        model.dense_gemv_rows = UNBOUNDED_ROWS
    return "deterministic: per-row kernels (GEMVs, fused activations) at every step size"


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
    (low-bit GEMVs: the policies' `lowbit_max_rows`, UNBOUNDED_ROWS when they run every
    step; float32 linears: the native GEMV's `dense_gemv_rows`); above it they run dense
    GEMMs. The one place the simulator's cost model (core/step_time.Layout.few_rows,
    engine/step_probe.py) reads the engine's kernel switch from."""
    limits = {m.policy.lowbit_max_rows for m in model.modules() if isinstance(m, QuantLinear)}
    if limits:
        return min(limits)
    return int(getattr(model, "dense_gemv_rows", 0) or 0)


_COMPUTE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compute_by_rows(model: torch.nn.Module) -> Callable[[int], str]:
    """A step's rows -> the number type its linear layers multiply in (a key of
    metrics/hardware's peak table: the peak the step's MFU is against). Low-bit linears:
    "int8" up to the few-row limit (the GEMVs quantize activations to int8 and sum int8
    products; without native kernels they multiply dequantized float32), above it "bf16"
    on AMX tiles or the dense GEMMs' dtype. Float linears: their weights' dtype."""
    policy = next((m.policy for m in model.modules() if isinstance(m, QuantLinear)), None)
    if policy is None:
        weight = next((m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)),
                      None)
        key = _COMPUTE_KEYS.get(weight.dtype if weight is not None else torch.float32, "fp32")
        return lambda rows: key
    few = few_row_limit(model)
    small = "int8" if ops() is not None else "fp32"
    large = "bf16" if policy.many_rows == "amx" else _COMPUTE_KEYS.get(policy.dense_dtype,
                                                                      "fp32")
    return lambda rows: small if rows <= few else large
