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

These are not measurements of this project: no GPU was available. They are the knobs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from duetserve.config import ConfigError, ModelConfig
from duetserve.metrics.cost_model import bits_per_weight, param_count, step_cost
from duetserve.metrics.hardware import GPU_PROFILES, HardwareProfile
from duetserve.sim.cost import RooflineCost


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
    """Per-unit FLOPs and bytes of a step, read off metrics.cost_model's breakdown of a
    probe step with 2 new tokens after 3 cached (pairs = 2*3 + 2*3/2 = 9), 1 logit."""
    probe = step_cost(cfg, [(2, 3)], num_logits=1, weight_dtype=weight_dtype,
                      kv_dtype=kv_dtype).breakdown()
    linear = sum(v for k, v in probe.items() if k.startswith("flops.")
                 and k not in ("flops.attn_scores", "flops.attn_values", "flops.lm_head"))
    return {
        "flops_per_token": linear / 2,
        "flops_per_pair": (probe["flops.attn_scores"] + probe["flops.attn_values"]) / 9,
        "flops_per_logit": probe["flops.lm_head"],
        "weight_bytes": probe["bytes.weights.layers"] + probe["bytes.weights.final_norm"],
        "head_bytes": probe["bytes.weights.lm_head"],
        "kv_bytes_per_token": probe["bytes.kv_read"] / 3,
    }


def weight_bytes_total(cfg: ModelConfig, weight_dtype: str = "bf16") -> float:
    return param_count(cfg).total * bits_per_weight(weight_dtype) / 8


def roofline_cost(cfg: ModelConfig, hw: HardwareProfile, eff: Efficiency,
                  weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                  compute_dtype: str = "bf16") -> RooflineCost:
    """The RooflineCost of `cfg` on one `hw` device (no tensor parallelism)."""
    if not (0 < eff.mfu <= 1 and 0 < eff.mbu <= 1):
        raise ConfigError(f"mfu and mbu must be in (0, 1], got {eff.mfu}, {eff.mbu}")
    u = unit_costs(cfg, weight_dtype, kv_dtype)
    return RooflineCost(peak_flops=hw.peak(compute_dtype), mem_bandwidth=hw.mem_bandwidth,
                        mfu=eff.mfu, mbu=eff.mbu, step_overhead_s=eff.step_overhead_ms / 1e3,
                        request_overhead_s=eff.request_overhead_ms / 1e3, **u)


def kv_blocks(cfg: ModelConfig, hw: HardwareProfile, block_size: int,
              weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> int:
    """KV blocks that fit one device: memory x utilisation - weights - activation reserve.
    ConfigError when the weights alone do not fit."""
    free = (hw.memory_bytes * (GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE)
            - weight_bytes_total(cfg, weight_dtype))
    per_block = unit_costs(cfg, weight_dtype, kv_dtype)["kv_bytes_per_token"] * block_size
    if free < per_block:
        raise ConfigError(f"{hw.name} ({hw.memory_bytes / 1e9:.0f} GB) has no room for a KV "
                          f"cache beside {weight_bytes_total(cfg, weight_dtype) / 1e9:.1f} GB "
                          "of weights")
    return int(free // per_block)
