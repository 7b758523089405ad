"""`duet simulate --calibrate`: measure this machine's engine over the step grid
(bench/calibrate.py) and a serving scenario (bench/serve_scenario.py: generic traces
replayed on the wall clock, each on a fresh engine, their load phases sized by the
capacity the grid's fit simulates), fit the cost model on both (sim/fit.py), run the
speed probe (bench/speed_probe.py) to record the speed the fit was measured at, and save
the profile.

Rerun it whenever the engine's speed changes (new kernels, another CPU, other threads):
it takes a few minutes (`--quick`: seconds, a rough fit for tests and smoke runs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from duetserve.entrypoints.cli import UserError
from duetserve.sim.profile import SimProfile, calibrated_profile, default_profile_dir


def default_calibrated_path(model: str | None, num_threads: int) -> Path:
    """Where `--calibrate` saves (and `duet simulate` looks for) this machine's profile."""
    from duetserve.loader import resolve_model_path
    stem = Path(resolve_model_path(model).rstrip("/")).stem
    return default_profile_dir() / f"cpu-{stem}-t{num_threads}.json"


def served_scheduler_settings(engine) -> dict:
    """The profile's "scheduler" entry for an engine built with the serving defaults: its
    SchedulerConfig's settings plus, when the engine derived its per-step budget, the
    measured step cost and max_step_ms it derived it from (SimProfile.scheduler_config
    rebuilds the same StepBudget through core.step_budget.derive_step_budget)."""
    from duetserve.sim.profile import SCHEDULER_KEYS
    cfg = engine.scheduler.config
    settings = {k: getattr(cfg, k) for k in SCHEDULER_KEYS}
    if cfg.step_budget is not None:
        settings["step_cost"] = engine.step_cost.to_json()
        settings["max_step_ms"] = engine.config.max_step_ms
    return settings


def flash_above_entries(num_heads: int) -> int:
    """The largest n*(c+n) of a chunk after context that still runs the masked score
    matrix (models/attention.py: heads x n x (c+n) <= GROUPED_MAX_SCORES); longer chunks
    run two flash calls (sim/cost.py StepShape.flash_above)."""
    from duetserve.models.attention import GROUPED_MAX_SCORES
    return GROUPED_MAX_SCORES // num_heads


def serving_steps(new_engine, grid_cost, scheduler: dict, id_range: tuple[int, int],
                  quick: bool, max_foreign: float | None, say=None):
    """Run the serving scenario's traces (bench/serve_scenario.py), each on a fresh engine
    from `new_engine()` (built with the serving settings, as benchmarks/sim_fidelity.py
    builds one per measured run) and at load phases sized by the capacity the grid's fit
    simulates for it (everything queued at once). Returns [(Trace, ServingSteps with
    rates filled in)]."""
    import math

    from duetserve.bench.calibrate import MAX_FOREIGN
    from duetserve.bench.serve_scenario import capacity_sample, measure_serving, trace, traces
    from duetserve.sim.cluster import ClusterSpec
    from duetserve.sim.run import simulate
    grid = calibrated_profile("grid", grid_cost, scheduler, {})
    measured = []
    for tr in traces(quick):
        sample = capacity_sample(tr, id_range)
        res = simulate(sample, grid, ClusterSpec(1), math.inf, 1.0, 0, None, None, id_range)
        capacity = len(sample) / res.duration_s
        convs, offsets, rates = trace(tr, capacity, id_range)
        if say is not None:
            say(f"serving scenario {tr.name}: {len(convs)} conversations at "
                f"{', '.join(f'{r:.3g}' for r in rates)}/s (grid fit's capacity "
                f"{capacity:.3g}/s)")
        engine = new_engine()
        steps = measure_serving(engine, convs, offsets,
                                MAX_FOREIGN if max_foreign is None else max_foreign)
        del engine
        steps.rates = rates
        if say is not None:
            say(f"serving scenario {tr.name}: {len(steps.samples)} steps in "
                f"{steps.duration_s:.1f} s, foreign CPU "
                f"{steps.foreign_cpu_s / max(steps.duration_s, 1e-9):.2f} core")
        measured.append((tr, steps))
    return measured


def serving_summary(measured) -> dict:
    from duetserve.bench.serve_scenario import summary
    return summary(measured)


