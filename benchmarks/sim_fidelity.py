"""Does `duet simulate` predict this machine's engine? Simulated against measured TTFT and
TPOT medians, per workload mix and load.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_fidelity.py --calibrate --out out/sim/fidelity
    PYTHONPATH=. .venv/bin/python benchmarks/sim_fidelity.py --profile P.json --out out/sim/f2

For each mix (MIXES) and load level (a fraction of the capacity the simulation gives that
mix, everything queued at once): the same seeded conversations and arrival schedule run
(a) on a fresh in-process EngineCore with `duet serve`'s defaults, on the wall clock
(bench/replay.py: the engine's own steps, no HTTP), --repeats times, and (b) in the
simulator on the profile, with the engine's scheduler settings. Printed per cell: the
measured TTFT and TPOT p50 (the median over the repeats) and their spread over the repeats
(max / min: the run-to-run noise the comparison sits in), the simulated p50s and the
ratios simulated / measured, and the profile's price of the served runs' own steps over
their measured time ("steps", the median over the repeats): a latency ratio off by about
as much as "steps" is the step-time model's miss (or the VM's speed drifting between the
calibration and the run: it drifts by 10-50% within an hour); the rest is the schedule's.
A second count simulates each cell on the profile scaled by 1 / steps: the VM's drift out.
OUT/fidelity.json keeps every run. The target is every ratio within 0.85-1.15. Run it
alone on the machine: another process's load slows the measured side only.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from duetserve.bench.bench_metrics import summarize
from duetserve.bench.datasets import make_dataset
from duetserve.bench.replay import replay
from duetserve.bench.token_workload import (arrival_offsets, id_range_for_vocab,
                                             token_conversations)
from duetserve.core.step_time import StepShape
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.profile import load_profile
from duetserve.sim.run import simulate

MIXES = {
    "chat": dict(dataset="chat", input_len="32:128", output_len="32:96", num_turns=3),
    "prefill-heavy": dict(dataset="random", input_len="384:768", output_len="8:24",
                          num_turns=1),
    "decode-heavy": dict(dataset="random", input_len="16:64", output_len="96:192",
                         num_turns=1),
}
KEYS = ("ttft_ms", "tpot_ms")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def conversations(mix: str, n: int, seed: int, id_range: tuple[int, int]):
    spec = MIXES[mix]
    convs = make_dataset(spec["dataset"], num_prompts=n, input_len=spec["input_len"],
                         output_len=spec["output_len"], num_turns=spec["num_turns"],
                         seed=seed)
    return token_conversations(convs, id_range)


def capacity(mix: str, profile, config, id_range, seed: int) -> float:
    """Simulated throughput of `mix` (conversations/s) with everything queued at once."""
    convs = conversations(mix, 200, seed, id_range)
    res = simulate(convs, profile, ClusterSpec(1), math.inf, 1.0, seed, None, config, id_range)
    return len(convs) / res.duration_s


def p50s(records, duration: float) -> dict[str, float]:
    summary = summarize(records, duration, [50], None)
    return {k: summary[k]["p50"] for k in KEYS}


def priced_ratio(res, profile) -> float:
    """The profile's price of a served run's own steps over their measured time (sum over
    the steps): how far the step-time model misses this run's steps, whether from the
    model or from the VM's speed having drifted since the calibration. The rest of a
    latency ratio's miss is the simulated schedule's."""
    st = profile.step_time
    priced = sum(st.seconds(StepShape.of(slices, st.layout, cold > 0))
                 for (_, _, slices), cold in zip(res.steps, res.step_cold))
    return priced / sum(dt for _, dt, _ in res.steps)


def cell(mix: str, level: float, args, engine_config, loaded, profile, config, id_range
         ) -> dict:
    """One mix at one load: the measured runs and the simulation."""
    from duetserve.engine.engine_core import EngineCore
    rate = level * capacity(mix, profile, config, id_range, args.seed)
    n = max(16, int(round(rate * args.run_seconds)))
    convs = conversations(mix, n, args.seed, id_range)
    offsets = arrival_offsets(n, rate, 1.0, args.seed).tolist()
    runs, priced = [], []
    for rep in range(args.repeats):
        res = replay(EngineCore(engine_config, loaded), convs, offsets)
        runs.append(p50s(res.records, res.duration_s))
        priced.append(priced_ratio(res, profile))
        log(f"{mix} {level}: run {rep + 1}/{args.repeats}: {runs[-1]}, steps priced / "
            f"measured {priced[-1]:.2f}")
    steps = statistics.median(priced)

    def simulated_p50s(step_time) -> dict[str, float]:
        sim = simulate(convs, replace(profile, step_time=step_time), ClusterSpec(1), rate,
                       1.0, args.seed, None, config, id_range)
        return p50s(sim.records, sim.duration_s)
    simulated = simulated_p50s(profile.step_time)
    at_speed = simulated_p50s(profile.step_time.scaled(1.0 / steps))
    measured = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    return {"mix": mix, "level": level, "rate": rate, "requests": n, "runs": runs,
            "steps_priced": steps, "measured": measured, "simulated": simulated,
            "spread": {k: max(r[k] for r in runs) / min(r[k] for r in runs) for k in KEYS},
            "ratio": {k: simulated[k] / measured[k] for k in KEYS},
            # the simulation on the profile scaled to the served runs' step speed
            "ratio_at_served_speed": {k: at_speed[k] / measured[k] for k in KEYS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/sim/fidelity")
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", default=None, help="use this profile instead of calibrating")
    ap.add_argument("--calibrate", action="store_true",
                    help="run `duet simulate --calibrate` first, into OUT/profile.json")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--levels", default="0.4,0.8", help="fractions of the simulated capacity")
    ap.add_argument("--run-seconds", type=float, default=45.0, help="arrival span per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    from duetserve.config import EngineConfig
    from duetserve.entrypoints.sim_calibrate import calibrate, format_report
    from duetserve.loader import load_model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine_config = EngineConfig(model=args.model, num_threads=args.threads, dtype=args.dtype)
    loaded = load_model(args.model, args.dtype, quantization=engine_config.quantization)
    if args.calibrate:
        profile, path = calibrate(args.model, args.threads, out=out / "profile.json",
                                  loaded=loaded, dtype=args.dtype)
        print(format_report(profile, path))
    elif args.profile:
        profile = load_profile(args.profile)
    else:
        ap.error("give --calibrate or --profile")
    config = profile.scheduler_config()
    id_range = id_range_for_vocab(loaded.config.vocab_size)
    cells = [cell(mix, float(level), args, engine_config, loaded, profile, config, id_range)
             for level in args.levels.split(",") for mix in args.mixes.split(",")]
    print(f"{'mix':>14} {'load':>5} | {'TTFT p50 ms':>11} {'spread':>6} {'sim':>8} {'ratio':>5}"
          f" | {'TPOT p50 ms':>11} {'spread':>6} {'sim':>8} {'ratio':>5} | {'steps':>5}")
    for c in cells:
        cols = " | ".join(f"{c['measured'][k]:11.1f} {c['spread'][k]:6.2f} "
                          f"{c['simulated'][k]:8.1f} {c['ratio'][k]:5.2f}" for k in KEYS)
        print(f"{c['mix']:>14} {c['level']:5.2f} | {cols} | {c['steps_priced']:5.2f}")
    for key, how in (("ratio", ""), ("ratio_at_served_speed", " with the profile scaled by "
                                                             "1 / steps (the VM's drift out)")):
        within = sum(0.85 <= c[key][k] <= 1.15 for c in cells for k in KEYS)
        print(f"{within} of {2 * len(cells)} p50 ratios within 0.85-1.15{how}")
    (out / "fidelity.json").write_text(json.dumps(
        {"args": vars(args), "profile": profile.to_json(), "cells": cells}, indent=1))
    print(f"wrote {out / 'fidelity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
