"""`duet roofline`: where prefill and decode of a model sit on a device's roofline.

`analyse(...)` returns a plain dict (also printed by `--json`); `main(args)` formats it.
Attainable FLOP/s = min(peak, AI x bandwidth); a phase is compute bound when its
arithmetic intensity (AI, FLOP/byte) is at or above the ridge point peak / bandwidth.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from duetserve.config import ConfigError, ModelConfig
from duetserve.metrics.cost_model import (COMPUTE_DTYPE_OF, StepWork, bits_per_weight,
                                          decode_step, expert_read_fraction, kv_bytes_held,
                                          kv_bytes_per_token, normalise_dtype, param_count,
                                          prefill_step, step_work)
from duetserve.metrics.hardware import HardwareProfile, get_hardware, hardware_names
from duetserve.metrics.known_models import KNOWN_MODELS, get_known_model

_FLOAT_KV = ("f32", "f16", "bf16", "fp8")
NOTES = ("activations are not counted in bytes; norms/RoPE/softmax/activation functions are "
         "not counted in FLOPs",
         "each request's KV context is read once per step (at most the window in a "
         "sliding-window layer); new tokens' K/V are written in every layer",
         "MoE: FLOPs follow the active parameters (router, top-k experts, shared expert); a "
         "step reads E*(1-(1-k/E)^rows) experts a layer (uniform, independent routing)",
         "prefill is one prompt from an empty cache; decode is `batch` requests at context_len")


def _phase(cost: StepWork, hw: HardwareProfile, peak: float, new_tokens: int) -> dict:
    """Return the roofline point of one step: AI, attainable FLOP/s, bound, time, tokens/s."""
    ridge = peak / hw.mem_bandwidth
    time_s = max(cost.flops / peak, cost.bytes / hw.mem_bandwidth)
    return {"tokens": new_tokens, "flops": cost.flops, "bytes": cost.bytes,
            "weight_bytes": cost.weight_bytes, "kv_read_bytes": cost.kv_read_bytes,
            "kv_write_bytes": cost.kv_write_bytes, "ai": cost.ai,
            "attainable_flops": min(peak, cost.ai * hw.mem_bandwidth),
            "bound": "compute" if cost.ai >= ridge else "memory",
            "time_s": time_s, "tokens_per_s": new_tokens / time_s if time_s else 0.0}


def ridge_crossing_batch(cfg: ModelConfig, context_len: int, ridge: float,
                         **dtypes: str | float | None) -> tuple[int | None, float]:
    """Return (smallest decode batch whose AI >= ridge or None, AI limit as batch -> inf).

    Decode cost is affine in the batch but for the experts a MoE step reads:
    flops = F0 + B*F, bytes = W + B*K + X * frac(B), with X all experts' bytes and
    frac(B) = cost_model.expert_read_fraction (concave, from k/E at B = 1 to 1), so AI(B)
    rises towards F/K: never reached when F <= ridge*K, else found by bisection.
    """
    c1 = step_work(cfg, decode_step(1, context_len), **dtypes)
    c2 = step_work(cfg, decode_step(2, context_len), **dtypes)
    x1 = dict(c1.byte_terms).get("weights.experts", 0.0)
    x2 = dict(c2.byte_terms).get("weights.experts", 0.0)
    f, k = c2.flops - c1.flops, (c2.bytes - x2) - (c1.bytes - x1)
    f0, w = c1.flops - f, c1.bytes - x1 - k
    experts = x1 / expert_read_fraction(cfg.num_experts, cfg.num_experts_per_tok, 1) if x1 else 0.0
    limit = f / k if k else math.inf

    def ai(batch: int) -> float:
        frac = expert_read_fraction(cfg.num_experts, cfg.num_experts_per_tok, batch)
        return (f0 + batch * f) / (w + batch * k + experts * frac)
    if f <= ridge * k:
        return None, limit
    hi = 1
    while ai(hi) < ridge:
        hi *= 2
        if hi > 1 << 40:         # the limit is above the ridge by a rounding error only
            return None, limit
    lo = hi // 2                 # ai(lo) < ridge, or lo == 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ai(mid) >= ridge else (mid, hi)
    return hi, limit


def analyse(model_config: ModelConfig, hardware: HardwareProfile | str, batch: int,
            prompt_len: int, context_len: int, dtype: str | None = None, *,
            kv_dtype: str | None = None, compute_dtype: str | None = None,
            weight_bytes: float | None = None) -> dict:
    """Return the roofline analysis of prefill and decode as a JSON-serialisable dict.

    dtype: stored weight dtype (default `model_config.weight_dtype`); kv_dtype defaults to
    dtype when it is a float type, else f16; compute_dtype defaults to the float dtype of the
    weights, or the hardware's default for quantised weights. Keys: ridge_point, prefill,
    decode_batch1, decode_batch (each: ai, attainable_flops, bound, time_s, tokens_per_s, ...),
    decode_tok_s_batch1(_model_size), ridge_crossing_batch(_context0), kv_bytes_per_token,
    kv_bytes_per_request, prefill_time_s, max_batch_by_memory, notes.
    """
    if batch < 1 or prompt_len < 1 or context_len < 0:
        raise ConfigError(f"need batch >= 1, prompt_len >= 1, context_len >= 0; got "
                          f"{batch}, {prompt_len}, {context_len}")
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    wdtype = normalise_dtype(dtype or model_config.weight_dtype)
    kvd = normalise_dtype(kv_dtype) if kv_dtype else (wdtype if wdtype in _FLOAT_KV else "f16")
    if compute_dtype is None:
        compute_dtype = COMPUTE_DTYPE_OF.get(wdtype, hw.default_compute)
        if compute_dtype not in dict(hw.peak_flops):
            compute_dtype = hw.default_compute
    peak = hw.peak(compute_dtype)
    ridge = peak / hw.mem_bandwidth
    kw = {"weight_dtype": wdtype, "kv_dtype": kvd, "weight_bytes": weight_bytes}
    params = param_count(model_config)
    model_bytes = weight_bytes if weight_bytes is not None else params.total * bits_per_weight(wdtype) / 8
    prefill = _phase(step_work(model_config, prefill_step(prompt_len), **kw), hw, peak, prompt_len)
    dec1 = _phase(step_work(model_config, decode_step(1, context_len), **kw), hw, peak, 1)
    decb = _phase(step_work(model_config, decode_step(batch, context_len), **kw), hw, peak, batch)
    cross, ai_limit = ridge_crossing_batch(model_config, context_len, ridge, **kw)
    cross0, _ = ridge_crossing_batch(model_config, 0, ridge, **kw)
    kv_tok = kv_bytes_per_token(model_config, kvd)
    kv_req = kv_bytes_held(model_config, context_len, kvd)
    free = hw.memory_bytes - model_bytes
    return {
        "model": {"params": params.total, "active_params": params.active,
                  "weight_dtype": wdtype, "kv_dtype": kvd,
                  "compute_dtype": compute_dtype, "bits_per_weight": model_bytes * 8 / params.total,
                  "weight_bytes_total": model_bytes,
                  "layers": model_config.num_hidden_layers,
                  "kv_heads": model_config.num_key_value_heads,
                  "head_dim": model_config.head_dim,
                  "num_experts": model_config.num_experts if params.experts else 0,
                  "experts_per_tok": model_config.num_experts_per_tok if params.experts else 0,
                  "sliding_layers": model_config.num_sliding_layers,
                  "sliding_window": (model_config.sliding_window
                                     if model_config.num_sliding_layers else None)},
        "hardware": {"name": hw.name, "description": hw.description, "peak_flops": peak,
                     "mem_bandwidth": hw.mem_bandwidth, "memory_bytes": hw.memory_bytes,
                     "measured": hw.measured, "source": hw.source},
        "batch": batch, "prompt_len": prompt_len, "context_len": context_len,
        "ridge_point": ridge,
        "prefill": prefill, "decode_batch1": dec1, "decode_batch": decb,
        "decode_tok_s_batch1": dec1["tokens_per_s"], "decode_tok_s_batch": decb["tokens_per_s"],
        # The common rule of thumb: bandwidth / full model bytes (counts the whole embedding).
        "decode_tok_s_batch1_model_size": hw.mem_bandwidth / model_bytes,
        "ridge_crossing_batch": cross, "ridge_crossing_batch_context0": cross0,
        "decode_ai_limit": ai_limit,
        "kv_bytes_per_token": kv_tok, "kv_bytes_per_request": kv_req,
        "prefill_time_s": prefill["time_s"],
        "max_batch_by_memory": int(free // kv_req) if free > 0 and kv_req else None,
        "notes": list(NOTES),
    }


def resolve_model(name_or_path: str) -> tuple[str, ModelConfig, int | None]:
    """Return (display name, ModelConfig, stored weight bytes) for a known model name (no
    bytes: its dtype says) or a checkpoint path (the bytes of its weight tensors, e.g. a
    Q4_K_M file's mix of types)."""
    if name_or_path.strip().lower() in KNOWN_MODELS or not os.path.exists(name_or_path):
        return name_or_path.strip().lower(), get_known_model(name_or_path), None
    try:
        from duetserve.loader import checkpoint_shape  # lazy: loader pulls in heavy readers
    except ImportError as e:
        raise ConfigError(f"cannot read checkpoint {name_or_path!r}: the loader is not "
                          f"available ({e}); use a known model: {', '.join(KNOWN_MODELS)}")
    cfg, nbytes = checkpoint_shape(name_or_path)
    return os.path.basename(name_or_path.rstrip("/")), cfg, nbytes


def _si(x: float, unit: str) -> str:
    """Return `x` with an SI prefix, e.g. 9.89e14 -> '989 TFLOP/s'."""
    for p, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.4g} {p}{unit}"
    return f"{x:.4g} {unit}"