def calibrate(model: str | None, num_threads: int, quick: bool = False,
              out: str | Path | None = None, kv_cache_memory: float = 2.0,
              verbose: bool = True, loaded=None, max_foreign: float | None = None,
              kv_prefault: bool = False, dtype: str = "auto") -> tuple[SimProfile, Path]:
    """Build the engine (on `loaded` weights when given), measure the grid and the serving
    scenario, fit on both, save.
    `max_foreign`: redo a scenario when other processes used more of a core meanwhile
    (default bench.calibrate.MAX_FOREIGN; inf: never wait). `kv_prefault`: every engine
    maps its whole KV cache at start (EngineConfig.kv_prefault), so the steps are a
    long-running server's, without first-use page faults of new blocks; for simulating
    engines run with --kv-prefault. `dtype`: the engine's --dtype (`loaded`, when given,
    must have been loaded with it). Returns (profile, path)."""
    import torch

    from duetserve.bench.calibrate import (CALIBRATION_BUDGET, GRID, MAX_FOREIGN, QUICK_GRID,
                                           measure_grid)
    from duetserve.bench.token_workload import id_range_for_vocab
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.engine.step_cost import cache_key
    from duetserve.models.kernels import few_row_limit
    from duetserve.models.native import cpu_name
    from duetserve.bench.speed_probe import run_probe
    from duetserve.sim.fit import fit_cost
    from duetserve.sim.noise import estimate as estimate_noise
    from duetserve.sim.noise import log_ratios
    from duetserve.sim.speed import probe_ratio
    from duetserve.worker.kv_cache import kv_bytes_per_token

    t0 = time.perf_counter()
    config = EngineConfig(model=model, num_threads=num_threads, kv_cache_memory=kv_cache_memory,
                          kv_prefault=kv_prefault, dtype=dtype)
    served = EngineCore(config, loaded)              # the settings `duet serve` would use
    scheduler = served_scheduler_settings(served)
    engine = EngineCore(replace(config, max_num_batched_tokens=CALIBRATION_BUDGET),
                        loaded=served.loaded)
    say = (lambda msg: print(f"calibrate: {msg}", file=sys.stderr, flush=True)) if verbose \
        else None
    cal = measure_grid({"served": served, "wide": engine}, QUICK_GRID if quick else GRID,
                       id_range=id_range_for_vocab(engine.model_config.vocab_size),
                       progress=say,
                       max_foreign=MAX_FOREIGN if max_foreign is None else max_foreign)
    arrival_s = statistics.median(cal.arrival_s)
    flash_above = flash_above_entries(engine.model_config.num_attention_heads)
    chunk_rows = engine.runner.chunk_rows
    few_rows = few_row_limit(engine.runner.model)     # the engine's kernel switch
    # its paged decode attention's split of (row, KV head) items over threads (chunk rows
    # exist only with the paged decode, worker/batch.py)
    decode_split = (torch.get_num_threads(), engine.model_config.num_key_value_heads) \
        if chunk_rows else (0, 0)
    grid_cost, grid_report = fit_cost(cal.samples, arrival_s, cal.cold, flash_above,
                                      chunk_rows, few_rows, decode_split)
    id_range = id_range_for_vocab(engine.model_config.vocab_size)
    fresh = lambda: EngineCore(config, served.loaded)     # noqa: E731  serving settings
    # the speed the fit is measured at, for rescaling the profile later (sim/speed.py):
    # between the grid and the scenario, on a fresh engine as a later probe runs
    probe = run_probe(fresh(), id_range, quick,
                      MAX_FOREIGN if max_foreign is None else max_foreign)
    serving = serving_steps(fresh, grid_cost, scheduler, id_range, quick, max_foreign, say)
    samples, cold = list(cal.samples), list(cal.cold)
    for _, steps in serving:
        samples += steps.samples
        cold += steps.cold
    cost, report = fit_cost(samples, arrival_s, cold, flash_above, chunk_rows, few_rows,
                            decode_split)
    # the machine's step-time noise around the fit, over every step measured with its
    # start time: the grid's and the serving scenario's traces'
    noise = estimate_noise([(cal.starts, log_ratios(cost, cal.samples, cal.cold))]
                           + [(steps.starts, log_ratios(cost, steps.samples, steps.cold))
                              for _, steps in serving])
    if say is not None and noise is not None:
        say(noise.describe())
    speed = probe_ratio(cost, probe.samples, probe.cold)
    if say is not None:
        say(f"speed probe: {speed['steps']} steps in {probe.seconds:.1f} s, measured / "
            f"predicted {speed['ratio']:.3f} (decode-only {speed['decode_ratio']:.3f})")
    path = Path(out) if out else default_calibrated_path(model, num_threads)
    meta = {"model": engine.loaded.path, "threads": num_threads, "cpu": cpu_name(),
            "machine": platform.node(), "torch": torch.__version__,
            "engine_key": cache_key(engine.loaded.path, f"{config.dtype}/{config.quantization}/"
                                    f"{config.kv_cache_dtype}", num_threads),
            "dtype": config.dtype,
            "grid": "quick" if quick else "full", "calibration_budget": CALIBRATION_BUDGET,
            "measured_s": cal.seconds, "total_s": time.perf_counter() - t0,
            "foreign_cpu_s": cal.foreign_cpu_s, "scenarios_redone": cal.num_redone,
            "rusage": cal.rusage,
            "kv_bytes_per_token": kv_bytes_per_token(engine.model_config, engine.kv_dtype),
            "serving": serving_summary(serving), "grid_steps": len(cal.samples),
            "flash_above": flash_above, "chunk_rows": chunk_rows, "few_rows": few_rows,
            "decode_split": list(decode_split), "kv_prefault": kv_prefault,
            "noise": noise.to_json() if noise is not None else None,
            "speed_probe": speed,
            "fit": report, "grid_only_fit": grid_report, "pid": os.getpid()}
    profile = calibrated_profile(path.stem, cost, scheduler, meta,
                                 f"{Path(engine.loaded.path).name}, {num_threads} threads, "
                                 f"{cpu_name()}")
    del served
    profile.save(path)
    raw = path.with_suffix(".samples.json")     # raw steps, to refit without measuring
    raw.write_text(json.dumps({"samples": samples, "cold": cold, "arrival_s": cal.arrival_s,
                               "grid_steps": len(cal.samples),
                               "grid_starts": [t - cal.starts[0] for t in cal.starts],
                               "serving_starts": [steps.starts for _, steps in serving],
                               "probe": {"samples": probe.samples, "cold": probe.cold}}))
    return profile, path


