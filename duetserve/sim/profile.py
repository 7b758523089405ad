"""Simulation profiles: a cost model plus the scheduler settings of the engine it models,
saved as JSON so a calibration is rerun cheaply and a GPU profile can be edited by hand.

    {"schema": "duet-sim-profile/1", "name", "kind": "calibrated" | "roofline",
     "description", "created",
     "scheduler": {max_num_batched_tokens, max_num_seqs, num_blocks, block_size,
                   max_model_len, enable_prefix_caching,
                   step_cost: StepCost.to_json() | absent, max_step_ms},
     "cost": CalibratedCost.to_json() | {"hardware", "model", "mfu", "mbu",
             "step_overhead_ms", "request_overhead_ms", "peak_flops", "mem_bandwidth",
             "weight_dtype", "kv_dtype"},
     "meta": {...}}      # calibration: grid, fit quality, engine and machine provenance

The token budget follows the engine's rule (EngineCore._resolve_token_budget): a profile
with a `step_cost` (the start-up measurement of the engine it was calibrated on) gets
the per-step StepBudget from `core.step_budget.derive_step_budget`, the function the
engine calls, with that cost and `max_step_ms`; an explicit max_num_batched_tokens
(an override, `duet plan`'s chunk sizes) is a fixed budget, as `--max-num-batched-tokens`
is for the engine; a profile without a step cost (GPU profiles, older calibrations) runs
its saved fixed max_num_batched_tokens.

A roofline profile stores its inputs, not derived figures: the per-unit FLOPs and bytes are
recomputed from the model on load (metrics/cost_model.py stays their one owner), while the
peaks and efficiency factors are plain numbers to edit.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from duetserve.config import ConfigError, SchedulerConfig
from duetserve.core.step_budget import StepCost, derive_step_budget
from duetserve.metrics.hardware import cache_path as hardware_cache_path
from duetserve.metrics.hardware import get_hardware
from duetserve.metrics.known_models import get_known_model
from duetserve.sim.cost import CalibratedCost, RooflineCost, StepCostModel
from duetserve.sim.gpu import Efficiency, kv_blocks, roofline_cost
from duetserve.sim.noise import StepNoise

SCHEMA = "duet-sim-profile/1"
SCHEDULER_KEYS = ("max_num_batched_tokens", "max_num_seqs", "num_blocks", "block_size",
                  "max_model_len", "enable_prefix_caching")
BUDGET_KEYS = ("step_cost", "max_step_ms")       # the engine's StepBudget inputs


@dataclass
class SimProfile:
    """A named cost model and the scheduler it runs under. `cost_json` is what is saved;
    `cost` is the model built from it."""

    name: str
    kind: str
    cost: StepCostModel
    cost_json: dict
    scheduler: dict
    description: str = ""
    meta: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    def scheduler_config(self, **overrides: int | float | bool | None) -> SchedulerConfig:
        """The SchedulerConfig of one instance, built as the engine builds its own: with a
        saved step cost and no max_num_batched_tokens override, the budget and per-step
        StepBudget come from core.step_budget.derive_step_budget (the engine's function);
        an overridden max_num_batched_tokens is fixed (no StepBudget), as the engine's
        explicit --max-num-batched-tokens is. Non-None overrides replace saved values."""
        given = {k: v for k, v in overrides.items() if v is not None}
        values = {**self.scheduler, **given}
        unknown = set(values) - set(SCHEDULER_KEYS) - set(BUDGET_KEYS) \
            - {"long_prefill_token_threshold"}
        if unknown:
            raise ConfigError(f"unknown scheduler settings {sorted(unknown)}")
        cost = values.pop("step_cost", None)
        max_step_ms = values.pop("max_step_ms", None)
        if max_step_ms is not None and not max_step_ms > 0:
            raise ConfigError(f"max_step_ms must be > 0, got {max_step_ms}")
        if cost is None or "max_num_batched_tokens" in given:
            if "max_step_ms" in given:
                raise ConfigError("max_step_ms needs a profile with the engine's measured "
                                  "step cost (a calibrated one) and no fixed "
                                  "max_num_batched_tokens")
            return SchedulerConfig(**values)
        try:
            step_cost = StepCost.from_json(cost)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"bad step_cost {cost!r} (expected fixed_ms, per_token_ms)") \
                from None
        budget, policy = derive_step_budget(step_cost, max_step_ms, values["max_num_seqs"])
        values["max_num_batched_tokens"] = budget
        return SchedulerConfig(**values, step_budget=policy)

    @property
    def step_noise(self) -> StepNoise | None:
        """The machine's step-time noise the calibration measured (meta "noise",
        sim/noise.py); None for profiles without one (GPU rooflines, older calibrations)."""
        try:
            return StepNoise.from_json(self.meta.get("noise"))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"bad noise entry {self.meta.get('noise')!r} in profile "
                              f"{self.name} (expected white, slow, tau_s)") from None

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "name": self.name, "kind": self.kind,
                "description": self.description, "created": self.created,
                "scheduler": self.scheduler, "cost": self.cost_json, "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def default_profile_dir() -> Path:
    """$DUET_CACHE_DIR/sim_profiles (default ~/.cache/duetserve/sim_profiles)."""
    return hardware_cache_path().parent / "sim_profiles"


def calibrated_profile(name: str, cost: CalibratedCost, scheduler: dict, meta: dict,
                       description: str = "") -> SimProfile:
    return SimProfile(name, "calibrated", cost, cost.to_json(), dict(scheduler),
                      description, meta)


def roofline_profile(model: str, hardware: str, eff: Efficiency, *, block_size: int = 16,
                     max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                     max_model_len: int | None = None, enable_prefix_caching: bool = True,
                     weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> SimProfile:
    """A GPU profile for a known model on a hardware-table device, one device per instance.
    The KV cache gets what the device's memory leaves beside the weights (sim/gpu.py)."""
    cfg = get_known_model(model)
    hw = get_hardware(hardware)
    cost_json = {"kind": "roofline", "hardware": hw.name, "model": model.lower(),
                 "mfu": eff.mfu, "mbu": eff.mbu, "step_overhead_ms": eff.step_overhead_ms,
                 "request_overhead_ms": eff.request_overhead_ms,
                 "peak_flops": hw.peak("bf16"), "mem_bandwidth": hw.mem_bandwidth,
                 "memory_bytes": hw.memory_bytes, "weight_dtype": weight_dtype,
                 "kv_dtype": kv_dtype}
    scheduler = {"max_num_batched_tokens": max_num_batched_tokens,
                 "max_num_seqs": max_num_seqs,
                 "num_blocks": kv_blocks(cfg, hw, block_size, weight_dtype, kv_dtype),
                 "block_size": block_size,
                 "max_model_len": max_model_len or cfg.max_position_embeddings,
                 "enable_prefix_caching": enable_prefix_caching}
    return _roofline_from_json(f"{hw.name}-{model.lower()}", cost_json, scheduler,
                               f"{model} on {hw.description}", {})


