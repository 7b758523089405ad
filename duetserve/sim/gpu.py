"""GPU cost profiles: the roofline hardware table plus stated efficiency factors.

The peak FLOP/s and bandwidth come from `metrics/hardware.py` (datasheet figures); the
per-unit FLOPs and bytes of a step from `metrics/cost_model.py`. What a real engine reaches
of those peaks is an assumption, stated here and written into the profile JSON where it can
be edited (`duet simulate --write-profile gpu.json ...`, then `--profile gpu.json`):

  mfu   fraction of peak FLOP/s in compute-bound steps (prefill GEMMs). 0.55: what
        vLLM/SGLang-class engines report for large bf16 GEMM-heavy prefills on H100/A100.
  mbu   fraction of HBM bandwidth in memory-bound steps (decode). 0.75: typical of the
        same engines' decode kernels with CUDA graphs.
  step_overhead_ms / request_overhead_ms: scheduling, input preparation and launch cost
        per step and per scheduled request (CPU side; not overlapped here).

Checked on an H200 (2026-11-25, benchmarks/gpu_step_probe.py, docs/simulator.md section
2): whole steps of Llama-3-8B and Qwen2.5-7B in bf16, torch.compile'd around cuBLAS GEMMs
and SDPA, replayed as CUDA graphs. The defaults predict 24/26 and 22/26 of their step times
within 10% (rms log error 0.074, 0.084); the best fit (MFU 0.56, MBU 0.88, 1.8 ms a step)
lowers that only to 0.061, so the defaults stay. On Llama-3-70B's shapes (20 of its
layers) they predict 0-15% long: larger GEMMs reach MFU 0.62, MBU 0.75. H100 shares the
chip; its factors are the same assumption, not measured. `fit_efficiency` below fits them
to any such probe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from duetserve.config import ConfigError, ModelConfig
from duetserve.core.step_time import Layout, StepShape
from duetserve.metrics.cost_model import (attention_flops_per_pair, bits_per_weight,
                                          bytes_per_element, expert_read_fraction,
                                          kv_bytes_per_token, kv_bytes_per_token_sliding,
                                          param_count, step_work)
from duetserve.metrics.hardware import GPU_PROFILES, HardwareProfile

# A GPU engine's layout: every slice through the same GEMMs (no few-row kernels), no
# chunks as decode rows, every chunk after context on flash attention.
GPU_LAYOUT = Layout(few_rows=0, chunk_rows=0, masked_max_scores=0)


@dataclass(frozen=True)
class RooflineStepTime:
    """A GPU's step time (core/step_time.StepPricer): a roofline per kernel group,
    summed (each group runs as its own kernels):

        linear    max(FLOPs_lin / (peak*mfu), weight bytes / (bw*mbu))   weights read once
                  per step, so prefill rows ride on a memory-bound decode step up to the
                  ridge point (FLOPs_lin = per_token * T + per_logit * L; a MoE model's
                  experts: expert_bytes x the fraction T rows choose, cost_model's
                  expert_read_fraction)
        prefill attention  max(per_pair * pairs / (peak*mfu), KV read / (bw*mbu))
        decode attention   max(per_pair * entries / (peak*mfu), KV read / (bw*mbu))
        KV write  kv_bytes_per_token * T / (bw*mbu)
        + step_overhead_s + request_overhead_s * requests

    Sliding-window layers (Gemma 3) take their share of per_pair and of the KV bytes
    (`*_sliding`) over the shape's window_* sums (keys capped at W; the layout carries W).
    Per-unit FLOPs and bytes follow metrics/cost_model.py (`unit_costs`)."""

    peak_flops: float
    mem_bandwidth: float
    mfu: float
    mbu: float
    step_overhead_s: float
    request_overhead_s: float
    flops_per_token: float
    flops_per_pair: float
    flops_per_logit: float
    weight_bytes: float          # every step (layers, norms; embedding rows ignored)
    head_bytes: float            # steps that sample anything
    kv_bytes_per_token: float    # every layer's (what a token writes, what P/D moves)
    flops_per_pair_sliding: float = 0.0      # of flops_per_pair: the sliding layers'
    kv_bytes_per_token_sliding: float = 0.0  # of kv_bytes_per_token: the sliding layers'
    expert_bytes: float = 0.0    # every routed expert of a MoE model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    layout: Layout = GPU_LAYOUT

    def seconds(self, s: StepShape) -> float:
        """The step's modelled duration in seconds (0 without rows). Pure."""
        if not s.num_rows:
            return 0.0
        flop_s = self.peak_flops * self.mfu
        byte_s = self.mem_bandwidth * self.mbu
        kv, kv_sl = self.kv_bytes_per_token, self.kv_bytes_per_token_sliding
        pair, pair_sl = self.flops_per_pair, self.flops_per_pair_sliding
        weights = (self.weight_bytes + (self.head_bytes if s.num_logits else 0.0)
                   + self.expert_bytes * expert_read_fraction(
                       self.num_experts, self.num_experts_per_tok, s.num_rows))
        linear = max((self.flops_per_token * s.num_rows
                      + self.flops_per_logit * s.num_logits) / flop_s, weights / byte_s)
        pairs = s.fresh_pairs + s.chunk_pairs + s.chunk_scores
        prefill = max(((pair - pair_sl) * pairs + pair_sl * s.window_pairs) / flop_s,
                      ((kv - kv_sl) * s.prefill_context + kv_sl * s.window_context) / byte_s)
        rows = s.num_decode_rows
        decode = max(((pair - pair_sl) * s.decode_kv + pair_sl * s.window_decode_kv) / flop_s,
                     ((kv - kv_sl) * (s.decode_kv - rows)
                      + kv_sl * max(0, s.window_decode_kv - rows)) / byte_s)
        return (linear + prefill + decode + kv * s.num_rows / byte_s
                + self.step_overhead_s + self.request_overhead_s * s.num_reqs)

    def describe(self) -> str:
        return (f"roofline: {self.peak_flops / 1e12:.4g} TFLOP/s x MFU {self.mfu:g}, "
                f"{self.mem_bandwidth / 1e12:.4g} TB/s x MBU {self.mbu:g}, overhead "
                f"{self.step_overhead_s * 1e3:g} ms/step + "
                f"{self.request_overhead_s * 1e3:g} ms/request")


