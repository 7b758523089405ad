"""Simulation profiles: a step-time model plus the scheduler settings of the engine it
models, saved as JSON so a calibration is reused and a GPU profile can be edited by hand.

    {"schema": "duet-sim-profile/2", "name", "kind": "calibrated" | "roofline",
     "description", "created",
     "scheduler": {max_num_batched_tokens, max_num_seqs, num_blocks, block_size,
                   max_model_len, enable_prefix_caching, kv_windows (each KV group's
                   sliding window or null: the model's ModelConfig.kv_groups), max_loras
                   (absent in older profiles: no cap), step_time: the engine's own StepTime JSON | absent, max_step_ms},
     "step_time": StepTime JSON (calibrated) | {"hardware", "model", "mfu", "mbu",
                  "step_overhead_ms", "request_overhead_ms", "peak_flops",
                  "mem_bandwidth", "weight_dtype", "kv_dtype"} (roofline),
     "arrival_s": the engine's cost of adding a request,
     "meta": {...}}      # calibration: fit quality, engine and machine provenance

A calibrated profile prices steps with the StepTime `duet simulate --calibrate` fitted (the
class the engine's step budget and speculation use, core/step_time.py). The token budget
follows the engine's rule (EngineCore._resolve_token_budget): with the engine's own
start-up step time under "scheduler" the per-step StepBudget comes from
`core.step_budget.derive_step_budget`, the function the engine calls; an explicit
max_num_batched_tokens (an override, `duet plan`'s chunk sizes) is a fixed budget, as
`--max-num-batched-tokens` is for the engine; a profile without one (GPU profiles) runs its
saved fixed max_num_batched_tokens.

A roofline profile stores its inputs, not derived figures: the per-unit FLOPs and bytes are
recomputed from the model on load (metrics/cost_model.py stays their one owner), while the
peaks and efficiency factors are plain numbers to edit.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from duetserve.config import ConfigError, EngineConfig, SchedulerConfig, cache_dir
from duetserve.core.slo import slo_policy_for
from duetserve.core.step_budget import derive_step_budget
from duetserve.core.step_time import StepPricer, StepTime
from duetserve.metrics.hardware import get_hardware
from duetserve.metrics.known_models import get_known_model
from duetserve.sim.gpu import Efficiency, RooflineStepTime, kv_blocks, roofline_cost

SCHEMA = "duet-sim-profile/2"
SCHEDULER_KEYS = ("max_num_batched_tokens", "max_num_seqs", "num_blocks", "block_size",
                  "max_model_len", "enable_prefix_caching", "kv_windows", "max_loras")
BUDGET_KEYS = ("step_time", "max_step_ms")       # the engine's StepBudget inputs
# the engine's scheduling objective (EngineConfig fields of the same names, same defaults)
POLICY_KEYS = ("scheduling_policy", "slo_ttft_ms", "slo_tpot_ms")


@dataclass
class SimProfile:
    """A named step-time model and the scheduler it runs under. `step_time_json` is what
    is saved; `step_time` is the model built from it."""

    name: str
    kind: str
    step_time: StepPricer
    step_time_json: dict
    scheduler: dict
    description: str = ""
    meta: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    arrival_s: float = 0.0

    def scheduler_config(self, **overrides: int | float | bool | None) -> SchedulerConfig:
        """The SchedulerConfig of one instance, built as the engine builds its own: with the
        engine's saved step time and no max_num_batched_tokens override, the budget and
        per-step StepBudget come from core.step_budget.derive_step_budget (the engine's
        function); an overridden max_num_batched_tokens is fixed (no StepBudget), as the
        engine's explicit --max-num-batched-tokens is. Non-None overrides replace saved
        values. ConfigError on an unknown or bad setting."""
        given = {k: v for k, v in overrides.items() if v is not None}
        values = {**self.scheduler, **given}
        unknown = set(values) - set(SCHEDULER_KEYS) - set(BUDGET_KEYS) \
            - set(POLICY_KEYS) - {"long_prefill_token_threshold"}
        if unknown:
            raise ConfigError(f"unknown scheduler settings {sorted(unknown)}")
        engine = EngineConfig()
        objective = [values.pop(k, getattr(engine, k)) for k in POLICY_KEYS]
        try:
            EngineConfig(**dict(zip(POLICY_KEYS, objective)))   # validated as the engine's
        except ConfigError as e:
            raise ConfigError(f"profile {self.name}: {e}") from None
        if "kv_windows" in values:       # a JSON list; absent in older profiles: one group
            values["kv_windows"] = tuple(values["kv_windows"])
        engine_time = values.pop("step_time", None)
        max_step_ms = values.pop("max_step_ms", None)
        if max_step_ms is not None and not max_step_ms > 0:
            raise ConfigError(f"max_step_ms must be > 0, got {max_step_ms}")
        if engine_time is None or "max_num_batched_tokens" in given:
            if "max_step_ms" in given:
                raise ConfigError("max_step_ms needs a profile with the engine's step time "
                                  "(a calibrated one) and no fixed max_num_batched_tokens")
            return SchedulerConfig(**values)
        try:
            model = StepTime.from_json(engine_time)
        except ValueError as e:
            raise ConfigError(f"bad engine step_time in profile {self.name}: {e}") from None
        budget, policy = derive_step_budget(model, max_step_ms, values["max_num_seqs"])
        values["max_num_batched_tokens"] = budget
        return SchedulerConfig(**values, step_budget=policy,
                               slo=slo_policy_for(policy, *objective))

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "name": self.name, "kind": self.kind,
                "description": self.description, "created": self.created,
                "scheduler": self.scheduler, "step_time": self.step_time_json,
                "arrival_s": self.arrival_s, "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def default_profile_dir() -> Path:
    """$DUET_CACHE_DIR/sim_profiles (default ~/.cache/duetserve/sim_profiles)."""
    return Path(cache_dir()) / "sim_profiles"


def calibrated_profile(name: str, step_time: StepTime, scheduler: dict, meta: dict,
                       description: str = "", arrival_s: float = 0.0) -> SimProfile:
    return SimProfile(name, "calibrated", step_time, step_time.to_json(), dict(scheduler),
                      description, meta, arrival_s=arrival_s)


def roofline_profile(model: str, hardware: str, eff: Efficiency, *, block_size: int = 16,
                     max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                     max_model_len: int | None = None, enable_prefix_caching: bool = True,
                     weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> SimProfile:
    """A GPU profile for a known model on a hardware-table device, one device per instance.
    The KV cache gets what the device's memory leaves beside the weights (sim/gpu.py)."""
    cfg = get_known_model(model)
    hw = get_hardware(hardware)
    doc = {"kind": "roofline", "hardware": hw.name, "model": model.lower(),
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
                 "enable_prefix_caching": enable_prefix_caching,
                 "kv_windows": [g.window for g in cfg.kv_groups()]}
    return _roofline_from_json(f"{hw.name}-{model.lower()}", doc, scheduler,
                               f"{model} on {hw.description}", {})