def format_list() -> str:
    """Return the known models and hardware profiles as text."""
    from duetserve.metrics.hardware import GPU_PROFILES, local_profile
    lines = ["models:"]
    for name, cfg in KNOWN_MODELS.items():
        p = param_count(cfg)
        lines.append(f"  {name:15s} {p.total / 1e9:7.3f} B params, "
                     f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q / "
                     f"{cfg.num_key_value_heads} kv heads x {cfg.head_dim}, {cfg.weight_dtype}"
                     + _family_text(cfg.num_experts if p.experts else 0, cfg.num_experts_per_tok,
                                    p.active, cfg.num_sliding_layers, cfg.sliding_window))
    lines.append("hardware (dense peak of the default compute dtype):")
    for hw in (*GPU_PROFILES.values(), local_profile()):
        lines.append(f"  {hw.name:15s} {_si(hw.peak(hw.default_compute), 'FLOP/s')} "
                     f"{hw.default_compute}, {_si(hw.mem_bandwidth, 'B/s')}, ridge "
                     f"{hw.ridge_point():.1f} FLOP/B  ({hw.description})")
    return "\n".join(lines)


def _family_text(experts: int, top_k: int, active: int, sliding: int,
                 window: int | None) -> str:
    """", top 8 of 128 experts (3.35 B active)" / ", 15 sliding-window layers (512)"."""
    out = f", top {top_k} of {experts} experts ({active / 1e9:.3g} B active)" if experts else ""
    return out + (f", {sliding} sliding-window layers ({window})" if sliding else "")