@dataclass(frozen=True)
class Efficiency:
    mfu: float = 0.55
    mbu: float = 0.75
    step_overhead_ms: float = 1.0
    request_overhead_ms: float = 0.01


# Per hardware profile; GDDR6 L40S reaches less of its (lower) peaks in practice.
DEFAULT_EFFICIENCY: dict[str, Efficiency] = {name: Efficiency() for name in GPU_PROFILES}
DEFAULT_EFFICIENCY["l40s"] = Efficiency(mfu=0.45, mbu=0.7)

GPU_MEMORY_UTILIZATION = 0.9     # fraction of device memory the engine may use (vLLM's default)
ACTIVATION_RESERVE = 0.05        # of device memory, kept for activations and the graph pool


def efficiency_for(hardware: str, **overrides: float | None) -> Efficiency:
    """The default efficiency of `hardware`, with any non-None override applied."""
    eff = DEFAULT_EFFICIENCY.get(hardware, Efficiency())
    return replace(eff, **{k: v for k, v in overrides.items() if v is not None})


def unit_costs(cfg: ModelConfig, weight_dtype: str = "bf16", kv_dtype: str = "bf16"
               ) -> dict[str, float]:
    """Per-unit FLOPs and bytes of a step (RooflineStepTime's fields), from
    metrics.cost_model: the linear layers' off its breakdown of a probe step with 2 new
    tokens after 3 cached, 1 logit; attention and KV per layer kind from its per-pair and
    per-token figures; the experts' bytes from its parameter count."""
    probe = step_work(cfg, [(2, 3)], num_logits=1, weight_dtype=weight_dtype,
                      kv_dtype=kv_dtype).breakdown()
    linear = sum(v for k, v in probe.items() if k.startswith("flops.")
                 and k not in ("flops.attn_scores", "flops.attn_values", "flops.lm_head"))
    full, sliding = attention_flops_per_pair(cfg)
    return {
        "flops_per_token": linear / 2,
        "flops_per_pair": full + sliding,
        "flops_per_logit": probe["flops.lm_head"],
        "weight_bytes": probe["bytes.weights.layers"] + probe["bytes.weights.final_norm"],
        "head_bytes": probe["bytes.weights.lm_head"],
        "kv_bytes_per_token": kv_bytes_per_token(cfg, kv_dtype),
        "flops_per_pair_sliding": sliding,
        "kv_bytes_per_token_sliding": kv_bytes_per_token_sliding(cfg, kv_dtype),
        "expert_bytes": param_count(cfg).experts * bits_per_weight(weight_dtype) / 8,
        "num_experts": cfg.num_experts if cfg.moe_layer_ids else 0,
        "num_experts_per_tok": cfg.num_experts_per_tok if cfg.moe_layer_ids else 0,
    }


