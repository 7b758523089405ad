"""Fidelity of `duet simulate` against the real engine on this machine.

For each workload mix and load level: the same seeded conversations and arrival schedule
run (a) on a real in-process EngineCore on the wall clock (bench/replay.py) and (b) in the
simulator with the calibrated profile and the engine's own scheduler settings. Reported:
TTFT / TPOT p50 / p90 / p99 of both and their ratio (sim / real), the per-step prediction
error of the cost model on the real run's own steps, and CDF overlays (bench/plot.py).
Then the highest rate meeting a P90 SLO (90% of requests meet TTFT and TPOT limits): the
simulator's by bisection, the engine's interpolated from measured runs around it (rates
--slo-factors x the simulator's, extended upward by --slo-step while the engine still
meets the SLO at the highest, and downward while it meets it nowhere, at most --slo-extra
more runs, so the engine's crossing is bracketed).

The speed probe (bench/speed_probe.py: fixed step shapes on random token ids, none of
these workloads' requests) runs on a fresh engine right before each measured run (once
before the max-rate runs), and the run's simulation uses the calibrated profile rescaled
to the machine's speed then (sim/speed.py): calibration, as a user would recalibrate
before planning on this machine, not fitting on results. The unscaled profile's figures
are kept beside (`sim_unscaled`, `*-sim-unscaled.json`); --no-speed-probe skips it.

A third simulation of each run is a diagnostic, not a prediction: the profile rescaled to
the run's own steps (measured / predicted total, sim/speed.at_run_speed), so that the ratio
left (`ratios_run_speed`) is the simulator's own error (scheduling, the cost model's shape,
queueing) with the machine's speed during that run taken out. With repeats, the runs' own
measured / predicted totals are split (`speed_decomposition`, in logs) into an overall
offset from the calibration, a round effect (the machine's speed over a round), a mix
effect (the cost model's shape on that workload) and what is left (run-to-run speed).

--repeats N measures every mix and level N times, in rounds (every cell once a round), so
the repeats of a cell sample different stretches of the machine's speed; each cell then
compares the medians over its repeats (sim / real), and records each real percentile's
spread over the repeats (max / min: the run-to-run noise the ratios sit in) and a bootstrap
of the median over the repeats (`real_interval`, 5-95%, over the median: how far the
engine's own figure moves with this many repeats, the bound a cell's ratio can be resolved
to). The max-rate
runs pool the requests of --slo-repeats runs per rate, also in rounds (every rate once a
round); each run's own attainment is logged and kept (`real_per_run`: how far one run's
attainment moves at one rate), the pooled records in OUT/max-rate-real.json. The engine's
crossing comes with a bootstrap over those runs (`real_interval`, 5-95%: how far the
machine's noise alone moves it with this many runs; `ratio_interval`, the simulator's
max rate over it).

The simulator's side is its expectation, not one draw per real repeat: each cell's
simulated percentiles are the medians over --sim-paths noise paths (sim/noise.py; path K
uses repeat ((K-1) mod N)'s probe), and each simulated attainment pools as many paths.
With one path per repeat (the earlier protocol), the simulated max rate moved by up to 15%
between paths on the same profile (docs/simulator.md §3).

--interleave-calibration (with --calibrate) calibrates again before every round of the
cells and of the max-rate runs, and simulates everything with one fit over all those
calibrations (sim_calibrate.pooled_profile): the calibration then samples the same hour
of the machine as the runs it predicts, instead of the three minutes before them (the
machine's level moved 6-10% between a calibration and the runs after it, §3 of
docs/simulator.md). Still a prediction: no measured run's steps enter the fit. The first
--rate-calibrations calibrations (default 1; more are taken back to back and pooled) set
the rates (the cells' and the max-rate runs'): one calibration is a +-5% draw of the
machine's level, and a fast draw puts every 0.8 cell nearer saturation; the real runs all
come first and the simulations after them, under the pooled profile, whose record
(meta["pooled"]["levels"]) says how far each calibration's level sat from it.

--local-level (with --interleave-calibration and --no-speed-probe) then simulates each
round's runs with the pooled fit rescaled to the level of the calibrations taken right
before and right after that round (sim/speed.at_calibrated_level, `local_levels`), and the
max-rate runs at the level of the calibrations of their rounds: the machine drifted by
up to a third within a two-hour run (r38), and one level for all of it puts the early
rounds' simulation fast and the late ones' slow. Still a prediction from calibration: no
measured run's steps enter it. The pooled fit as is stays as `ratios_unscaled`.

Run it alone on the machine, under the exclusive benchmark lock:

    flock -x /tmp/duet-bench.lock .venv/bin/python benchmarks/sim_fidelity.py \\
        --calibrate --out out/sim/fidelity

Each real run waits for a quiet machine first and is redone once when other processes used
more than --max-foreign of a core meanwhile; a max-rate run is also redone (at most twice)
when the hypervisor took more than --max-steal of a core (steal); the figures are reported
either way.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from duetserve.bench.bench_metrics import meets_slo, summarize
from duetserve.bench.cpu_meter import wait_until_quiet
from duetserve.bench.datasets import make_dataset
from duetserve.bench.plot import plot
from duetserve.bench.replay import replay
from duetserve.bench.token_workload import (arrival_offsets, id_range_for_vocab,
                                             token_conversations)
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.cost import run_shapes
from duetserve.sim.profile import load_profile
from duetserve.sim.run import run_json, simulate
from duetserve.sim.speed import at_calibrated_level, at_run_speed, geometric_mean

MIXES = {
    "chat": dict(dataset="chat", input_len="32:128", output_len="32:96", num_turns=3),
    "prefill-heavy": dict(dataset="random", input_len="384:768", output_len="8:24"),
    "decode-heavy": dict(dataset="random", input_len="16:64", output_len="96:192"),
}
PERCENTILES = [50, 90, 99]
KEYS = [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def conversations(mix: str, n: int, seed: int, id_range: tuple[int, int]):
    return conversations_of(MIXES[mix], n, seed, id_range)


def conversations_of(spec: dict, n: int, seed: int, id_range: tuple[int, int]):
    """Token conversations of a MIXES-style dataset spec."""
    convs = make_dataset(spec["dataset"], num_prompts=n, input_len=spec["input_len"],
                         output_len=spec["output_len"], num_turns=spec.get("num_turns", 3),
                         seed=seed)
    return token_conversations(convs, id_range)


def capacity(mix: str, profile, config, id_range, seed: int) -> float:
    """Simulated throughput (conversations/s) with everything queued at once."""
    convs = conversations(mix, 200, seed, id_range)
    res = simulate(convs, profile, ClusterSpec(1), math.inf, 1.0, seed, None, config, id_range,
                   noise=False)
    return len(convs) / res.duration_s


def scaled_slo(mix: str, profile, config, id_range, seed: int, scale: float,
               run_seconds: float) -> dict:
    """The P90 SLO as `scale` x the simulator's own p90 TTFT and TPOT (ms) of `mix` at a
    light load (0.1 x its capacity) under `profile`, DistServe's "SLO scale": a limit
    relative to what this machine does unloaded, so that the attainment stays near 1 at
    light load and the max rate is set by queueing, not by a limit the unloaded engine
    barely meets (docs/simulator.md §3, r32). Computed before any measured run."""
    rate = 0.1 * capacity(mix, profile, config, id_range, seed)
    n = max(16, int(round(rate * run_seconds)))
    convs = conversations(mix, n, seed, id_range)
    res = simulate(convs, profile, ClusterSpec(1), rate, 1.0, seed, None, config, id_range,
                   noise=False)
    summary = summarize(res.records, res.duration_s, PERCENTILES, None)
    return {"ttft": round(scale * summary["ttft_ms"]["p90"], 1),
            "tpot": round(scale * summary["tpot_ms"]["p90"], 1)}


def doc(label: str, records, duration: float, rate: float, slo: dict, extra: dict) -> dict:
    summary = summarize(records, duration, PERCENTILES, slo)
    return {"schema": "duet-bench-serve/1", "label": label, "config": extra,
            "runs": [{"request_rate": rate, "burstiness": 1.0, "max_concurrency": None,
                      "summary": summary, "requests": [r.to_json() for r in records]}]}


def real_run(loaded, engine_config, convs, offsets, max_foreign: float,
             max_steal: float = float("inf"), attempts: int = 2):
    """One real run of `convs` at `offsets` on a fresh engine, redone (at most `attempts`
    runs in all) while other processes used more than `max_foreign` of a core or the
    hypervisor took more than `max_steal` of one meanwhile: both slow the engine's steps
    without being the engine's cost. Returns (engine, ReplayResult, foreign fraction) of the
    last run; its steal is res.steal_s / res.duration_s."""
    from duetserve.engine.engine_core import EngineCore
    for attempt in range(1, attempts + 1):
        quiet = wait_until_quiet(0.1, 5.0, 600.0)
        engine = EngineCore(engine_config, loaded)
        res = replay(engine, convs, offsets)
        frac = res.foreign_cpu_s / res.duration_s
        steal = res.steal_s / res.duration_s
        redo = (frac > max_foreign or steal > max_steal) and attempt < attempts
        log(f"  real run: {len(res.records)} requests in {res.duration_s:.1f} s; foreign CPU "
            f"{frac:.2f} core (before: {quiet:.2f}), steal {steal:.3f}; "
            f"engine {res.rusage}{'; redo' if redo else ''}")
        if not redo:
            break
    return engine, res, frac


def step_samples(steps) -> list:
    """A run's steps (start s, seconds, slices) as fit samples (slices, seconds)."""
    return [(sl, dt) for _, dt, sl in steps]


