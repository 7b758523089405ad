"""Re-examine a fidelity run (benchmarks/sim_fidelity.py's output folder) without the engine.

The measured side of a fidelity run does not depend on the cost model, so the simulated
side can be recomputed offline with another fit, and the cost model's misses read step by
step from the engine's own steps (`*-steps.json`). Two reports:

  steps   per run and step class (decode-only / prefill-only / mixed, few or many rows):
          steps, measured and predicted mean ms, predicted / measured total
  ratios  sim / real TTFT and TPOT p50 / p90 / p99 per run, with the profile's cost model
          or a refit (`--refit`: the calibration samples next to the profile, plus the
          steps of the runs named by `--fit-runs`, which then no longer test the fit)

    PYTHONPATH=. .venv/bin/python benchmarks/sim_refit.py out/sim/fidelity [--refit]

--run-speed: each run simulated at its own steps' speed (sim/speed.at_run_speed), the
fidelity benchmark's diagnostic that takes the machine's speed out of the comparison.

Runs measured with the speed probe (`TAG-probe.json` beside them, the calibration's probe
in the profile's samples file) are simulated, as the benchmark did, with the profile
rescaled by the probe taken before the run, the factor recomputed under the cost model in
use (a refit changes the predictions both probes are divided by); --no-probe: unscaled.

Reads the folder only; writes nothing unless `--save-profile` is given.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from duetserve.bench.token_workload import DEFAULT_ID_RANGE
from duetserve.entrypoints.sim_calibrate import recorded_cold, saved_traces
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.cost import run_shapes, with_idle
from duetserve.sim.fit import fit_cost
from duetserve.sim.noise import estimate as estimate_noise
from duetserve.sim.noise import level_of
from duetserve.sim.profile import calibrated_profile, load_profile
from duetserve.sim.run import run_json, simulate
from duetserve.sim.speed import at_calibrated_level, at_run_speed, probe_ratio, rescaled

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_fidelity import (PERCENTILES, conversations, local_levels,  # noqa: E402
                          max_rate_levels, median_summary, ratios, rep_tag, sim_attainment,
                          sim_max_rate, step_samples)
from sim_fidelity_plot import within_target  # noqa: E402


def step_class(slices, breakpoint: int) -> str:
    rows = sum(n for n, _, _ in slices)
    decodes = sum(1 for n, _, _ in slices if n == 1)
    many = "many" if rows > breakpoint else "few"
    if decodes == len(slices):
        return f"decode-only {many}"
    if decodes == 0:
        return f"prefill-only {many}"
    return f"mixed {many}"


def step_cold(d: Path, tag: str, steps) -> list:
    """The run's cold values (sim/cost.py cold_state; runs before they were recorded: none
    cold), the idle times of runs from before those were recorded filled in from the
    steps' starts (sim/cost.py with_idle)."""
    info = d / f"{tag}-stepinfo.json"
    if not info.exists():
        return [False] * len(steps)
    return with_idle(json.loads(info.read_text())["cold"], [s for s, _, _ in steps],
                     [dt for _, dt, _ in steps])


def cell_tags(d: Path, name: str) -> list[str]:
    """The measured runs NAME stands for in folder D: itself (a run's tag, MIX-LEVEL or
    MIX-LEVEL-repK), or a repeated cell's every repeat in order; [] when neither exists."""
    if (d / f"{name}-steps.json").exists():
        return [name]
    reps = sorted(d.glob(f"{name}-rep*-steps.json"),
                  key=lambda f: int(f.name[len(name) + 4:-len("-steps.json")] or 0))
    return [f.name[:-len("-steps.json")] for f in reps]


def run_tags(d: Path, name: str) -> list[str]:
    """cell_tags, or SystemExit naming the runs the folder holds when there are none."""
    tags = cell_tags(d, name)
    if not tags:
        have = sorted(f.name[:-len("-steps.json")] for f in d.glob("*-steps.json"))
        raise SystemExit(f"no measured run {name!r} in {d} (runs there: {', '.join(have)})")
    return tags


def step_report(steps, cold, cost) -> dict:
    by: dict[str, list[tuple[float, float]]] = {}
    for (_, dt, slices), shape in zip(steps, run_shapes(cost, [sl for _, _, sl in steps], cold)):
        pred = cost.step_seconds(shape)
        by.setdefault(step_class(slices, cost.breakpoint), []).append((dt, pred))
    out = {}
    for k, v in sorted(by.items()):
        a = np.array(v)
        out[k] = {"steps": len(v), "meas_ms": 1e3 * a[:, 0].mean(),
                  "pred_ms": 1e3 * a[:, 1].mean(), "ratio": a[:, 1].sum() / a[:, 0].sum()}
    return out