def _traces(raw: dict, grid: bool = True) -> list[tuple[list, int, int]]:
    """The step traces a calibration's samples file holds, as (start times, first sample,
    end sample): the grid's (when `grid`) and each serving-scenario trace's, those whose
    start times were saved and that hold steps."""
    g = raw.get("grid_steps", len(raw["samples"]))
    parts = [(raw.get("grid_starts") if grid else None, 0, g)]
    for starts in raw.get("serving_starts", []):
        parts.append((starts, parts[-1][2], parts[-1][2] + len(starts)))
    return [(starts, lo, hi) for starts, lo, hi in parts if starts is not None and hi > lo]


def recorded_cold(raw: dict) -> list:
    """A calibration samples file's cold values (sim/cost.py cold_state), the idle time of
    files from before it was recorded filled in from the saved start times (the grid's and
    each serving trace's: sim/cost.py with_idle)."""
    from duetserve.sim.cost import with_idle
    samples = raw["samples"]
    cold = list(raw.get("cold", [False] * len(samples)))
    for starts, lo, hi in _traces(raw):
        cold[lo:hi] = with_idle(cold[lo:hi], starts, [dt for _, dt in samples[lo:hi]])
    return cold


def saved_traces(raw: dict, cost, grid: bool = True) -> list[tuple[list, list]]:
    """The step traces a calibration's samples file holds, each as (start times, log
    measured / predicted under `cost`: sim/noise.py's input): the grid's (when `grid`)
    and each serving-scenario trace's, those whose start times were saved."""
    from duetserve.sim.noise import log_ratios
    samples = raw["samples"]
    cold = recorded_cold(raw)
    return [(starts, log_ratios(cost, samples[lo:hi], cold[lo:hi]))
            for starts, lo, hi in _traces(raw, grid)]


