"""Does `duet simulate` predict this machine's engine? Simulated against measured TTFT and
TPOT medians, per workload mix and load.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_fidelity.py --calibrate --out out/sim/fidelity
    PYTHONPATH=. .venv/bin/python benchmarks/sim_fidelity.py --profile P.json --out out/sim/f2
    # docs/simulator.md's example workload (bench serve's chat, 50 conversations at 0.5/s)
    PYTHONPATH=. .venv/bin/python benchmarks/sim_fidelity.py --calibrate --mixes chat-example \
        --rate 0.5 --run-seconds 100 --seed 0 --out out/sim/example

For each mix (MIXES) and load level (a fraction of the capacity the first profile's
simulation gives that mix, everything queued at once; or --rate): the same seeded conversations and
arrival schedule run (a) on a fresh in-process EngineCore with `duet serve`'s defaults, on
the wall clock (bench/replay.py: the engine's own steps, no HTTP), --repeats times, the cells
taken round robin (forward, then backward) so that each cell's runs span the whole run, and
(b) in the simulator on the profile, with the engine's scheduler settings. Printed per cell:
the measured TTFT and TPOT p50 (the median over the repeats) and their spread over the
repeats (max / min: the run-to-run noise the comparison sits in), the simulated p50s and the
ratios simulated / measured, and the profile's price of the served runs' own steps over
their measured time ("steps", the median over the repeats): a latency ratio off by about as
much as "steps" is the step-time model's miss (or the VM's speed drifting between the
calibration and the run: it drifts by 10-50% within an hour); the rest is the schedule's.
The first count is what a user gets from one calibration before serving. With --calibrate
the harness calibrates again after each round of served runs, prints how each later profile
prices the served steps against the first (on this VM calibrations a few minutes apart
differ by 10-30%: its speed moves on that scale), and counts the cells simulated on the mean
of all the calibrations (which sample the VM across the run, as the round robin samples
each cell). A last count simulates each cell on the first profile scaled by 1 / steps: the
VM's drift out, a diagnostic of the simulated schedule alone. OUT/fidelity.json keeps every
run. The target is every ratio within 0.85-1.15. Run it alone on the machine: another
process's load slows the measured side only.
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
from duetserve.bench.serve import add_dataset_arguments
from duetserve.bench.token_workload import (arrival_offsets, id_range_for_vocab,
                                             token_conversations)
from duetserve.core.step_time import StepShape, StepTime
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


def _bench_serve_chat() -> dict:
    """`duet bench serve --dataset chat`'s dataset with its default lengths and turns (read
    from its own parser): docs/simulator.md's example workload."""
    p = argparse.ArgumentParser()
    add_dataset_arguments(p)
    a = p.parse_args(["--dataset", "chat"])
    return dict(dataset=a.dataset, input_len=a.input_len, output_len=a.output_len,
                num_turns=a.num_turns)


MIXES["chat-example"] = _bench_serve_chat()
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


def step_shapes(res, layout) -> list:
    """A served run's steps as (StepShape, measured seconds)."""
    return [(StepShape.of(slices, layout, cold > 0), dt)
            for (_, dt, slices), cold in zip(res.steps, res.step_cold)]


def priced_ratio(shapes, step_time) -> float:
    """The profile's price of a served run's own steps over their measured time (sum over
    the steps): how far the step-time model misses this run's steps, whether from the
    model or from the VM's speed having drifted since the calibration. The rest of a
    latency ratio's miss is the simulated schedule's."""
    return sum(step_time.seconds(s) for s, _ in shapes) / sum(dt for _, dt in shapes)


def mean_step_time(models):
    """The step time whose price of every shape is the mean of the models' (a step time is
    linear in its coefficients)."""
    return StepTime(models[0].layout,
                    tuple(statistics.fmean(c) for c in zip(*(m.coef for m in models))))


class Cell:
    """One mix at one load: its workload (the rate from the first profile's simulated
    capacity), its served runs, and its simulations."""

    def __init__(self, mix: str, level: float | None, args, profile, config, id_range) -> None:
        self.mix, self.level = mix, level
        self.rate = args.rate if level is None else \
            level * capacity(mix, profile, config, id_range, args.seed)
        self.n = max(16, int(round(self.rate * args.run_seconds)))
        self.convs = conversations(mix, self.n, args.seed, id_range)
        self.offsets = arrival_offsets(self.n, self.rate, 1.0, args.seed).tolist()
        self.runs: list[dict] = []
        self.shapes: list[list] = []

    def serve(self, engine_config, loaded, layout) -> dict:
        from duetserve.engine.engine_core import EngineCore
        res = replay(EngineCore(engine_config, loaded), self.convs, self.offsets)
        self.runs.append(p50s(res.records, res.duration_s))
        self.shapes.append(step_shapes(res, layout))
        return self.runs[-1]

    def simulated_p50s(self, profile, step_time, config, id_range, seed) -> dict:
        sim = simulate(self.convs, replace(profile, step_time=step_time), ClusterSpec(1),
                       self.rate, 1.0, seed, None, config, id_range)
        return p50s(sim.records, sim.duration_s)

    def result(self, profile, config, id_range, seed, later=()) -> dict:
        """The cell's record: measured p50s (median over the runs), their spread, and the
        ratios simulated / measured on the profile; on the profile scaled to the served
        runs' step speed; and, given the profiles calibrated `later` (after each
        round of served runs), on the mean of all the calibrations."""
        st = profile.step_time
        steps = statistics.median(priced_ratio(s, st) for s in self.shapes)
        measured = {k: statistics.median(r[k] for r in self.runs) for k in KEYS}
        models = {"ratio": st, "ratio_at_served_speed": st.scaled(1.0 / steps)}
        if later:
            models["ratio_pooled"] = mean_step_time([st] + [p.step_time for p in later])
        out = {"mix": self.mix, "level": self.level, "rate": self.rate,
               "requests": self.n, "runs": self.runs, "steps_priced": steps,
               "measured": measured,
               "spread": {k: max(r[k] for r in self.runs) / min(r[k] for r in self.runs)
                          for k in KEYS}}
        for name, model in models.items():
            sim = self.simulated_p50s(profile, model, config, id_range, seed)
            if name == "ratio":
                out["simulated"] = sim
            out[name] = {k: sim[k] / measured[k] for k in KEYS}
        return out