def _roofline_from_json(name: str, doc: dict, scheduler: dict, description: str,
                        meta: dict) -> SimProfile:
    cfg = get_known_model(doc["model"])
    hw = get_hardware(doc["hardware"])
    hw = replace(hw, peak_flops=(("bf16", float(doc["peak_flops"])),),
                 mem_bandwidth=float(doc["mem_bandwidth"]),
                 memory_bytes=float(doc.get("memory_bytes", hw.memory_bytes)))
    eff = Efficiency(float(doc["mfu"]), float(doc["mbu"]), float(doc["step_overhead_ms"]),
                     float(doc["request_overhead_ms"]))
    model: RooflineStepTime = roofline_cost(cfg, hw, eff, doc.get("weight_dtype", "bf16"),
                                            doc.get("kv_dtype", "bf16"))
    return SimProfile(name, "roofline", model, doc, dict(scheduler), description, meta)


def profile_from_json(doc: dict) -> SimProfile:
    """Rebuild a profile from its JSON document (ConfigError when it is not one)."""
    if doc.get("schema") != SCHEMA:
        raise ConfigError(f"not a simulation profile of this version (schema "
                          f"{doc.get('schema')!r}, expected {SCHEMA!r}): re-run "
                          "`duet simulate --calibrate` or `--write-profile`")
    st = doc["step_time"]
    kind = doc.get("kind")
    if kind == "calibrated":
        try:
            model = StepTime.from_json(st)
        except ValueError as e:
            raise ConfigError(f"bad calibrated profile: {e}") from None
        return SimProfile(doc["name"], kind, model, st, doc["scheduler"],
                          doc.get("description", ""), doc.get("meta", {}),
                          doc.get("created", 0.0), float(doc.get("arrival_s", 0.0)))
    if kind == "roofline":
        prof = _roofline_from_json(doc["name"], st, doc["scheduler"],
                                   doc.get("description", ""), doc.get("meta", {}))
        prof.created = doc.get("created", prof.created)
        return prof
    raise ConfigError(f"unknown profile kind {kind!r} (calibrated | roofline)")


def load_profile(path: str | Path) -> SimProfile:
    """Read a profile JSON; ConfigError naming the file when it is missing or malformed."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read profile {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"profile {path} is not JSON: {e}") from None
    return profile_from_json(doc)