def pooled_profile(paths: Sequence[str | Path], out: str | Path) -> SimProfile:
    """One profile fitted over the steps of several calibrations (each `calibrate`'s
    profile at `paths`, its samples file beside it), taken at different times so that the
    fit's level is the machine's over all of them rather than one stretch's. The
    engine's layout (breakpoint, flash split, chunk rows, decode split) and scheduler
    settings are the first calibration's; the step-time noise is estimated over every
    calibration's traces (its run-to-run `level` from the spread of their levels, three
    calibrations or more) and the speed-probe record over all their probes pooled.
    meta["pooled"] records each calibration's measured / predicted total under the
    pooled fit (how far the machine's level moved between them). Saves the profile to
    `out` and the pooled samples beside it; returns the profile. ValueError, before
    writing anything, on no paths or on a set that cannot pool (a path that is not one
    calibration, missing steps, calibrations of different engines)."""
    from duetserve.sim.fit import fit_cost
    from duetserve.sim.noise import estimate as estimate_noise
    from duetserve.sim.noise import level_of
    from duetserve.sim.speed import probe_ratio
    if not paths:
        raise ValueError("pooled_profile needs at least one calibration")
    docs = [json.loads(Path(p).read_text()) for p in paths]
    sample_paths = [Path(p).with_suffix(".samples.json") for p in paths]
    first = docs[0]
    for p, doc, sp in zip(paths, docs, sample_paths):
        if doc.get("kind") != "calibrated" or "pooled" in doc.get("meta", {}):
            raise ValueError(f"{p}: not one calibration (`duet simulate --calibrate`'s "
                             f"profile); pool the calibrations themselves")
        if not sp.exists():
            raise ValueError(f"{p}: its measured steps ({sp}) are missing; they are saved "
                             "beside every calibration")
        theirs = (doc["meta"].get("engine_key"), doc["meta"].get("threads"))
        if theirs != (first["meta"].get("engine_key"), first["meta"].get("threads")):
            raise ValueError(f"{p} calibrated another engine than {paths[0]} (its model, "
                             f"threads, torch, CPU or duetserve's source differ): only "
                             f"calibrations of one engine pool")
    raws = [json.loads(sp.read_text()) for sp in sample_paths]
    flags = [recorded_cold(raw) for raw in raws]
    samples, cold, arrivals, probe_samples, probe_cold = [], [], [], [], []
    for raw, fl in zip(raws, flags):
        samples += raw["samples"]
        cold += fl
        arrivals += raw.get("arrival_s", [])
        probe_samples += raw.get("probe", {}).get("samples", [])
        probe_cold += raw.get("probe", {}).get("cold", [])
    c = first["cost"]
    cost, report = fit_cost(samples, statistics.median(arrivals) if arrivals else 0.0, cold,
                            c.get("flash_above", 0), c.get("chunk_rows", 0),
                            first["meta"].get("few_rows", 0),
                            tuple(c.get("decode_split", (0, 0))))
    traces, levels = [], []
    for raw, fl in zip(raws, flags):
        traces += saved_traces(raw, cost)
        levels.append(probe_ratio(cost, raw["samples"], fl)["ratio"])
    noise = estimate_noise(traces)
    if noise is not None:           # the run-to-run part: the levels' spread
        noise = replace(noise, level=level_of(levels))
    meta = {**first["meta"], "fit": report, "noise": noise.to_json() if noise else None,
            "speed_probe": probe_ratio(cost, probe_samples, probe_cold) if probe_samples
            else None,
            "pooled": {"calibrations": [str(p) for p in paths], "levels": levels}}
    out = Path(out)
    profile = calibrated_profile(out.stem, cost, first["scheduler"], meta,
                                 f"{first.get('description', '')}; pooled over "
                                 f"{len(paths)} calibrations")
    profile.save(out)
    out.with_suffix(".samples.json").write_text(json.dumps(
        {"samples": samples, "cold": cold, "arrival_s": arrivals,
         "probe": {"samples": probe_samples, "cold": probe_cold},
         "calibrations": [str(p) for p in paths]}))
    return profile