def speed_probe(loaded, engine_config, profile, id_range, out: Path, tag: str) -> dict:
    """Run the speed probe on a fresh engine; saves its steps to OUT/TAG-probe.json (for
    offline refits, benchmarks/sim_refit.py) and returns them ({"samples", "cold",
    "seconds"}), logging its ratio under `profile` (the simulations rescale by it later,
    under the profile they use: probe_scaled)."""
    from duetserve.bench.speed_probe import run_probe
    from duetserve.engine.engine_core import EngineCore
    from duetserve.sim.speed import probe_ratio
    wait_until_quiet(0.1, 5.0, 600.0)
    res = run_probe(EngineCore(engine_config, loaded), id_range)
    raw = {"samples": res.samples, "cold": res.cold}
    (out / f"{tag}-probe.json").write_text(json.dumps(raw))
    now = probe_ratio(profile.cost, res.samples, res.cold)
    log(f"  speed probe: {now['steps']} steps in {res.seconds:.1f} s, measured / predicted "
        f"{now['ratio']:.3f} (decode-only {now['decode_ratio']:.3f})")
    return {**raw, "seconds": res.seconds}


def probe_scaled(profile, probe: dict | None):
    """`profile` rescaled to a probe from speed_probe (sim/speed.py), and the probe's
    record; (profile, None) without a probe."""
    from duetserve.sim.speed import probe_ratio, rescaled
    if probe is None:
        return profile, None
    now = probe_ratio(profile.cost, probe["samples"], probe["cold"])
    scaled = rescaled(profile, now)
    return scaled, {**now, "factor": scaled.meta["speed_scale"]["factor"],
                    "seconds": probe["seconds"]}


def sim_doc(label: str, convs, profile, config, rate, seed, id_range, slo, noise=True,
            noise_seed=None):
    sres = simulate(convs, profile, ClusterSpec(1), rate, 1.0, seed, None, config, id_range,
                    noise, noise_seed)
    return sres, {"schema": "duet-bench-serve/1", "label": label, "config": {},
                  "runs": [run_json(sres, rate, 1.0, None, PERCENTILES, slo)]}


