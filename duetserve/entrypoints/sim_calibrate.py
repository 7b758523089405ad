"""`duet simulate --calibrate`: measure this machine's engine and save a simulation profile.

    1. build an engine with `duet serve`'s defaults (its start-up step time and budget are
       what the simulated instances budget their steps with)
    2. probe steps of many shapes through its runner (engine/step_probe.py's
       calibration_probes: decode batches, prefills, chunks after context, cold steps)
    3. replay two generic serving traces on fresh engines (bench/serve_scenario.py), at
       load phases sized by the capacity the probes' fit simulates: the steps a served
       engine runs, arrivals and output handling included
    4. fit one StepTime (core/step_time.py) over every term to both, save the profile

Rerun it whenever the engine's speed changes (new kernels, another CPU, other threads): a
few minutes (`--quick`: seconds, a rough fit for tests and smoke runs).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from duetserve.sim.profile import SimProfile, calibrated_profile, default_profile_dir

QUICK_PROBES = 24          # --quick: this many of the calibration probes, spread evenly
ARRIVALS = 16              # requests added (and aborted) to time the cost of an arrival


def default_calibrated_path(model: str | None, num_threads: int) -> Path:
    """Where `--calibrate` saves (and `duet simulate` looks for) this machine's profile."""
    from duetserve.loader import resolve_model_path
    stem = Path(resolve_model_path(model).rstrip("/")).stem
    return default_profile_dir() / f"cpu-{stem}-t{num_threads}.json"


def served_scheduler_settings(engine) -> dict:
    """The profile's "scheduler" entry for an engine built with the serving defaults: its
    SchedulerConfig's settings plus, when the engine derived its per-step budget, the
    step time and max_step_ms it derived it from and its scheduling objective
    (SimProfile.scheduler_config rebuilds the same StepBudget and SloPolicy through
    core.step_budget.derive_step_budget and core.slo.slo_policy_for)."""
    from duetserve.sim.profile import POLICY_KEYS, SCHEDULER_KEYS
    cfg = engine.scheduler.config
    settings = {k: getattr(cfg, k) for k in SCHEDULER_KEYS}
    settings["kv_windows"] = list(cfg.kv_windows)      # as the profile's JSON holds it
    if cfg.step_budget is not None:
        settings["step_time"] = engine.step_time.to_json()
        settings["max_step_ms"] = engine.config.max_step_ms
        settings.update({k: getattr(engine.config, k) for k in POLICY_KEYS})
    return settings


def arrival_seconds(engine, id_range: tuple[int, int]) -> float:
    """Median seconds of `engine.add_request` (validation, detokenizer set-up) over
    ARRIVALS requests, which are aborted again. Mutates nothing lasting."""
    from duetserve.sampling_params import SamplingParams
    times = []
    for i in range(ARRIVALS):
        prompt = [id_range[0] + (i * 7919 + j) % (id_range[1] - id_range[0])
                  for j in range(32)]
        t0 = time.perf_counter()
        engine.add_request(f"arrival-{i}", prompt, SamplingParams(max_tokens=4))
        times.append(time.perf_counter() - t0)
        engine.abort_request(f"arrival-{i}")
    return statistics.median(times)