def rescale_to_now(profile: SimProfile, quick: bool = False, loaded=None,
                   kv_cache_memory: float = 2.0) -> SimProfile:
    """Run the speed probe (bench/speed_probe.py) on a fresh engine of the profile's model
    and threads (on `loaded` weights when given) and return the profile rescaled to the
    machine's speed now (sim/speed.py). ValueError when the profile is not a calibrated
    one with a probe record."""
    from duetserve.bench.speed_probe import run_probe
    from duetserve.bench.token_workload import id_range_for_vocab
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.sim.speed import probe_ratio, probe_reference, rescaled
    try:
        probe_reference(profile)    # fail before the ~25 s probe, not after
    except ValueError as e:
        raise ValueError(f"--speed-probe needs a calibrated profile with a speed-probe "
                         f"record ({e})") from None
    config = EngineConfig(model=profile.meta.get("model"),
                          num_threads=int(profile.meta.get("threads", 2)),
                          kv_cache_memory=kv_cache_memory)
    engine = EngineCore(config, loaded)
    res = run_probe(engine, id_range_for_vocab(engine.model_config.vocab_size), quick)
    return rescaled(profile, probe_ratio(profile.cost, res.samples, res.cold))


def format_report(profile: SimProfile, path: Path) -> str:
    fit = profile.meta["fit"]
    serving = profile.meta.get("serving", {})
    return "\n".join([
        f"profile {path}",
        f"  {profile.description}",
        f"  {profile.cost.describe()}",
        f"  fit over {fit['num_steps']} steps ({fit['num_outliers']} outliers dropped): "
        f"RMS relative error {fit['rms_rel_error']:.3f}, median |error| "
        f"{fit['median_abs_rel_error']:.3f}, p90 |error| {fit['p90_abs_rel_error']:.3f}, "
        f"total time predicted/measured {fit['total_time_ratio']:.3f}",
        f"  grid {profile.meta.get('grid_steps')} steps + serving scenario "
        f"{serving.get('steps')} steps ({serving.get('requests')} requests in "
        f"{serving.get('duration_s', 0.0):.0f} s; " + "; ".join(
            f"{t['name']}: {t['steps']} steps at "
            f"{', '.join(f'{r:.3g}' for r in t['rates'])} conversations/s"
            for t in serving.get("traces", [])) + ")",
        "  " + (profile.step_noise.describe() if profile.step_noise
                else "step-time noise: not measured") + " (simulations draw from it; "
        "--no-noise: none)",
        f"  engine defaults: {profile.scheduler}",
        f"  measured in {profile.meta['measured_s']:.0f} s ({profile.meta['total_s']:.0f} s "
        f"with start-up); other processes used {profile.meta['foreign_cpu_s']:.1f} CPU s "
        f"meanwhile ({profile.meta['scenarios_redone']} scenarios redone for it)"
        + (f"; pooled over {len(profile.meta['pooled']['calibrations'])} calibrations (the "
           "grid, scenario and timing figures are the first's)"
           if "pooled" in profile.meta else "")])


def main_pool(args: argparse.Namespace) -> int:
    """`duet simulate --pool CAL... --profile-out OUT`: one fit over several calibrations
    taken at different times (pooled_profile); prints the report and each calibration's
    level under the pooled fit. UserError on a bad set."""
    if not args.profile_out:
        raise UserError("--pool needs --profile-out: where to save the pooled profile")
    out = Path(args.profile_out)
    if any(Path(p).resolve() == out.resolve() for p in args.pool):
        raise UserError(f"--profile-out {out} is one of the calibrations pooled: pick a new "
                        "path (the calibrations' own steps are kept for pooling again)")
    try:
        profile = pooled_profile(args.pool, out)
    except (OSError, ValueError) as e:
        raise UserError(f"--pool: {e}") from None
    print(format_report(profile, out))
    print("  levels (each calibration's measured / predicted under the pooled fit): "
          + ", ".join(f"{Path(p).name} {x:.3f}"
                      for p, x in zip(args.pool, profile.meta["pooled"]["levels"])))
    return 0


def main_calibrate(args: argparse.Namespace) -> int:
    profile, path = calibrate(args.model, args.num_threads, args.quick, args.profile_out,
                              verbose=not args.no_progress, kv_prefault=args.kv_prefault,
                              dtype=args.dtype)
    print(format_report(profile, path))
    return 0