def weight_bytes_total(cfg: ModelConfig, weight_dtype: str = "bf16") -> float:
    return param_count(cfg).total * bits_per_weight(weight_dtype) / 8


def roofline_cost(cfg: ModelConfig, hw: HardwareProfile, eff: Efficiency,
                  weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                  compute_dtype: str = "bf16") -> RooflineStepTime:
    """The RooflineStepTime of `cfg` on one `hw` device (no tensor parallelism)."""
    if not (0 < eff.mfu <= 1 and 0 < eff.mbu <= 1):
        raise ConfigError(f"mfu and mbu must be in (0, 1], got {eff.mfu}, {eff.mbu}")
    u = unit_costs(cfg, weight_dtype, kv_dtype)
    window = cfg.sliding_window if cfg.num_sliding_layers else 0
    return RooflineStepTime(peak_flops=hw.peak(compute_dtype), mem_bandwidth=hw.mem_bandwidth,
                            mfu=eff.mfu, mbu=eff.mbu,
                            step_overhead_s=eff.step_overhead_ms / 1e3,
                            request_overhead_s=eff.request_overhead_ms / 1e3,
                            layout=replace(GPU_LAYOUT, window=window or 0), **u)


def kv_blocks(cfg: ModelConfig, hw: HardwareProfile, block_size: int,
              weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> int:
    """KV blocks that fit one device: memory x utilisation - weights - activation reserve,
    over ModelConfig.kv_block_bytes (a block of a model with sliding-window layers holds
    one KV group's layers). ConfigError when the weights alone do not fit."""
    free = (hw.memory_bytes * (GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE)
            - weight_bytes_total(cfg, weight_dtype))
    per_block = cfg.kv_block_bytes(block_size, bytes_per_element(kv_dtype))
    if free < per_block:
        raise ConfigError(f"{hw.name} ({hw.memory_bytes / 1e9:.0f} GB) has no room for a KV "
                          f"cache beside {weight_bytes_total(cfg, weight_dtype) / 1e9:.1f} GB "
                          "of weights")
    return int(free // per_block)


def fit_efficiency(cost: RooflineStepTime, shapes: Sequence[StepShape],
                   measured_s: Sequence[float], mfu_max: float = 1.0,
                   mbu_max: float = 1.0) -> tuple[RooflineStepTime, float]:
    """`cost` with the (mfu, mbu, step overhead) that minimise the sum of squared
    log(predicted / measured) over the steps `shapes` timed `measured_s` (seconds): a grid
    of 0.05 in MFU and MBU and 0.25 ms in overhead, then three of 0.01 and 0.01 ms, each
    around the best so far (+-0.05, +-0.3 ms). MFU and MBU are capped, at what the card's
    own GEMM and copy reach: above that, MBU and the overhead trade off without meaning.
    Returns (fitted cost, rms log error).
    (benchmarks/gpu_step_probe.py fits steps timed on a GPU with it.)"""
    if not shapes or len(shapes) != len(measured_s):
        raise ConfigError("fit_efficiency needs one measured time per step shape")

    def loss(c: RooflineStepTime) -> float:
        return sum(math.log(c.seconds(sh) / m) ** 2 for sh, m in zip(shapes, measured_s))

    mfus = [x / 20 for x in range(1, 21) if x / 20 <= mfu_max] or [mfu_max]
    mbus = [x / 20 for x in range(1, 21) if x / 20 <= mbu_max] or [mbu_max]
    overheads = [x / 4 for x in range(13)]
    best: tuple[float, RooflineStepTime] | None = None
    for _ in range(4):                 # the coarse grid, then three fine ones, re-centred
        for mfu in mfus:
            for mbu in mbus:
                for ov in overheads:
                    c = replace(cost, mfu=mfu, mbu=mbu, step_overhead_s=ov / 1e3)
                    val = loss(c)
                    if best is None or val < best[0]:
                        best = (val, c)
        c = best[1]
        mfus = sorted({min(mfu_max, max(0.01, round(c.mfu + d / 100, 2))) for d in range(-5, 6)})
        mbus = sorted({min(mbu_max, max(0.01, round(c.mbu + d / 100, 2))) for d in range(-5, 6)})
        overheads = sorted({max(0.0, round(c.step_overhead_s * 1e3 + d / 100, 2))
                            for d in range(-30, 31)})
    return best[1], math.sqrt(best[0] / len(shapes))