def step_errors(profile, steps, cold) -> dict:
    pred = np.array([profile.cost.step_seconds(s) for s in
                     run_shapes(profile.cost, [sl for _, _, sl in steps], cold)])
    real = np.array([dt for _, dt, _ in steps])
    rel = np.abs(pred / real - 1.0)
    return {"num_steps": len(steps), "median_abs_rel_error": float(np.median(rel)),
            "p90_abs_rel_error": float(np.percentile(rel, 90)),
            "total_time_ratio": float(pred.sum() / real.sum())}


def ratios(real: dict, sim: dict) -> dict:
    out = {}
    for key, name in KEYS:
        for p in ("p50", "p90", "p99"):
            r, s = real["runs"][0]["summary"][key][p], sim["runs"][0]["summary"][key][p]
            out[f"{name} {p}"] = {"real_ms": r, "sim_ms": s,
                                  "ratio": s / r if r else None}
    return out


def attainment(records, slo: dict) -> float:
    return sum(meets_slo(r, slo) for r in records) / max(1, len(records))


def sim_attainment(mix, profile, config, id_range, seed, slo, n, rate, paths) -> float:
    """SLO attainment over the requests of `paths` simulations (noise paths 1..paths, as
    the engine's side pools that many runs; one without noise when paths is 0)."""
    convs = conversations(mix, n, seed, id_range)
    records = []
    for k in range(1, paths + 1) if paths else (0,):
        records += simulate(convs, profile, ClusterSpec(1), rate, 1.0, seed, None, config,
                            id_range, paths > 0, k).records
    return attainment(records, slo)


def sim_max_rate(mix, profile, config, id_range, seed, slo, n_for, lo, hi, tol=0.01,
                 paths: int = 0) -> float:
    """Bisection on the simulator (its own workload size at each rate, as the real runs)."""
    def ok(rate: float) -> bool:
        return sim_attainment(mix, profile, config, id_range, seed, slo, n_for(rate), rate,
                              paths) >= 0.9
    while not ok(lo):
        lo /= 2
    while ok(hi):
        hi *= 2
    while hi / lo > 1 + tol:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def crossing(points: list[tuple[float, float]], target: float = 0.9) -> float | None:
    """Highest rate where attainment >= target, interpolated linearly to the first rate
    above it that falls below (None when no measured rate meets it)."""
    pts = sorted(points)
    best = None
    for (r0, a0), (r1, a1) in zip(pts, pts[1:] + [(math.inf, -1.0)]):
        if a0 >= target:
            best = r0
            if a1 < target and math.isfinite(r1):
                return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return best


def crossing_interval(per_run: dict[float, list[float]], target: float = 0.9,
                      resamples: int = 2000, seed: int = 0,
                      quantiles: tuple[float, float] = (0.05, 0.95)) -> dict:
    """How far the engine's crossing moves with the machine's noise: a bootstrap over
    the runs at each rate (`per_run`: each run's attainment; the runs of a rate replay one
    trace, so their pooled attainment is the mean). Returns the crossing's `quantiles`
    over the resamples that bracket it ("lo", "hi"; None when under half do) and the
    share that do ("bracketed")."""
    rng = np.random.default_rng(seed)
    rates = sorted(per_run)
    found = []
    for _ in range(resamples):
        pts = [(r, float(np.mean(rng.choice(per_run[r], size=len(per_run[r])))))
               for r in rates]
        c = crossing(pts, target)
        if c is not None and any(a < target for _, a in pts):
            found.append(c)
    share = len(found) / resamples
    lo, hi = (float(np.quantile(found, q)) for q in quantiles) if share >= 0.5 \
        else (None, None)
    return {"lo": lo, "hi": hi, "quantiles": list(quantiles), "resamples": resamples,
            "bracketed": share}


def rep_tag(mix: str, level: float, rep: int, repeats: int) -> str:
    """File prefix of one measured run: MIX-LEVEL, or MIX-LEVEL-repK when repeated."""
    tag = f"{mix}-{level:g}"
    return tag if repeats == 1 else f"{tag}-rep{rep}"


def local_levels(levels: list[float], round_: int, rate_calibrations: int) -> list[float]:
    """The levels (pooled_profile's meta["pooled"]["levels"], in the order the calibrations
    were taken) of the interleaved calibrations next to round `round_` (1-based, the cells'
    rounds first, then the max-rate runs'): the one right before it (before round 1: the
    --rate-calibrations taken back to back, as one, their geometric mean) and the one
    right after it (none after the last round)."""
    if round_ == 1:
        before = geometric_mean(levels[:rate_calibrations])
    else:
        before = levels[rate_calibrations + round_ - 2]
    after = levels[rate_calibrations + round_ - 1:rate_calibrations + round_]
    return [before] + list(after)


def max_rate_levels(levels: list[float], slo_repeats: int) -> list[float]:
    """The levels of the calibrations --local-level takes for the max-rate runs: the last
    `slo_repeats`, one before each of their rounds."""
    return levels[-slo_repeats:]