def _row(label: str, p: dict) -> str:
    return (f"  {label:14s} {p['tokens']:>7d} {_si(p['flops'], 'FLOP'):>12s} "
            f"{_si(p['bytes'], 'B'):>10s} {p['ai']:>10.4g} {_si(p['attainable_flops'], 'FLOP/s'):>14s}"
            f" {p['bound']:>8s} {p['time_s'] * 1e3:>10.3f}")


def format_result(r: dict) -> str:
    """Return the human-readable report of an `analyse` result."""
    m, hw, b = r["model"], r["hardware"], r["batch"]
    cross = r["ridge_crossing_batch"]
    cross_txt = (f"{cross}" if cross is not None else
                 f"never (AI tends to {r['decode_ai_limit']:.1f} FLOP/B < ridge)")
    kv_req = r["kv_bytes_per_request"]
    stored = ("as stored in the file" if m.get("weight_source") == "file"
              else m["weight_dtype"])
    lines = [
        f"model     {m.get('name', '?')}: {m['params']:,} params"
        + _family_text(m["num_experts"], m["experts_per_tok"], m["active_params"],
                       m["sliding_layers"], m["sliding_window"])
        + f"; weights {stored} ({m['bits_per_weight']:.4g} bits/weight, "
        f"{_si(m['weight_bytes_total'], 'B')}), KV {m['kv_dtype']}, compute {m['compute_dtype']}",
        f"hardware  {hw['name']}: {hw['description']}",
        f"          {_si(hw['peak_flops'], 'FLOP/s')} {m['compute_dtype']} dense, "
        f"{_si(hw['mem_bandwidth'], 'B/s')}",
        f"ridge     {r['ridge_point']:.1f} FLOP/byte",
        "",
        f"  {'phase':14s} {'tokens':>7s} {'FLOPs':>12s} {'bytes':>10s} {'AI FLOP/B':>10s} "
        f"{'attainable':>14s} {'bound':>8s} {'time ms':>10s}",
        _row(f"prefill {r['prompt_len']}", r["prefill"]),
        _row("decode B=1", r["decode_batch1"]),
    ]
    if b != 1:
        lines.append(_row(f"decode B={b}", r["decode_batch"]))
    lines += [
        "",
        f"decode bound (context {r['context_len']}):  batch 1: {r['decode_tok_s_batch1']:.1f} tok/s"
        + (f"   batch {b}: {r['decode_tok_s_batch']:.1f} tok/s" if b != 1 else ""),
        f"  rule of thumb, bandwidth / model bytes: {r['decode_tok_s_batch1_model_size']:.1f} "
        "tok/s at batch 1 (counts the whole embedding table)",
        f"decode crosses the ridge at batch: {cross_txt} at context {r['context_len']}; "
        f"{r['ridge_crossing_batch_context0']} at context 0 (weights only)",
        f"KV cache  {r['kv_bytes_per_token']:,.0f} bytes/token written; {kv_req:,.0f} "
        f"bytes/request held at {r['context_len']} tokens ({kv_req / 2**30:.4g} GiB"
        + (f"; sliding layers hold at most {m['sliding_window']}" if m["sliding_layers"]
           else "") + ")",
        f"prefill   {r['prompt_len']} tokens at the roofline: {r['prefill_time_s'] * 1e3:.3f} ms "
        f"({r['prefill']['bound']} bound)",
    ]
    if r["max_batch_by_memory"] is not None:
        lines.append(f"memory    at most {r['max_batch_by_memory']} requests of "
                     f"{r['context_len']} tokens fit beside the weights")
    if hw["name"] == "cpu" and not hw["measured"]:
        lines.append("NOTE: cpu not measured yet; using example figures of a 2-vCPU VM "
                     "(run `duet roofline --measure`)")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Draw the log-log roofline with prefill and decode points into `path` (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    peak, bw = r["hardware"]["peak_flops"], r["hardware"]["mem_bandwidth"]
    pts = [(f"prefill {r['prompt_len']}", r["prefill"]), ("decode B=1", r["decode_batch1"])]
    if r["batch"] != 1:
        pts.append((f"decode B={r['batch']}", r["decode_batch"]))
    ais = [p["ai"] for _, p in pts] + [r["ridge_point"]]
    lo, hi = min(ais) / 4, max(ais) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(xs, [min(peak, x * bw) for x in xs], "k-", label="roofline")
    ax.axvline(r["ridge_point"], color="grey", ls=":", label=f"ridge {r['ridge_point']:.0f}")
    for label, p in pts:
        ax.plot(p["ai"], p["attainable_flops"], "o")
        ax.annotate(f"{label}\n({p['bound']})", (p["ai"], p["attainable_flops"]),
                    textcoords="offset points", xytext=(6, -18), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable performance (FLOP/s)")
    ax.set_title(f"{r['model'].get('name', '')} on {r['hardware']['name']} "
                 f"({r['model']['weight_dtype']})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `duet roofline` options to `parser`."""
    a = parser.add_argument
    a("--model", default="smollm2-135m", help="known model name (see --list) or checkpoint path")
    a("--hardware", default="cpu", help="hardware profile (see --list); cpu = this machine")
    a("--batch", type=int, default=1, help="decode batch size B (default 1)")
    a("--prompt-len", type=int, default=512, help="prompt tokens for the prefill point")
    a("--context-len", type=int, default=None,
      help="tokens in the KV cache at a decode step (default: --prompt-len)")
    a("--dtype", default=None, help="stored weight dtype: bf16, f16, f32, fp8, q8_0, q4_1, "
      "q4_k, q6_k, ... (default: the model's)")
    a("--kv-dtype", default=None, help="KV cache dtype (default: --dtype if float, else f16)")
    a("--compute-dtype", default=None, choices=("fp32", "tf32", "bf16", "fp16", "fp8"),
      help="compute dtype for the peak FLOP/s (default: from --dtype)")
    a("--weight-bytes", type=float, default=None,
      help="total stored weight bytes (mixed-quant files); overrides --dtype's bits/weight "
      "(default for a checkpoint path without --dtype: the bytes of its weight tensors)")
    a("--list", action="store_true", help="list known models and hardware, then exit")
    a("--json", action="store_true", help="print the analysis as JSON")
    a("--plot", default=None, metavar="OUT.png", help="draw the log-log roofline (matplotlib)")
    a("--measure", action="store_true",
      help="measure this machine (fp32, bf16, int8 GEMMs; DRAM read) and cache it, then "
           "analyse on cpu")
    a("--threads", type=int, default=2, help="threads for --measure (default 2)")


def main(args: argparse.Namespace) -> int:
    """Run `duet roofline`; return the exit code (2 on a user error)."""
    try:
        if args.list:
            print(format_list())
            return 0
        if args.measure:
            from duetserve.metrics.measure import format_measure, measure_and_cache
            print(format_measure(measure_and_cache(threads=args.threads)))
        name, cfg, file_bytes = resolve_model(args.model)
        context = args.prompt_len if args.context_len is None else args.context_len
        # the given total, else the given dtype, else what the checkpoint stores
        weight_bytes = args.weight_bytes if args.weight_bytes is not None else (
            None if args.dtype else file_bytes)
        result = analyse(cfg, args.hardware, args.batch, args.prompt_len, context, args.dtype,
                         kv_dtype=args.kv_dtype, compute_dtype=args.compute_dtype,
                         weight_bytes=weight_bytes)
        result["model"]["name"] = name
        result["model"]["weight_source"] = (
            "given" if args.weight_bytes is not None else
            "file" if weight_bytes is not None else "dtype")
        print(json.dumps(result, indent=2) if args.json else format_result(result))
        if args.plot:
            plot(result, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
        return 0
    except ConfigError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2


__all__ = ["analyse", "ridge_crossing_batch", "resolve_model", "add_arguments", "main",
           "hardware_names"]