def probed(profile, d: Path, tag: str, reference: dict | None):
    """The profile rescaled by run TAG's speed probe (None when there is none)."""
    path = d / f"{tag}-probe.json"
    if reference is None or not path.exists():
        return None
    now = json.loads(path.read_text())
    ref = probe_ratio(profile.cost, reference["samples"], reference["cold"])
    base = calibrated_profile(profile.name, profile.cost, profile.scheduler,
                              {**profile.meta, "speed_probe": ref}, profile.description)
    return rescaled(base, probe_ratio(profile.cost, now["samples"], now["cold"]))


def scenario_noise(raw: dict, profile) -> dict | None:
    """sim/noise.py's estimate from the samples file's serving scenario under `profile`'s
    cost. Files from before start times were saved: each trace's steps placed back to back
    (idle spells dropped), the traces told apart by the profile's step counts."""
    if "serving_starts" not in raw:
        g = raw.get("grid_steps", len(raw["samples"]))
        samples = raw["samples"][g:]
        counts = [t["steps"] for t in profile.meta.get("serving", {}).get("traces", [])] \
            or [len(samples)]
        starts, i = [], 0
        for n in counts:
            starts.append(list(np.cumsum([0.0] + [dt for _, dt in samples[i:i + n - 1]])))
            i += n
        raw = {**raw, "serving_starts": starts}
    noise = estimate_noise(saved_traces(raw, profile.cost, grid=False))
    return noise.to_json() if noise is not None else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--profile", default=None, help="default DIR/profile.json")
    ap.add_argument("--refit", action="store_true")
    ap.add_argument("--fit-runs", default="",
                    help="runs (mix-level, or mix-level-repK) whose steps join the fit; a "
                         "repeated cell's name: all its repeats")
    ap.add_argument("--no-grid", action="store_true",
                    help="refit without the profile's samples (grid and serving scenario)")
    ap.add_argument("--grid-only", action="store_true",
                    help="of the profile's samples, the grid's only (no serving scenario)")
    ap.add_argument("--flash-above", type=int, default=None,
                    help="split of chunks after context (default: the profile's)")
    ap.add_argument("--breakpoint", type=int, default=None,
                    help="kernel breakpoint of the refit (default: the profile's `few_rows`, "
                         "the engine's switch; 0 or absent: fitted)")
    ap.add_argument("--decode-split", default=None,
                    help="THREADS,KV_HEADS of the engine's paged decode attention for the "
                         "refit (default: the profile's; 0,0: the rows' context summed)")
    ap.add_argument("--save-profile", default=None)
    ap.add_argument("--runs", default="", help="only these runs (mix-level), default all")
    ap.add_argument("--no-probe", action="store_true",
                    help="simulate with the profile unscaled even where a run has a probe")
    ap.add_argument("--run-speed", action="store_true",
                    help="simulate each run with the profile rescaled to that run's own "
                         "steps (sim/speed.at_run_speed: the diagnostic, not a prediction)")
    ap.add_argument("--local-level", action="store_true",
                    help="simulate each round's runs with the pooled profile at the level of "
                         "the calibrations taken right before and after that round "
                         "(sim/speed.at_calibrated_level; a prediction: no run's steps)")
    ap.add_argument("--noise", choices=("profile", "estimate", "none"), default="profile",
                    help="step-time noise of the simulations: the profile's (sim/noise.py), "
                         "re-estimated from its serving scenario under the cost in use, or none")
    ap.add_argument("--level", choices=("profile", "pooled", "none"), default="profile",
                    help="the noise's run-to-run level (sim/noise.py): the profile's, the "
                         "spread of its pooled calibrations' levels (for profiles pooled "
                         "before it was measured), or none")
    ap.add_argument("--sim-paths", type=int, default=0,
                    help="noise paths simulated per run (default: one per repeat, as the "
                         "benchmark); path K uses repeat ((K-1) mod repeats)+1's profile")
    ap.add_argument("--max-rate", action="store_true",
                    help="also the simulator's max rate meeting the run's P90 SLO")
    args = ap.parse_args()
    d = Path(args.dir)
    fid = json.loads((d / "fidelity.json").read_text())
    ppath = Path(args.profile) if args.profile else d / "profile.json"
    if args.refit:      # the saved cost may have older features: keep its scheduler only
        doc = json.loads(ppath.read_text())
        samples, cold = [], []
        if not args.no_grid:
            raw = json.loads(ppath.with_suffix(".samples.json").read_text())
            keep = raw.get("grid_steps") if args.grid_only else None
            samples += raw["samples"][:keep]
            cold += recorded_cold(raw)[:keep]
        for tag in (t for name in filter(None, args.fit_runs.split(","))
                    for t in run_tags(d, name)):
            steps = json.loads((d / f"{tag}-steps.json").read_text())
            samples += step_samples(steps)
            cold += step_cold(d, tag, steps)
        flash_above = doc["cost"].get("flash_above", 0) if args.flash_above is None \
            else args.flash_above
        few_rows = doc.get("meta", {}).get("few_rows", 0) if args.breakpoint is None \
            else args.breakpoint
        split = tuple(doc["cost"].get("decode_split", (0, 0))) if args.decode_split is None \
            else tuple(int(x) for x in args.decode_split.split(","))
        cost, report = fit_cost(samples, doc["cost"].get("arrival_s", 0.0), cold, flash_above,
                                doc["cost"].get("chunk_rows", 0), few_rows, split)
        print(f"refit over {len(samples)} steps: {cost.describe()}")
        print(f"  {json.dumps(report)}")
        profile = calibrated_profile(doc["name"], cost, doc["scheduler"],
                                     {**doc.get("meta", {}), "fit": report},
                                     doc.get("description", ""))
        if args.save_profile:
            profile.save(args.save_profile)
    else:
        profile = load_profile(ppath)
        print(profile.cost.describe())
    config = profile.scheduler_config()
    slo = {"ttft": 600.0, "tpot": 60.0}
    raw_path = ppath.with_suffix(".samples.json")
    reference = None              # the calibration's speed probe
    if raw_path.exists():         # the calibration's own steps: grid, serving scenario
        raw = json.loads(raw_path.read_text())
        reference = None if args.no_probe else raw.get("probe")
        g = raw.get("grid_steps", len(raw["samples"]))
        flags = recorded_cold(raw)
        for name, lo, hi in (("grid", 0, g), ("serving scenario", g, len(raw["samples"]))):
            if hi > lo:
                print(f"\ncalibration {name}: {hi - lo} steps")
                steps = [(0.0, dt, sl) for sl, dt in raw["samples"][lo:hi]]
                for k, v in step_report(steps, flags[lo:hi], profile.cost).items():
                    print(f"  {k:20s} {v['steps']:5d} steps  meas {v['meas_ms']:7.1f} ms  "
                          f"pred {v['pred_ms']:7.1f} ms  ratio {v['ratio']:.3f}")
        if args.noise == "estimate":
            profile.meta["noise"] = scenario_noise(raw, profile)
    if args.noise == "none":
        profile.meta["noise"] = None
    if args.level != "profile" and profile.meta.get("noise"):
        levels = profile.meta.get("pooled", {}).get("levels", [])
        if args.level == "pooled" and len(levels) < 3:
            ap.error(f"--level pooled needs a profile pooled over 3+ calibrations ({ppath})")
        profile.meta["noise"] = {**profile.meta["noise"],
                                 "level": level_of(levels) if args.level == "pooled" else 0.0}
    print(f"noise: {profile.step_noise.describe() if profile.step_noise else 'none'}")
    pooled_levels = profile.meta.get("pooled", {}).get("levels", [])
    if args.local_level:      # the calibrations: --rate-calibrations, then one a round
        rounds = max(r.get("repeats", 1) for r in fid["runs"]) - 1 \
            + ((fid.get("max_rate") or {}).get("repeats", 0))
        rate_calibrations = len(pooled_levels) - rounds
        if rate_calibrations < 1:
            ap.error(f"--local-level needs an interleaved run's pooled profile ({ppath})")
    met = {"p50/p90": 0, "cells p50/p90": 0, "p99": 0, "cells p99": 0}
    for run in fid["runs"]:
        tag = f"{run['mix']}-{run['level']:g}"
        if args.runs and tag not in args.runs.split(","):
            continue
        # a run measured N times (sim_fidelity.py --repeats): files TAG-repK-*, cells the
        # medians over the repeats, as the benchmark computes them
        n_rep = run.get("repeats", 1)
        convs = conversations(run["mix"], run["conversations"], 1, DEFAULT_ID_RANGE)
        print(f"\n{tag} @ {run['rate']:.3f}/s, {run['requests']} requests"
              + (f", {n_rep} repeats" if n_rep > 1 else ""))
        reals, sims, rep_profiles = [], [], []
        for rep in range(1, n_rep + 1):
            t = rep_tag(run["mix"], run["level"], rep, n_rep)
            steps = json.loads((d / f"{t}-steps.json").read_text())
            run_profile = probed(profile, d, t, reference) or profile
            if args.run_speed:
                run_profile = at_run_speed(profile, step_samples(steps),
                                           step_cold(d, t, steps))
            elif args.local_level:
                run_profile = at_calibrated_level(profile, local_levels(
                    pooled_levels, rep, rate_calibrations))
            factor = run_profile.meta.get("speed_scale", {}).get("factor")
            print(f"  {t}" + (f", speed factor {factor:.3f}" if factor else ""))
            for k, v in step_report(steps, step_cold(d, t, steps), run_profile.cost).items():
                print(f"    {k:20s} {v['steps']:5d} steps  meas {v['meas_ms']:7.1f} ms  "
                      f"pred {v['pred_ms']:7.1f} ms  ratio {v['ratio']:.3f}")
            reals.append(json.loads((d / f"{t}-real.json").read_text())["runs"][0]["summary"])
            rep_profiles.append(run_profile)
        for k in range(1, max(n_rep, args.sim_paths) + 1):   # path k: repeat k's profile
            sres = simulate(convs, rep_profiles[(k - 1) % n_rep], ClusterSpec(1), run["rate"],
                            1.0, 1, None, config, DEFAULT_ID_RANGE, noise_seed=k)
            sims.append(run_json(sres, run["rate"], 1.0, None, PERCENTILES, slo)["summary"])
        r = ratios({"runs": [{"summary": median_summary(reals)}]},
                   {"runs": [{"summary": median_summary(sims)}]})
        print("  " + "  ".join(f"{k} {v['real_ms']:.0f}/{v['sim_ms']:.0f} ({v['ratio']:.2f})"
                               for k, v in r.items()))
        for k, v in r.items():
            met["p99" if k.endswith("p99") else "p50/p90"] += within_target(k, v["ratio"])
            met["cells p99" if k.endswith("p99") else "cells p50/p90"] += 1
    print(f"\nwithin target: p50/p90 {met['p50/p90']} of {met['cells p50/p90']}, "
          f"p99 {met['p99']} of {met['cells p99']}")
    mr = fid.get("max_rate")
    if args.max_rate and mr:      # the simulator's side of the max-rate item, offline
        slo_mr = mr["slo_ms"]
        n_for = lambda rate: max(16, int(round(rate * 45.0)))  # noqa: E731 (as the benchmark)
        real = mr["real_interpolated"]
        steps_path = d / "max-rate-steps.json"
        if args.run_speed and steps_path.exists():
            raw_steps = json.loads(steps_path.read_text())
            profile = at_run_speed(profile, raw_steps["samples"], raw_steps["cold"])
        elif args.local_level:    # the calibrations taken during the max-rate runs
            profile = at_calibrated_level(profile, max_rate_levels(pooled_levels,
                                                                   mr["repeats"]))
        else:
            profile = probed(profile, d, "max-rate", reference) or profile
        paths = 0 if args.noise == "none" else max(mr.get("repeats", 1), args.sim_paths)
        r_sim = sim_max_rate(mr["mix"], profile, config, DEFAULT_ID_RANGE, 1, slo_mr, n_for,
                             mr["sim_bisection"] * 0.5, mr["sim_bisection"] * 1.5,
                             paths=paths)
        att = [sim_attainment(mr["mix"], profile, config, DEFAULT_ID_RANGE, 1, slo_mr,
                              n_for(rate), rate, paths) for rate, _ in mr["real_points"]]
        print(f"\nmax rate ({mr['mix']}, {slo_mr}, {paths} noise paths): sim {r_sim:.3f}, "
              f"real {real}, ratio "
              f"{r_sim / real if real else None}")
        print("  real points " + ", ".join(f"{r:.3f}: {a:.2f}" for r, a in mr["real_points"]))
        print("  sim there   " + ", ".join(f"{a:.2f}" for a in att))
    return 0


if __name__ == "__main__":
    sys.exit(main())