def calibrated(args, loaded, path: Path):
    from duetserve.entrypoints.sim_calibrate import calibrate, format_report
    profile, path = calibrate(args.model, args.threads, out=path, loaded=loaded,
                              dtype=args.dtype)
    print(format_report(profile, path))
    return profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/sim/fidelity")
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", default=None, help="use this profile instead of calibrating")
    ap.add_argument("--calibrate", action="store_true",
                    help="run `duet simulate --calibrate` first, into OUT/profile.json, and "
                         "again after each round of served runs, into OUT/profile_R.json")
    ap.add_argument("--mixes", default="chat,prefill-heavy,decode-heavy",
                    help=f"comma list of {', '.join(MIXES)}")
    ap.add_argument("--levels", default="0.4,0.8", help="fractions of the simulated capacity")
    ap.add_argument("--rate", type=float, default=None,
                    help="serve each mix at this many conversations/s instead of --levels")
    ap.add_argument("--run-seconds", type=float, default=45.0, help="arrival span per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    from duetserve.config import EngineConfig
    from duetserve.loader import load_model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine_config = EngineConfig(model=args.model, num_threads=args.threads, dtype=args.dtype)
    loaded = load_model(args.model, args.dtype, quantization=engine_config.quantization)
    if args.calibrate:
        profile = calibrated(args, loaded, out / "profile.json")
    elif args.profile:
        profile = load_profile(args.profile)
    else:
        ap.error("give --calibrate or --profile")
    config = profile.scheduler_config()
    id_range = id_range_for_vocab(loaded.config.vocab_size)
    layout = profile.step_time.layout
    levels = [None] if args.rate else [float(x) for x in args.levels.split(",")]
    cells = [Cell(mix, level, args, profile, config, id_range)
             for level in levels for mix in args.mixes.split(",")]
    later = []                           # the calibrations after each round
    for rep in range(args.repeats):      # round robin: each cell's runs span the whole run
        for c in (cells if rep % 2 == 0 else cells[::-1]):
            run = c.serve(engine_config, loaded, layout)
            log(f"{c.mix} {c.level}: run {rep + 1}/{args.repeats}: {run}, steps priced / "
                f"measured {priced_ratio(c.shapes[-1], profile.step_time):.2f}")
        if args.calibrate:
            later.append(calibrated(args, loaded, out / f"profile_{rep + 1}.json"))
    results = [c.result(profile, config, id_range, args.seed, later) for c in cells]
    print(f"{'mix':>14} {'load':>5} | {'TTFT p50 ms':>11} {'spread':>6} {'sim':>8} {'ratio':>5}"
          f" | {'TPOT p50 ms':>11} {'spread':>6} {'sim':>8} {'ratio':>5} | {'steps':>5}")
    for c in results:
        cols = " | ".join(f"{c['measured'][k]:11.1f} {c['spread'][k]:6.2f} "
                          f"{c['simulated'][k]:8.1f} {c['ratio'][k]:5.2f}" for k in KEYS)
        load = f"{c['level']:5.2f}" if c["level"] is not None else f"{c['rate']:4.2f}/s"
        print(f"{c['mix']:>14} {load:>5} | {cols} | {c['steps_priced']:5.2f}")
    if later:
        shapes = [s for c in cells for run in c.shapes for s in run]
        first = priced_ratio(shapes, profile.step_time)
        print("the calibrations after each round price the served steps " + ", ".join(
            f"{priced_ratio(shapes, p.step_time) / first:.2f}" for p in later)
            + " x the first one (the VM's speed moving across the run)")
    counts = [("ratio", ""),
              ("ratio_pooled", " on the mean of all the calibrations"),
              ("ratio_at_served_speed", " with the profile scaled by 1 / steps (the VM's "
                                        "drift out)")]
    for key, how in counts:
        if key in results[0]:
            within = sum(0.85 <= c[key][k] <= 1.15 for c in results for k in KEYS)
            print(f"{within} of {2 * len(results)} p50 ratios within 0.85-1.15{how}")
    (out / "fidelity.json").write_text(json.dumps(
        {"args": vars(args), "profile": profile.to_json(),
         "later_profiles": [p.to_json() for p in later],
         "cells": results}, indent=1))
    print(f"wrote {out / 'fidelity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