def probe_samples(engine, quick: bool) -> list:
    """(StepShape, seconds) of the calibration probes through the engine's runner (no
    request may exist yet); --quick: QUICK_PROBES of them, spread over the set."""
    from duetserve.engine.step_probe import calibration_probes, fits, layout_of, measure
    layout = layout_of(engine.runner, engine.model_config.num_attention_heads)
    max_tokens = min(engine.max_model_len - 1, engine.num_blocks * engine.config.block_size)
    probes = fits(calibration_probes(layout), max_tokens)
    if quick:
        probes = probes[::max(1, len(probes) // QUICK_PROBES)]
    samples, _ = measure(engine.runner, probes, layout, engine.model_config.vocab_size,
                         engine.config.block_size, repeats=1 if quick else 3)
    return samples


def serving_samples(new_engine, grid: SimProfile, id_range: tuple[int, int], quick: bool,
                    max_foreign: float, say=None) -> tuple[list, dict]:
    """The serving scenario's steps as (StepShape, seconds), each trace replayed on a
    fresh engine from `new_engine()` at load phases sized by the capacity `grid` (the
    probes' fit) simulates for it, and redone once on a quiet machine when other
    processes used more than `max_foreign` of a core meanwhile; and the scenario's
    record for the profile."""
    import math

    from duetserve.bench.serve_scenario import (capacity_sample, measure_serving, summary,
                                                trace, traces)
    from duetserve.core.step_time import StepShape
    from duetserve.sim.cluster import ClusterSpec
    from duetserve.sim.run import simulate
    layout = grid.step_time.layout
    samples, measured = [], []
    for tr in traces(quick):
        sample = capacity_sample(tr, id_range)
        res = simulate(sample, grid, ClusterSpec(1), math.inf, 1.0, 0, None, None, id_range)
        capacity = len(sample) / res.duration_s
        convs, offsets, rates = trace(tr, capacity, id_range)
        engine = new_engine()
        steps = measure_serving(engine, convs, offsets, max_foreign)
        del engine
        steps.rates = rates
        if say is not None:
            say(f"serving scenario {tr.name}: {len(steps.samples)} steps in "
                f"{steps.duration_s:.1f} s at {', '.join(f'{r:.3g}' for r in rates)} "
                f"conversations/s (the probes' fit's capacity {capacity:.3g}/s)")
        samples += [(StepShape.of(slices, layout, cold > 0), dt)
                    for (slices, dt), cold in zip(steps.samples, steps.cold)]
        measured.append((tr, steps))
    return samples, summary(measured)


def calibrate(model: str | None, num_threads: int, quick: bool = False,
              out: str | Path | None = None, kv_cache_memory: float = 2.0,
              verbose: bool = True, loaded=None, kv_prefault: bool = False,
              dtype: str = "auto", max_foreign: float = 0.15) -> tuple[SimProfile, Path]:
    """Build the engine (on `loaded` weights when given), measure the probes and the
    serving scenario, fit on both, save (module docstring). `kv_prefault`, `dtype`: the
    engine's flags (`loaded`, when given, must have been loaded with that dtype).
    `max_foreign`: a serving trace during which other processes used more than this much
    of a core is replayed again once the machine is quiet (inf: never). Returns
    (profile, path)."""
    import torch

    from duetserve.bench.token_workload import id_range_for_vocab
    from duetserve.config import EngineConfig
    from duetserve.core.step_fit import fit_step_time
    from duetserve.engine.engine_core import EngineCore
    from duetserve.models.native import cpu_name
    from duetserve.worker.kv_cache import kv_bytes_per_token

    t0 = time.perf_counter()
    say = (lambda msg: print(f"calibrate: {msg}", file=sys.stderr, flush=True)) if verbose \
        else None
    config = EngineConfig(model=model, num_threads=num_threads, kv_cache_memory=kv_cache_memory,
                          kv_prefault=kv_prefault, dtype=dtype)
    engine = EngineCore(config, loaded)              # the settings `duet serve` would use
    scheduler = served_scheduler_settings(engine)
    id_range = id_range_for_vocab(engine.model_config.vocab_size)
    probes = probe_samples(engine, quick)
    arrival_s = arrival_seconds(engine, id_range)
    layout = probes[0][0].layout
    grid_model, grid_report = fit_step_time(probes, layout)
    if say is not None:
        say(f"{len(probes)} probe steps: {grid_model.describe()}")
    grid = calibrated_profile("probes", grid_model, scheduler, {}, arrival_s=arrival_s)
    served, serving = serving_samples(lambda: EngineCore(config, engine.loaded), grid,
                                      id_range, quick, max_foreign, say)
    step_time, report = fit_step_time(probes + served, layout)
    path = Path(out) if out else default_calibrated_path(model, num_threads)
    meta = {"model": engine.loaded.path, "threads": num_threads, "cpu": cpu_name(),
            "machine": platform.node(), "torch": torch.__version__, "dtype": config.dtype,
            "kernel_switches": config.kernel_switches(), "quick": quick,
            "total_s": time.perf_counter() - t0,
            "kv_bytes_per_token": kv_bytes_per_token(engine.model_config, engine.kv_dtype),
            "probe_steps": len(probes), "serving": serving, "fit": report,
            "probes_only_fit": grid_report}
    profile = calibrated_profile(path.stem, step_time, scheduler, meta,
                                 f"{Path(engine.loaded.path).name}, {num_threads} threads, "
                                 f"{cpu_name()}", arrival_s)
    profile.save(path)
    return profile, path


def format_report(profile: SimProfile, path: Path) -> str:
    fit = profile.meta["fit"]
    serving = profile.meta.get("serving", {})
    return "\n".join([
        f"profile {path}",
        f"  {profile.description}",
        f"  step time: {profile.step_time.describe()}",
        f"  fit over {fit['num_steps']} steps ({fit['num_outliers']} outliers dropped): "
        f"RMS relative error {fit['rms_rel_error']:.3f}, median |error| "
        f"{fit['median_abs_rel_error']:.3f}, p90 |error| {fit['p90_abs_rel_error']:.3f}",
        f"  {profile.meta.get('probe_steps')} probe steps + serving scenario "
        f"{serving.get('steps')} steps ({serving.get('requests')} requests in "
        f"{serving.get('duration_s', 0.0):.0f} s)",
        f"  engine defaults: {profile.scheduler}",
        f"  calibrated in {profile.meta['total_s']:.0f} s"])


def main_calibrate(args: argparse.Namespace) -> int:
    profile, path = calibrate(args.model, args.num_threads, args.quick, args.profile_out,
                              verbose=not args.no_progress, kv_prefault=args.kv_prefault,
                              dtype=args.dtype)
    print(format_report(profile, path))
    return 0