def measure(plan: dict, rep: int, args, loaded, engine_config, profile, id_range,
            slo: dict, out: Path) -> dict:
    """One measured run of PLAN (its conversations and arrivals are the same every repeat),
    after a speed probe unless --no-speed-probe (its ratio logged under `profile`); writes
    OUT/TAG-{real,steps,stepinfo,probe}.json. Returns the repeat's record, its simulated
    side still to come (simulate_rep); the probe and the run's steps ride along in it
    under "_raw" (not serialised)."""
    mix, level, rate, n = plan["mix"], plan["level"], plan["rate"], plan["conversations"]
    convs = conversations(mix, n, args.seed, id_range)
    offsets = arrival_offsets(n, rate, 1.0, args.seed).tolist()
    tag = rep_tag(mix, level, rep, args.repeats)
    log(f"{mix} @ {rate:.3f}/s ({level:g} x capacity), {n} conversations"
        + (f", repeat {rep} of {args.repeats}" if args.repeats > 1 else ""))
    probe = None
    if not args.no_speed_probe:
        probe = speed_probe(loaded, engine_config, profile, id_range, out, tag)
    engine, res, frac = real_run(loaded, engine_config, convs, offsets, args.max_foreign)
    real = doc(f"engine {mix} @ {rate:.3g}/s", res.records, res.duration_s, rate, slo,
               {"foreign_cpu_core_fraction": frac})
    (out / f"{tag}-real.json").write_text(json.dumps(real))
    # the engine's own steps (start s, seconds, slices), to check a cost model
    (out / f"{tag}-steps.json").write_text(json.dumps(res.steps))
    (out / f"{tag}-stepinfo.json").write_text(json.dumps(
        {"minor_faults": res.step_faults, "cold": res.step_cold}))
    return {"rep": rep, "tag": tag, "requests": len(res.records),
            "real_duration_s": res.duration_s, "foreign_cpu_core_fraction": frac,
            "steal_core_fraction": res.steal_s / res.duration_s,
            "engine_rusage": res.rusage, "real_summary": real["runs"][0]["summary"],
            # this run's engine: a re-measured start-up step cost changes its StepBudget
            # (benchmarks/sim_replay_diff.py replays with it)
            "scheduler": asdict(engine.scheduler.config),
            "_raw": {"probe": probe, "steps": res.steps, "cold": res.step_cold,
                     "real": real}}


def simulate_rep(plan: dict, rec: dict, args, profile, config, id_range, slo: dict,
                 out: Path) -> None:
    """The simulated side of one measured repeat (`rec` from measure) under `profile`:
    probe-scaled, without noise and at the run's own speed; writes OUT/TAG-sim.json,
    fills in `rec` (dropping "_raw") and appends the repeat's (probe-scaled, run-speed)
    profiles to plan["profiles"] (not serialised) for aggregate."""
    mix, level, rate, n = plan["mix"], plan["level"], plan["rate"], plan["conversations"]
    raw = rec.pop("_raw")
    convs = conversations(mix, n, args.seed, id_range)
    run_profile, probe_rec = probe_scaled(profile, raw["probe"])
    if args.local_level:      # the pooled fit at the level of the calibrations around it
        run_profile = at_calibrated_level(profile, local_levels(
            profile.meta["pooled"]["levels"], rec["rep"], args.rate_calibrations))
        probe_rec = run_profile.meta["speed_scale"]
    # repeat K's simulation draws noise path K (sim/noise.py), as repeat K met its own
    sres, sim = sim_doc(f"sim {mix} @ {rate:.3g}/s", convs, run_profile, config, rate,
                        args.seed, id_range, slo, not args.no_noise, rec["rep"])
    _, quiet = sim_doc(f"sim (no noise) {mix} @ {rate:.3g}/s", convs, run_profile, config,
                       rate, args.seed, id_range, slo, False)
    at_speed = at_run_speed(profile, step_samples(raw["steps"]), raw["cold"])
    _, own = sim_doc(f"sim (run speed) {mix} @ {rate:.3g}/s", convs, at_speed, config, rate,
                     args.seed, id_range, slo, not args.no_noise, rec["rep"])
    (out / f"{rec['tag']}-sim.json").write_text(json.dumps(sim))
    plan.setdefault("profiles", []).append((run_profile, at_speed))
    rec.update({"sim_duration_s": sres.duration_s, "sim_wall_s": sres.wall_s,
                "speed_probe": probe_rec, "sim_summary": sim["runs"][0]["summary"],
                "sim_summary_no_noise": quiet["runs"][0]["summary"],
                "sim_summary_run_speed": own["runs"][0]["summary"],
                "run_speed_factor": at_speed.meta["speed_scale"]["factor"],
                "step_errors": step_errors(run_profile, raw["steps"], raw["cold"]),
                "step_errors_unscaled": step_errors(profile, raw["steps"], raw["cold"])})
    log(f"{rec['tag']}: {json.dumps(ratios(raw['real'], sim))}")
    log(f"  steps: {rec['step_errors']}; run speed factor {rec['run_speed_factor']:.3f}")


def speed_decomposition(plans: list[dict]) -> dict:
    """The runs' own measured / predicted step totals (run_speed_factor) in logs, as a
    two-way layout (repeat round x cell): exp of the overall mean (the machine during the
    runs against the calibration), of each round's and each cell's mean offset, and the
    residual's standard deviation (run-to-run speed not explained by either)."""
    m = np.log([[r["run_speed_factor"] for r in p["reps"]] for p in plans]).T
    grand = m.mean()
    rounds, cells = m.mean(axis=1) - grand, m.mean(axis=0) - grand
    resid = m - grand - rounds[:, None] - cells[None, :]
    dof = max(1, (m.shape[0] - 1) * (m.shape[1] - 1))
    return {"overall": float(np.exp(grand)),
            "rounds": [float(np.exp(x)) for x in rounds],
            "cells": {f"{p['mix']}-{p['level']:g}": float(np.exp(x))
                      for p, x in zip(plans, cells)},
            "residual_sd": float(np.sqrt((resid ** 2).sum() / dof))}


def sim_paths(args, repeats: int) -> int:
    """Noise paths the simulator draws for a cell or a max-rate attainment: --sim-paths,
    at least one per real repeat (none without noise: the simulation is deterministic)."""
    return 1 if args.no_noise else max(repeats, args.sim_paths)


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0,
                    quantiles: tuple[float, float] = (0.05, 0.95)) -> list[float]:
    """How far the median of `values` (one figure per repeat) moves when the repeats are
    resampled with replacement: its `quantiles` over the resamples, each divided by the
    median itself ([1, 1] when the repeats agree, or for one repeat)."""
    v = np.asarray(values, dtype=float)
    mid = float(np.median(v))
    if mid <= 0:
        return [1.0, 1.0]
    boot = np.median(np.random.default_rng(seed).choice(v, size=(resamples, len(v))), axis=1)
    return [float(np.quantile(boot, q)) / mid for q in quantiles]