def _roofline_from_json(name: str, cost_json: dict, scheduler: dict, description: str,
                        meta: dict) -> SimProfile:
    cfg = get_known_model(cost_json["model"])
    hw = get_hardware(cost_json["hardware"])
    hw = replace(hw, peak_flops=(("bf16", float(cost_json["peak_flops"])),),
                 mem_bandwidth=float(cost_json["mem_bandwidth"]),
                 memory_bytes=float(cost_json.get("memory_bytes", hw.memory_bytes)))
    eff = Efficiency(float(cost_json["mfu"]), float(cost_json["mbu"]),
                     float(cost_json["step_overhead_ms"]),
                     float(cost_json["request_overhead_ms"]))
    cost: RooflineCost = roofline_cost(cfg, hw, eff, cost_json.get("weight_dtype", "bf16"),
                                       cost_json.get("kv_dtype", "bf16"))
    return SimProfile(name, "roofline", cost, cost_json, dict(scheduler), description, meta)


def profile_from_json(doc: dict) -> SimProfile:
    """Rebuild a profile from its JSON document (ConfigError when it is not one)."""
    if doc.get("schema") != SCHEMA:
        raise ConfigError(f"not a simulation profile (schema {doc.get('schema')!r}, "
                          f"expected {SCHEMA!r})")
    cost_json = doc["cost"]
    kind = cost_json.get("kind")
    if kind == "calibrated":
        try:
            cost = CalibratedCost.from_json(cost_json)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"bad calibrated profile: {e}") from None
        return SimProfile(doc["name"], kind, cost, cost_json, doc["scheduler"],
                          doc.get("description", ""), doc.get("meta", {}),
                          doc.get("created", 0.0))
    if kind == "roofline":
        prof = _roofline_from_json(doc["name"], cost_json, doc["scheduler"],
                                   doc.get("description", ""), doc.get("meta", {}))
        prof.created = doc.get("created", prof.created)
        return prof
    raise ConfigError(f"unknown cost model kind {kind!r} (calibrated | roofline)")


def load_profile(path: str | Path) -> SimProfile:
    """Read a profile JSON; ConfigError naming the file when it is missing or malformed."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read profile {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"profile {path} is not JSON: {e}") from None
    return profile_from_json(doc)
