"""Time whole engine steps of a known model on a GPU, and fit sim/gpu.py's efficiency
factors (MFU, MBU, per-step overhead) to them.

    python3 benchmarks/gpu_step_probe.py run --model llama-3-8b --out probe.json   # GPU
    python benchmarks/gpu_step_probe.py fit probe.json --hardware h200             # anywhere

`run` builds the model's layers with random bf16 weights (no checkpoint is needed: the
time of a step does not depend on the values) and times the steps a vLLM-class engine
runs: prefills of T tokens after c cached, decode batches of B sequences at context c, and
mixed steps (a prefill chunk beside B decodes). Each step is what such an engine does:
embedding rows, per layer RMSNorm, a fused QKV GEMM, rotary, the KV write into a cache,
attention (torch SDPA: causal with the diagonal at the bottom right for a chunk after
context, grouped-query heads as extra query rows for decodes), the output GEMM, RMSNorm,
the fused gate/up GEMM, SiLU-and-multiply, the down GEMM; then the final norm, the LM head
on the sampled rows only and an argmax. Every step is timed eager and replayed as a CUDA
graph (what vLLM does for decode batches), median of `--reps` after warm-up, with CUDA
events. The run also measures the card's two ceilings (a device copy, an 8192^3 bf16
GEMM) so efficiency can be read against the datasheet and against what the card reaches.

`fit` predicts every timed step with sim/gpu.py's roofline (the shape from the step's
(new, cached, sampled) items, FLOPs and bytes from metrics/cost_model.py), first with the
stated default efficiency, then with the MFU, MBU and step overhead that minimise the
squared log error, and prints both tables. Writes nothing unless --out is given.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFILLS = [(64, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0),
            (512, 2048), (512, 8192), (2048, 4096)]
DECODES = [(1, 256), (1, 4096), (4, 1024), (16, 256), (16, 1024), (16, 4096),
           (64, 256), (64, 1024), (64, 4096), (128, 1024), (256, 256), (256, 1024)]
MIXED = [(512, 0, 16, 1024), (512, 0, 64, 1024), (256, 2048, 64, 1024), (2048, 0, 64, 256)]


# ---------------------------------------------------------------------------- run (GPU)

def rope(torch, x, cos, sin):
    """Rotary (rotate-half form) of x [N, heads, D] with cos, sin [N, 1, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Stack:
    """Random bf16 layers of `cfg` on `device`, and a KV cache of `kv_tokens` slots a
    layer (laid out [slot, kv head, dim]; a step's sequences take consecutive slots)."""

    def __init__(self, cfg, device, kv_tokens: int, compile: bool = False):
        import torch
        self.torch = torch
        self.cfg = cfg
        d, dt = device, torch.bfloat16
        g = torch.Generator(device=d).manual_seed(0)
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

        def w(o, i):
            return torch.randn(o, i, device=d, dtype=dt, generator=g) / math.sqrt(i)

        self.layers = [dict(qkv=w((nq + 2 * nkv) * D, H), o=w(H, nq * D), gu=w(2 * I, H),
                            down=w(H, I), n1=torch.ones(H, device=d, dtype=dt),
                            n2=torch.ones(H, device=d, dtype=dt))
                       for _ in range(cfg.num_hidden_layers)]
        self.embed = w(cfg.vocab_size, H)
        self.head = w(cfg.vocab_size, H)
        self.norm = torch.ones(H, device=d, dtype=dt)
        self.kc = [torch.randn(kv_tokens, nkv, D, device=d, dtype=dt, generator=g)
                   for _ in self.layers]
        self.vc = [torch.randn(kv_tokens, nkv, D, device=d, dtype=dt, generator=g)
                   for _ in self.layers]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, device=d).float() / D))
        ang = torch.outer(torch.arange(cfg.max_position_embeddings * 2, device=d).float(), inv)
        self.cos, self.sin = ang.cos().to(dt), ang.sin().to(dt)
        self.attn_forms: dict[str, str] = {}
        # --compile: Inductor fuses the norms, rotary, residuals and SiLU-and-multiply
        # around the GEMMs (what vLLM's compiled graphs do); the token count is dynamic.
        self.pre_attn, self.post_attn = self._pre_attn, self._post_attn
        if compile:
            self.pre_attn = torch.compile(self._pre_attn, dynamic=True)
            self.post_attn = torch.compile(self._post_attn, dynamic=True)

    def _pre_attn(self, x, n1, w_qkv, cos, sin):
        """RMSNorm, the fused QKV GEMM and rotary: (q [N, nq, D], k, v [N, nkv, D])."""
        F, cfg = self.torch.nn.functional, self.cfg
        D, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = F.rms_norm(x, (cfg.hidden_size,), n1, cfg.rms_norm_eps) @ w_qkv.t()
        q = qkv[:, :nq * D].view(-1, nq, D)
        k = qkv[:, nq * D:(nq + nkv) * D].view(-1, nkv, D)
        v = qkv[:, (nq + nkv) * D:].view(-1, nkv, D)
        return rope(self.torch, q, cos, sin), rope(self.torch, k, cos, sin), v

    def _post_attn(self, x, a, w_o, n2, w_gu, w_down):
        """The output GEMM and residual, RMSNorm, the MLP and residual: the new x."""
        F, cfg = self.torch.nn.functional, self.cfg
        x = x + a @ w_o.t()
        gu = F.rms_norm(x, (cfg.hidden_size,), n2, cfg.rms_norm_eps) @ w_gu.t()
        i = cfg.intermediate_size
        return x + (F.silu(gu[:, :i]) * gu[:, i:]) @ w_down.t()

    def prefill_attention(self, q, k, v, T: int, ctx: int):
        """q [1, nq, T, D]; k, v [1, nkv, ctx+T, D]; causal, diagonal at the bottom right.
        SDPA with grouped heads where a fused kernel takes them, else with the heads
        expanded; on a GPU the unfused math kernel is never allowed. Remembers, per kind of
        slice (fresh, after context), which form ran (`self.attn_forms`)."""
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right
        kind = "fresh" if ctx == 0 else "after_context"
        extra = {"is_causal": True} if ctx == 0 else {"attn_mask": causal_lower_right(T, ctx + T)}
        with self.no_math():
            if self.attn_forms.get(kind, "gqa") == "gqa":
                try:
                    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **extra)
                    self.attn_forms[kind] = "gqa"
                    return out
                except (RuntimeError, TypeError, NotImplementedError, ValueError):
                    if kind in self.attn_forms:
                        raise
            self.attn_forms[kind] = "expanded"
            g = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                                  v.repeat_interleave(g, 1), **extra)

    def no_math(self):
        """A context where SDPA may use only fused kernels (GPU); no restriction on CPU."""
        import contextlib
        if self.embed.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.CUDNN_ATTENTION])

    def step(self, ids, pos, slots, plan):
        """One forward over the rows `ids` (prefill rows first, then one row a decode) and
        an argmax over the sampled rows. plan = (T, ctx, B, c); the prefill takes slots
        [0, ctx+T), decode b the slots [base + b*(c+1), base + (b+1)*(c+1)). Writes the
        step's K/V into the cache slots `slots`."""
        torch, F = self.torch, self.torch.nn.functional
        T, ctx, B, c = plan
        cfg = self.cfg
        D, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        base = ctx + T
        x = self.embed[ids]
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        for li, lw in enumerate(self.layers):
            q, k, v = self.pre_attn(x, lw["n1"], lw["qkv"], cos, sin)
            self.kc[li].index_copy_(0, slots, k)
            self.vc[li].index_copy_(0, slots, v)
            outs = []
            if T:
                kp = self.kc[li][:base].transpose(0, 1).unsqueeze(0)
                vp = self.vc[li][:base].transpose(0, 1).unsqueeze(0)
                qp = q[:T].transpose(0, 1).unsqueeze(0)
                o = self.prefill_attention(qp, kp, vp, T, ctx)
                outs.append(o.squeeze(0).transpose(0, 1).reshape(T, nq * D))
            if B:
                span = slice(base, base + B * (c + 1))
                kd = self.kc[li][span].view(B, c + 1, nkv, D).transpose(1, 2)
                vd = self.vc[li][span].view(B, c + 1, nkv, D).transpose(1, 2)
                qd = q[T:].view(B, nkv, nq // nkv, D)
                with self.no_math():
                    o = F.scaled_dot_product_attention(qd, kd, vd)
                outs.append(o.reshape(B, nq * D))
            a = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = self.post_attn(x, a, lw["o"], lw["n2"], lw["gu"], lw["down"])
        rows = x[T - 1:] if T else x
        h = F.rms_norm(rows, (cfg.hidden_size,), self.norm, cfg.rms_norm_eps)
        return (h @ self.head.t()).argmax(-1)

    def inputs(self, plan):
        torch = self.torch
        T, ctx, B, c = plan
        d = self.embed.device
        base = ctx + T
        pos = [ctx + i for i in range(T)] + [c] * B
        slots = list(range(ctx, ctx + T)) + [base + b * (c + 1) + c for b in range(B)]
        ids = torch.randint(0, self.cfg.vocab_size, (T + B,), device=d)
        return (ids, torch.tensor(pos, device=d), torch.tensor(slots, device=d))


def check_attention(torch, device) -> dict:
    """The two attention layouts against a float32 reference: relative errors."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    g = torch.Generator(device=device).manual_seed(1)
    nq, nkv, D, T, ctx, B, c = 8, 2, 64, 24, 40, 3, 33
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    q, k, v = r(1, nq, T, D), r(1, nkv, ctx + T, D), r(1, nkv, ctx + T, D)
    ke, ve = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    mask = torch.ones(T, ctx + T, dtype=torch.bool, device=device).tril(ctx)
    ref = F.scaled_dot_product_attention(q.double(), ke.double(), ve.double(), attn_mask=mask)
    bf = torch.bfloat16
    got = F.scaled_dot_product_attention(q.to(bf), k.to(bf), v.to(bf),
                                         attn_mask=causal_lower_right(T, ctx + T),
                                         enable_gqa=True)
    qd, kd, vd = r(B, nq, D), r(B, nkv, c, D), r(B, nkv, c, D)
    refd = F.scaled_dot_product_attention(
        qd.double().unsqueeze(2), kd.double().repeat_interleave(nq // nkv, 1),
        vd.double().repeat_interleave(nq // nkv, 1)).squeeze(2)
    gotd = F.scaled_dot_product_attention(qd.to(bf).view(B, nkv, nq // nkv, D), kd.to(bf),
                                          vd.to(bf)).reshape(B, nq, D)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    return {"prefill_rel_err": rel(got, ref), "decode_rel_err": rel(gotd, refd)}


def check_or_error(torch, device) -> dict:
    try:
        return check_attention(torch, device)
    except Exception as e:              # noqa: BLE001 - report, and time the steps anyway
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def time_ms(torch, fn, warm: int, reps: int) -> float:
    """Median of `reps` timed calls after `warm`: CUDA events on a GPU, the host clock on
    the CPU (the --smoke run)."""
    for _ in range(warm):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if not cuda:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def graph_time(torch, fn, reps: int) -> tuple[float | None, str | None]:
    """(median replay ms, None) of `fn` captured as a CUDA graph; (None, the error) when
    capture fails (the eager time then stands alone)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return time_ms(torch, graph.replay, 2, reps), None
    except RuntimeError as e:
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def ceilings(torch, reps: int) -> dict:
    n = 1 << 30                                  # 1 Gi bf16 elements = 2 GiB
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = time_ms(torch, lambda: b.copy_(a), 3, reps)
    copy = 2 * 2 * n / (ms / 1e3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(torch, lambda: x @ y, 3, reps)
    return {"copy_bytes_per_s": copy, "gemm_flops_per_s": 2 * m ** 3 / (ms / 1e3)}


def items_of(plan) -> list[tuple[int, int, bool]]:
    T, ctx, B, c = plan
    return ([(T, ctx, True)] if T else []) + [(1, c, True)] * B


def with_layers(cfg, layers: int | None):
    """`cfg` with its first `layers` layers only (a model too large for one device is probed
    on part of its stack: the roofline then predicts that part, the LM head included)."""
    from dataclasses import replace
    return cfg if not layers else replace(cfg, num_hidden_layers=layers)


def cmd_run(args) -> int:
    import torch
    from duetserve.metrics.known_models import get_known_model
    cfg = with_layers(get_known_model(args.model), args.layers)
    if args.smoke:         # the code path on the CPU, tiny shapes: no figures worth keeping
        device, plans = "cpu", [(16, 0, 0, 0), (8, 16, 0, 0), (0, 0, 3, 20), (8, 4, 2, 9)]
    elif torch.cuda.is_available():
        device = "cuda"
        plans = ([(T, c, 0, 0) for T, c in PREFILLS] + [(0, 0, B, c) for B, c in DECODES]
                 + list(MIXED))
    else:
        print("gpu_step_probe run needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    kv_tokens = max(ctx + T + B * (c + 1) for T, ctx, B, c in plans)
    t0 = time.time()
    out = {"model": args.model, "layers": cfg.num_hidden_layers, "torch": torch.__version__,
           "reps": args.reps,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
           "check": check_or_error(torch, device),
           "ceilings": ceilings(torch, args.reps) if device == "cuda" else None}
    print(json.dumps({k: out[k] for k in ("device", "torch", "check", "ceilings")}), flush=True)
    stack = Stack(cfg, device, kv_tokens, compile=args.compile)
    out["compile"] = args.compile
    if device == "cuda":
        torch.cuda.synchronize()
    out["build_s"] = time.time() - t0
    rows = []
    with torch.inference_mode():
        for plan in plans:
            ids, pos, slots = stack.inputs(plan)
            eager = time_ms(torch, lambda: stack.step(ids, pos, slots, plan), 2, args.reps)
            graph_ms, err = (graph_time(torch, lambda: stack.step(ids, pos, slots, plan),
                                        args.reps) if device == "cuda"
                             else (None, "no CUDA graphs on the CPU"))
            row = {"plan": list(plan), "items": items_of(plan), "eager_ms": eager,
                   "graph_ms": graph_ms, "graph_error": err}
            rows.append(row)
            print(f"T={plan[0]:5d} ctx={plan[1]:5d} B={plan[2]:4d} c={plan[3]:5d}  "
                  f"eager {eager:8.3f} ms  graph "
                  f"{'-' if graph_ms is None else f'{graph_ms:8.3f}'} ms", flush=True)
    out["prefill_attention"] = stack.attn_forms
    out["steps"] = rows
    out["wall_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


# ---------------------------------------------------------------------------- fit (CPU)

def cmd_fit(args) -> int:
    from dataclasses import asdict
    from duetserve.metrics.cost_model import step_work
    from duetserve.metrics.hardware import get_hardware
    from duetserve.metrics.known_models import get_known_model
    from duetserve.core.step_time import StepShape
    from duetserve.sim.gpu import GPU_LAYOUT, efficiency_for, fit_efficiency, roofline_cost
    data = json.loads(Path(args.probe).read_text())
    cfg = with_layers(get_known_model(data["model"]), data.get("layers"))
    hw = get_hardware(args.hardware)
    base = efficiency_for(args.hardware)
    key = "graph_ms" if args.timing == "graph" else "eager_ms"
    steps = [s for s in data["steps"] if s.get(key)]
    ceil = data["ceilings"] or {"copy_bytes_per_s": math.nan, "gemm_flops_per_s": math.nan}
    print(f"{data['device']}, torch {data['torch']}; attention check {data['check']}")
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s "
          f"({ceil['copy_bytes_per_s'] / hw.mem_bandwidth:.2f} of {hw.mem_bandwidth / 1e12:g}), "
          f"bf16 GEMM {ceil['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s "
          f"({ceil['gemm_flops_per_s'] / hw.peak('bf16'):.2f} of {hw.peak('bf16') / 1e12:g})")
    default = roofline_cost(cfg, hw, base)
    shapes = [StepShape.of(((n, c, int(sampled)) for n, c, sampled in s["items"]), GPU_LAYOUT)
              for s in steps]
    caps = {}
    if data["ceilings"]:
        caps = {"mfu_max": round(ceil["gemm_flops_per_s"] / hw.peak("bf16"), 2),
                "mbu_max": round(ceil["copy_bytes_per_s"] / hw.mem_bandwidth, 2)}
    fitted, rms = fit_efficiency(default, shapes, [s[key] / 1e3 for s in steps], **caps)
    print(f"\n{key} against the roofline; default {default.describe()}; fitted "
          f"{fitted.describe()} (caps {caps or 'none'})")
    print(f"{'T':>5} {'ctx':>5} {'B':>4} {'c':>5} | {'meas ms':>8} {'eager':>8} | "
          f"{'default':>8} {'ratio':>6} | {'fitted':>8} {'ratio':>6} | {'MFU':>5} {'MBU':>5}")
    table = []
    for s, sh in zip(steps, shapes):
        pd, pf = default.seconds(sh) * 1e3, fitted.seconds(sh) * 1e3
        c = step_work(cfg, [(n, k) for n, k, _ in s["items"]], num_logits=len(s["items"]))
        sec = s[key] / 1e3
        mfu, mbu = c.flops / sec / hw.peak("bf16"), c.bytes / sec / hw.mem_bandwidth
        T, ctx, B, cc = s["plan"]
        print(f"{T:5d} {ctx:5d} {B:4d} {cc:5d} | {s[key]:8.3f} {s['eager_ms']:8.3f} | "
              f"{pd:8.3f} {pd / s[key]:6.2f} | {pf:8.3f} {pf / s[key]:6.2f} | "
              f"{mfu:5.2f} {mbu:5.2f}")
        table.append({"plan": s["plan"], "measured_ms": s[key], "eager_ms": s["eager_ms"],
                      "default_ms": pd, "fitted_ms": pf, "mfu": mfu, "mbu": mbu})
    d0 = [math.log(r["default_ms"] / r["measured_ms"]) for r in table]
    print(f"\nrms log error: default {math.sqrt(sum(x * x for x in d0) / len(d0)):.3f}, "
          f"fitted {rms:.3f}  (mfu/mbu per row: the step's FLOPs and bytes over the "
          f"datasheet peaks)")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "probe": args.probe, "hardware": args.hardware, "timing": key,
            "default": asdict(base),
            "fitted": {"mfu": fitted.mfu, "mbu": fitted.mbu,
                       "step_overhead_ms": fitted.step_overhead_s * 1e3},
            "rms_log_error": rms,
            "steps": table}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time steps on the CUDA device")
    r.add_argument("--model", default="llama-3-8b")
    r.add_argument("--reps", type=int, default=15)
    r.add_argument("--layers", type=int, default=None,
                   help="build only the first N layers (a model larger than the device)")
    r.add_argument("--out", required=True)
    r.add_argument("--compile", action="store_true",
                   help="torch.compile the code around the GEMMs and attention")
    r.add_argument("--smoke", action="store_true",
                   help="run the code path on the CPU at tiny shapes (no figures)")
    f = sub.add_parser("fit", help="roofline predictions against a probe's times")
    f.add_argument("probe")
    f.add_argument("--hardware", default="h200")
    f.add_argument("--timing", choices=("graph", "eager"), default="graph")
    f.add_argument("--out")
    args = ap.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_fit(args)


if __name__ == "__main__":
    sys.exit(main())