def real_intervals(summaries: list[dict], seed: int = 0) -> dict:
    """median_interval of each latency percentile over the repeats' summaries, keyed as
    the ratios are ("TTFT p90", ...)."""
    return {f"{name} {p}": median_interval([s[key][p] for s in summaries], seed=seed)
            for key, name in KEYS for p in ("p50", "p90", "p99")}


def median_summary(summaries: list[dict]) -> dict:
    """Per latency key and percentile, the median over repeats (one run: itself)."""
    return {key: {p: float(np.median([s[key][p] for s in summaries]))
                  for p in ("p50", "p90", "p99")} for key, _ in KEYS}


def aggregate(plan: dict, profile, config, args, id_range, slo: dict, out: Path) -> dict:
    """PLAN's entry in fidelity.json: sim / real ratios of the percentiles' medians, the
    engine's over its repeats, the simulator's over sim_paths() noise paths (path K with
    repeat ((K-1) mod repeats)'s probe-scaled and run-speed profiles), each real
    percentile's spread over the repeats (max / min), and the pooled records as
    OUT/MIX-LEVEL-{real,sim,sim-unscaled}.json for the CDF overlays (real: the repeats;
    sim: the repeats' probe-scaled paths; sim-unscaled: every noise path)."""
    mix, level, rate, n = plan["mix"], plan["level"], plan["rate"], plan["conversations"]
    reps = plan["reps"]
    tag = f"{mix}-{level:g}"
    convs = conversations(mix, n, args.seed, id_range)
    as_doc = lambda summary: {"runs": [{"summary": summary}]}  # noqa: E731
    paths = sim_paths(args, len(reps))

    def over_paths(label: str, pick) -> tuple[list[dict], dict]:
        """Every path's document and the medians over noise paths 1..paths; path K
        simulates with pick(repeat ((K-1) mod repeats)'s profiles), so path K <= repeats
        is repeat K's own."""
        docs = [sim_doc(f"{label} {mix} @ {rate:.3g}/s", convs,
                        pick(plan["profiles"][(k - 1) % len(reps)]), config, rate, args.seed,
                        id_range, slo, not args.no_noise, k)[1] for k in range(1, paths + 1)]
        return docs, as_doc(median_summary([d["runs"][0]["summary"] for d in docs]))

    unscaled_docs, unscaled = over_paths("sim (unscaled)", lambda _: profile)
    pooled_unscaled = unscaled_docs[0]      # every path's requests, for the CDFs
    pooled_unscaled["runs"][0]["requests"] = [q for d in unscaled_docs
                                              for q in d["runs"][0]["requests"]]
    (out / f"{tag}-sim-unscaled.json").write_text(json.dumps(pooled_unscaled))
    real = as_doc(median_summary([r["real_summary"] for r in reps]))
    sim = over_paths("sim", lambda ps: ps[0])[1]
    run_speed = over_paths("sim (run speed)", lambda ps: ps[1])[1]
    if args.repeats > 1:              # pooled records of every repeat, for the CDFs
        for kind in ("real", "sim"):
            docs = [json.loads((out / f"{r['tag']}-{kind}.json").read_text()) for r in reps]
            pooled = docs[0]
            pooled["runs"][0]["requests"] = [q for d in docs for q in d["runs"][0]["requests"]]
            (out / f"{tag}-{kind}.json").write_text(json.dumps(pooled))
    pooled_real = json.loads((out / f"{tag}-real.json").read_text())
    pooled_sim = json.loads((out / f"{tag}-sim.json").read_text())
    plot([(pooled_real["label"], pooled_real), (pooled_sim["label"], pooled_sim)],
         str(out / f"{tag}-cdf.png"), f"{mix} at {rate:.3g} conversations/s ({level:g} x "
         f"simulated capacity)" + (f", {len(reps)} runs pooled" if len(reps) > 1 else ""))
    spread = {f"{name} {p}": max(r["real_summary"][key][p] for r in reps)
              / max(1e-9, min(r["real_summary"][key][p] for r in reps))
              for key, name in KEYS for p in ("p50", "p90", "p99")}
    total = lambda k: float(np.median([r[k]["total_time_ratio"] for r in reps]))  # noqa: E731
    return {"mix": mix, "level": level, "rate": rate, "conversations": n,
            "repeats": len(reps), "requests": reps[0]["requests"],
            "real_duration_s": float(np.median([r["real_duration_s"] for r in reps])),
            "sim_duration_s": float(np.median([r["sim_duration_s"] for r in reps])),
            "ratios": ratios(real, sim), "ratios_unscaled": ratios(real, unscaled),
            "ratios_no_noise": ratios(real, as_doc(median_summary(
                [r["sim_summary_no_noise"] for r in reps]))),
            "ratios_run_speed": ratios(real, run_speed), "sim_paths": paths,
            "real_spread": spread,
            "real_interval": real_intervals([r["real_summary"] for r in reps]),
            "speed_probe": None if reps[0]["speed_probe"] is None else {
                "factor": float(np.median([r["speed_probe"]["factor"] for r in reps]))},
            "step_errors": {"total_time_ratio": total("step_errors")},
            "step_errors_unscaled": {"total_time_ratio": total("step_errors_unscaled")},
            "scheduler": reps[-1]["scheduler"], "per_repeat": reps}


def max_rate_runs(args, loaded, engine_config, profile, config, id_range, slo: dict,
                  out: Path, calibrate_now) -> dict:
    """The engine's side of the max rate meeting the P90 SLO on --slo-mix: runs at
    --slo-factors x the simulated max rate of `profile` (rescaled to a speed probe taken
    first unless --no-speed-probe), --slo-repeats runs per rate in rounds (every rate once a
    round; with --interleave-calibration a calibration, calibrate_now(), before each
    round), then more rates until the engine's crossing is bracketed. Writes
    OUT/max-rate-steps.json and the pooled records per rate, OUT/max-rate-real.json;
    returns what max_rate_sims needs (pooled records and each run's attainment per rate)."""
    mix = args.slo_mix
    n_for = lambda rate: max(16, int(round(rate * args.run_seconds)))  # noqa: E731
    slo_repeats = args.slo_repeats or args.repeats
    cap = capacity(mix, profile, config, id_range, args.seed)
    probe = None
    if not args.no_speed_probe:        # one probe before the max-rate runs
        probe = speed_probe(loaded, engine_config, profile, id_range, out, "max-rate")
    paths = 0 if args.no_noise else sim_paths(args, slo_repeats)
    r_plan = sim_max_rate(mix, probe_scaled(profile, probe)[0], config, id_range, args.seed,
                          slo, n_for, cap * 0.3, cap * 1.0, paths=paths)
    log(f"{mix}: simulated max rate meeting the P90 SLO {slo}: {r_plan:.3f}/s ({paths} noise "
        f"paths; the measured rates are factors of it)")
    records, fracs, per_run, steals, slo_steps, slo_cold = {}, {}, {}, {}, [], []

    def run_at(rate: float) -> None:
        """One real run at `rate` (its own workload size); mutates the pools above."""
        n = n_for(rate)
        convs = conversations(mix, n, args.seed, id_range)
        offsets = arrival_offsets(n, rate, 1.0, args.seed).tolist()
        _, res, frac = real_run(loaded, engine_config, convs, offsets, args.max_foreign,
                                args.max_steal, attempts=3)
        records.setdefault(rate, []).extend(res.records)
        fracs.setdefault(rate, []).append(frac)
        steals.setdefault(rate, []).append(res.steal_s / res.duration_s)
        per_run.setdefault(rate, []).append(attainment(res.records, slo))
        log(f"  {rate:.3f}/s: this run's attainment {per_run[rate][-1]:.3f}")
        slo_steps.extend(step_samples(res.steps))
        slo_cold.extend(res.step_cold)

    def points() -> list[tuple[float, float]]:
        return [(rate, attainment(recs, slo)) for rate, recs in sorted(records.items())]

    rates = [r_plan * float(x) for x in args.slo_factors.split(",")]
    # in rounds (every rate once a round), so that a slow stretch of the machine is
    # shared by the rates rather than landing on one of them
    for _ in range(slo_repeats):
        if args.interleave_calibration:
            calibrate_now()
        for rate in rates:
            run_at(rate)
    # the engine's crossing must be bracketed: extend the rates upward while the
    # highest one measured still meets the SLO (and downward while none does)
    for _ in range(args.slo_extra):
        pts = points()
        top = max(pts)
        if top[1] >= 0.9:
            rate = top[0] * args.slo_step
        elif all(a < 0.9 for _, a in pts):
            rate = min(pts)[0] / args.slo_step
        else:
            break
        for _ in range(slo_repeats):
            run_at(rate)
    for rate, a in points():
        log(f"  {rate:.3f}/s: attainment real {a:.3f} over {len(fracs[rate])} runs "
            f"(foreign CPU {max(fracs[rate]):.2f})")
    (out / "max-rate-steps.json").write_text(json.dumps({"samples": slo_steps,
                                                         "cold": slo_cold}))
    (out / "max-rate-real.json").write_text(json.dumps(
        {f"{rate:.6g}": [r.to_json() for r in recs] for rate, recs in records.items()}))
    return {"mix": mix, "n_for": n_for, "cap": cap, "probe": probe, "paths": paths,
            "profile": profile, "per_run": per_run, "steals": steals,
            "repeats": slo_repeats, "planning_rate": r_plan, "records": records,
            "steps": slo_steps, "cold": slo_cold}


def max_rate_sims(args, runs: dict, profile, config, id_range, slo: dict) -> dict:
    """fidelity.json's "max_rate": the simulator's side under `profile` (probe-scaled as
    the runs' probe says, unscaled, without noise, at the runs' own speed) against the
    engine's pooled attainments from max_rate_runs."""
    mix, n_for, cap, paths = runs["mix"], runs["n_for"], runs["cap"], runs["paths"]
    unscaled_profile = profile
    scaled, probe_rec = probe_scaled(profile, runs["probe"])
    if args.local_level:      # the calibrations taken before the max-rate rounds
        scaled = at_calibrated_level(profile, max_rate_levels(
            profile.meta["pooled"]["levels"], runs["repeats"]))
        probe_rec = scaled.meta["speed_scale"]

    def max_rate(prof, paths_: int) -> float:
        return sim_max_rate(mix, prof, config, id_range, args.seed, slo, n_for, cap * 0.3,
                            cap * 1.0, paths=paths_)

    def sim_points(prof) -> list[tuple[float, float]]:
        return [(rate, sim_attainment(mix, prof, config, id_range, args.seed, slo,
                                      n_for(rate), rate, paths))
                for rate in sorted(runs["records"])]

    # the rates were planned on the same profile unless the calibration was interleaved
    r_sim = runs["planning_rate"] if profile is runs["profile"] else max_rate(scaled, paths)
    r_sim_unscaled, r_sim_no_noise = max_rate(unscaled_profile, paths), max_rate(scaled, 0)
    points_real = [(rate, attainment(recs, slo))
                   for rate, recs in sorted(runs["records"].items())]
    points_sim, points_unscaled = sim_points(scaled), sim_points(unscaled_profile)
    for (rate, a), (_, s), (_, u) in zip(points_real, points_sim, points_unscaled):
        log(f"  {rate:.3f}/s: attainment real {a:.3f}, sim {s:.3f} (unscaled {u:.3f})")
    r_real = crossing(points_real)
    interval = crossing_interval(runs["per_run"])
    if interval["lo"] is not None:
        log(f"  the engine's crossing over its runs resampled: {interval['lo']:.3f}-"
            f"{interval['hi']:.3f}/s (5-95%)")
    # the diagnostic: the simulator's max rate at the speed of the max-rate runs' steps
    at_speed = at_run_speed(unscaled_profile, runs["steps"], runs["cold"])
    r_sim_run_speed = max_rate(at_speed, paths)
    log(f"max rate: sim {r_sim:.3f} (unscaled {r_sim_unscaled:.3f}, at the runs' speed "
        f"{r_sim_run_speed:.3f}), real {r_real}")
    ratio = lambda r: r / r_real if r_real else None  # noqa: E731
    return {"mix": mix, "slo_ms": slo, "sim_bisection": r_sim,
            "planning_rate": runs["planning_rate"],
            "sim_points": points_sim, "real_points": points_real,
            "sim_interpolated": crossing(points_sim),
            "sim_points_unscaled": points_unscaled,
            "sim_interpolated_unscaled": crossing(points_unscaled),
            "sim_paths": paths, "real_interpolated": r_real, "ratio": ratio(r_sim),
            "speed_probe": probe_rec, "repeats": runs["repeats"],
            "real_per_run": sorted(runs["per_run"].items()),
            "real_steal_per_run": sorted(runs["steals"].items()),
            "real_interval": interval,
            "ratio_interval": None if interval["lo"] is None
            else [r_sim / interval["hi"], r_sim / interval["lo"]],
            "sim_bisection_unscaled": r_sim_unscaled,
            "sim_bisection_no_noise": r_sim_no_noise,
            "ratio_no_noise": ratio(r_sim_no_noise),
            "ratio_unscaled": ratio(r_sim_unscaled),
            "run_speed_factor": at_speed.meta["speed_scale"]["factor"],
            "sim_bisection_run_speed": r_sim_run_speed,
            "ratio_run_speed": ratio(r_sim_run_speed)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/sim/fidelity")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-prefault", action="store_true",
                    help="every engine (calibrations and measured runs) maps its whole KV "
                         "cache at start: a long-running server's steps, without first-use "
                         "page faults of new blocks (EngineConfig.kv_prefault)")
    ap.add_argument("--dtype", default="auto",
                    help="the engine's --dtype, in the calibrations and the measured runs "
                         "(float32: no bf16 GEMMs, so no AMX; docs/simulator.md §3, r28)")
    ap.add_argument("--profile", default=None, help="use this profile instead of calibrating")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--levels", default="0.4,0.8", help="fractions of the simulated capacity")
    ap.add_argument("--run-seconds", type=float, default=45.0, help="arrival span per run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-foreign", type=float, default=0.15)
    ap.add_argument("--max-steal", type=float, default=0.1,
                    help="a max-rate run during which the hypervisor took more than this "
                         "much of a core (steal) is redone, at most twice: attainment near "
                         "the crossing collapses under steal (docs/simulator.md §3, r31)")
    ap.add_argument("--slo-mix", default="chat")
    ap.add_argument("--slo", default=None,
                    help="P90 SLO (ms) for the max rate, e.g. ttft=600,tpot=60; default: "
                         "--slo-scale x the simulator's unloaded p90s on --slo-mix")
    ap.add_argument("--slo-scale", type=float, default=3.0,
                    help="without --slo: the SLO is this many times the simulator's p90 "
                         "TTFT and TPOT of --slo-mix at 0.1 x capacity (DistServe's SLO "
                         "scale), taken under the rates' profile before any measured run")
    ap.add_argument("--slo-factors", default="0.8,1.0,1.25,1.5")
    ap.add_argument("--slo-extra", type=int, default=4,
                    help="at most this many more rates to bracket the engine's crossing")
    ap.add_argument("--slo-step", type=float, default=1.25,
                    help="factor between an extra rate and the last one")
    ap.add_argument("--skip-fidelity", action="store_true")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure every mix and level this many times, in rounds; cells "
                         "compare the simulation with the medians over the repeats")
    ap.add_argument("--slo-repeats", type=int, default=None,
                    help="real runs per rate in the max-rate search, their requests pooled "
                         "(default: --repeats)")
    ap.add_argument("--sim-paths", type=int, default=20,
                    help="noise paths simulated per cell (medians over them) and per "
                         "max-rate attainment (pooled): the simulator's expectation, not "
                         "one draw per real repeat")
    ap.add_argument("--no-noise", action="store_true",
                    help="simulate without the profile's step-time noise (sim/noise.py)")
    ap.add_argument("--interleave-calibration", action="store_true",
                    help="with --calibrate: calibrate again before every round (of the "
                         "cells and of the max-rate runs) and simulate everything with "
                         "one fit over all the calibrations (sim_calibrate.pooled_profile)")
    ap.add_argument("--rate-calibrations", type=int, default=1,
                    help="with --interleave-calibration: calibrate this many times before "
                         "the first round and set the rates from their pooled fit")
    ap.add_argument("--quick-calibration", action="store_true",
                    help="calibrate with `duet simulate --calibrate --quick` (seconds, a "
                         "rough fit: smoke runs of this script only)")
    ap.add_argument("--no-speed-probe", action="store_true",
                    help="simulate with the calibrated profile as saved (no probe before runs)")
    ap.add_argument("--local-level", action="store_true",
                    help="with --interleave-calibration and --no-speed-probe: simulate each "
                         "round's runs with the pooled fit at the level of the calibrations "
                         "taken right before and after that round (sim/speed."
                         "at_calibrated_level), the max-rate runs at their rounds' "
                         "calibrations'; the pooled fit as is stays as `ratios_unscaled`")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.entrypoints.sim_calibrate import calibrate, format_report, pooled_profile

    t_start = time.perf_counter()
    engine_config = EngineConfig(num_threads=args.threads, kv_prefault=args.kv_prefault,
                                 dtype=args.dtype)
    probe = EngineCore(engine_config)     # loads the weights as `duet serve --dtype` does
    loaded = probe.loaded
    log(f"model: {loaded.describe()}")
    config = probe.scheduler.config
    id_range = id_range_for_vocab(probe.model_config.vocab_size)
    del probe
    if args.interleave_calibration and not args.calibrate:
        ap.error("--interleave-calibration needs --calibrate")
    if args.rate_calibrations < 1 or (args.rate_calibrations > 1
                                      and not args.interleave_calibration):
        ap.error("--rate-calibrations takes N >= 1, and N > 1 needs --interleave-calibration")
    if args.local_level and not (args.interleave_calibration and args.no_speed_probe):
        ap.error("--local-level needs --interleave-calibration and --no-speed-probe")
    calibrations: list[Path] = []

    def calibrate_now():
        """One calibration (OUT/profile.json, or OUT/profile-K.json when interleaved)."""
        k = len(calibrations) + 1
        wait_until_quiet(0.1, 5.0, 600.0)
        name = f"profile-{k}.json" if args.interleave_calibration else "profile.json"
        prof, path = calibrate(None, args.threads, quick=args.quick_calibration,
                               out=out / name, loaded=loaded, kv_prefault=args.kv_prefault,
                               dtype=args.dtype)
        log(format_report(prof, path))
        calibrations.append(path)
        return prof

    if args.calibrate:
        profile = calibrate_now()
        if args.rate_calibrations > 1:
            for _ in range(args.rate_calibrations - 1):
                calibrate_now()
            profile = pooled_profile(calibrations, out / "profile-rates.json")
            log(f"rates from {len(calibrations)} calibrations pooled "
                f"({out / 'profile-rates.json'}): levels under it "
                f"{', '.join(f'{x:.3f}' for x in profile.meta['pooled']['levels'])}")
    else:
        profile = load_profile(args.profile)
    results = {"profile": profile.to_json(), "scheduler": asdict(config), "runs": [],
               "max_rate": None, "kv_prefault": args.kv_prefault}
    if args.slo:
        slo = {k: float(v) for k, v in (kv.split("=") for kv in args.slo.split(","))}
    else:
        slo_mix = args.slo_mix or "chat"
        slo = scaled_slo(slo_mix, profile, config, id_range, args.seed, args.slo_scale,
                         args.run_seconds)
        log(f"P90 SLO: {args.slo_scale:g} x the simulator's unloaded p90s on {slo_mix}: {slo} ms")
    results["slo_ms"] = slo
    plans = []
    if not args.skip_fidelity:
        for mix in args.mixes.split(","):
            cap = capacity(mix, profile, config, id_range, args.seed)
            log(f"{mix}: simulated capacity {cap:.3f} conversations/s")
            for level in (float(x) for x in args.levels.split(",")):
                rate = cap * level
                n = max(16, int(round(rate * args.run_seconds)))
                plans.append({"mix": mix, "level": level, "rate": rate, "conversations": n,
                              "reps": []})
        # repeats run in rounds (every mix and level once a round), so that each cell's
        # repeats sample different stretches of the machine's speed
        for rep in range(1, args.repeats + 1):
            if args.interleave_calibration and rep > 1:
                calibrate_now()
            for plan in plans:
                plan["reps"].append(measure(plan, rep, args, loaded, engine_config, profile,
                                            id_range, slo, out))
    max_rate = None
    if args.slo_mix:
        max_rate = max_rate_runs(args, loaded, engine_config, profile, config, id_range, slo,
                                 out, calibrate_now)
    if args.interleave_calibration:
        # every simulated figure below uses one fit over all the calibrations, spread over
        # the measured runs' time (the rates above came from the first --rate-calibrations)
        profile = pooled_profile(calibrations, out / "profile.json")
        fit = profile.meta["fit"]
        log(f"pooled profile {out / 'profile.json'} over {len(calibrations)} calibrations, "
            f"{fit['num_steps']} steps: {profile.cost.describe()}; RMS relative error "
            f"{fit['rms_rel_error']:.3f}; "
            + (profile.step_noise.describe() if profile.step_noise else "no noise measured"))
        log(f"calibration levels under the pooled fit: "
            f"{', '.join(f'{x:.3f}' for x in profile.meta['pooled']['levels'])}")
        results["profile"] = profile.to_json()
    for plan in plans:
        for rec in plan["reps"]:
            simulate_rep(plan, rec, args, profile, config, id_range, slo, out)
        results["runs"].append(aggregate(plan, profile, config, args, id_range, slo, out))
        (out / "fidelity.json").write_text(json.dumps(results, indent=1))
        if args.repeats > 1:
            run = results["runs"][-1]
            log(f"{run['mix']}-{run['level']:g}: the engine's own interval over its repeats "
                "(5-95%, over the median): " + ", ".join(
                    f"{k} {lo:.2f}-{hi:.2f}" for k, (lo, hi) in run["real_interval"].items()))
    if args.repeats > 1 and plans:
        results["speed_decomposition"] = speed_decomposition(plans)
        log(f"run speed factors: {json.dumps(results['speed_decomposition'])}")
    if max_rate is not None:
        results["max_rate"] = max_rate_sims(args, max_rate, profile, config, id_range, slo)
    results["total_s"] = time.perf_counter() - t_start
    (out / "fidelity.json").write_text(json.dumps(results, indent=1))
    log(f"done in {results['total_s']:.0f} s; wrote {out / 'fidelity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
