"""Does the serving scenario's `short` trace run slower on an engine that already ran the
grid and the `long` trace than on a fresh EngineCore? (docs/simulator.md §3, hypothesis
(b)). Same weights, the same trace (conversations and arrival offsets) every time:

    probe (fresh) -> grid (served + wide engines) -> short on a fresh engine F1 -> long
    + short on the served engine S1 -> probe (fresh) -> short on a fresh engine F2 -> short again on the served
    engine S2 -> probe (fresh)

Fresh and aged runs alternate, so a drift of the machine's speed over the minutes shows as
F1 vs F2 (and S1 vs S2), an engine-age effect as F vs S. Reported: per run, median step
time of decode-only steps by stream count (context bucket ~64 / ~128 / ~256), the total
measured / predicted time under the grid's fit, and the probes' ratios.

    /tmp/gate.sh env PYTHONPATH=. .venv/bin/python benchmarks/sim_scenario_age.py \\
        --out out/sim/age
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def decode_medians(samples) -> dict:
    """{"B@ctx": median ms} over decode-only steps, context = mean c rounded to 64."""
    groups = defaultdict(list)
    for slices, dt in samples:
        if slices and all(n == 1 for n, _, _ in slices):
            ctx = 64 * round(sum(c for _, c, _ in slices) / len(slices) / 64)
            groups[(len(slices), ctx)].append(dt * 1e3)
    return {f"{b}@{c}": [round(statistics.median(v), 3), len(v)]
            for (b, c), v in sorted(groups.items()) if len(v) >= 5}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/sim/age")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--quick", action="store_true", help="smoke run: quick grid, probe, trace")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from duetserve.bench.calibrate import GRID, QUICK_GRID, measure_grid
    from duetserve.bench.cpu_meter import wait_until_quiet
    from duetserve.bench.serve_scenario import (capacity_sample, measure_serving, trace,
                                                 traces as scenario_traces)
    from duetserve.bench.speed_probe import run_probe
    from duetserve.bench.token_workload import id_range_for_vocab
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from dataclasses import replace

    from duetserve.entrypoints.sim_calibrate import (flash_above_entries,
                                                     served_scheduler_settings)
    from duetserve.sim.cluster import ClusterSpec
    from duetserve.sim.cost import run_shapes
    from duetserve.sim.fit import fit_cost
    from duetserve.sim.profile import calibrated_profile
    from duetserve.sim.run import simulate
    from duetserve.sim.speed import probe_ratio

    config = EngineConfig(model=args.model, num_threads=args.threads,
                          kv_cache_memory=0.05 if args.quick else 2.0)
    served = EngineCore(config)
    loaded = served.loaded
    wide = EngineCore(replace(config, max_num_batched_tokens=1024), loaded=loaded)
    id_range = id_range_for_vocab(served.model_config.vocab_size)
    scheduler = served_scheduler_settings(served)
    fresh = lambda: EngineCore(config, loaded)   # noqa: E731
    wait_until_quiet(0.1, 5.0, 600.0)
    t0 = time.perf_counter()
    results: dict = {"runs": [], "probes": []}
    probes = []

    def probe(tag):
        res = run_probe(fresh(), id_range, args.quick)
        probes.append((tag, res))
        log(f"probe {tag}: {len(res.samples)} steps in {res.seconds:.1f} s")

    def short_run(tag, engine, convs, offsets):
        st = measure_serving(engine, convs, offsets)
        results["runs"].append({"tag": tag, "samples": st.samples, "cold": st.cold,
                                "duration_s": st.duration_s,
                                "foreign": st.foreign_cpu_s / st.duration_s})
        log(f"{tag}: {len(st.samples)} steps in {st.duration_s:.1f} s, foreign "
            f"{st.foreign_cpu_s / st.duration_s:.3f}")

    probe("P0")
    cal = measure_grid({"served": served, "wide": wide}, QUICK_GRID if args.quick else GRID,
                      id_range=id_range)
    log(f"grid: {len(cal.samples)} steps in {cal.seconds:.1f} s")
    flash_above = flash_above_entries(served.model_config.num_attention_heads)
    grid_cost, _ = fit_cost(cal.samples, statistics.median(cal.arrival_s), cal.cold,
                            flash_above, served.runner.chunk_rows)
    grid = calibrated_profile("grid", grid_cost, scheduler, {})
    traces = {}
    for tr in scenario_traces(args.quick):
        sample = capacity_sample(tr, id_range)
        res = simulate(sample, grid, ClusterSpec(1), math.inf, 1.0, 0, None, None, id_range)
        traces[tr.name] = trace(tr, len(sample) / res.duration_s, id_range)[:2]
        log(f"{tr.name}: capacity {len(sample) / res.duration_s:.3g}/s, "
            f"{len(traces[tr.name][0])} conversations")
    short, long_ = (traces["quick"],) * 2 if args.quick else (traces["short"], traces["long"])
    short_run("F1 fresh", fresh(), *short)
    short_run("long on served", served, *long_)
    short_run("S1 served (after grid + long)", served, *short)
    probe("P1")
    short_run("F2 fresh", fresh(), *short)
    short_run("S2 served (again)", served, *short)
    probe("P2")
    summary = []
    for run in results["runs"]:
        pred = np.array([grid_cost.step_seconds(s) for s in run_shapes(
            grid_cost, [sl for sl, _ in run["samples"]], run["cold"])])
        real = np.array([s for _, s in run["samples"]])
        dec = np.array([all(n == 1 for n, _, _ in sl) for sl, _ in run["samples"]])
        row = {"tag": run["tag"], "steps": len(real), "foreign": round(run["foreign"], 3),
               "meas/pred": round(float(real.sum() / pred.sum()), 4),
               "decode meas/pred": round(float(real[dec].sum() / pred[dec].sum()), 4),
               "decode medians ms": decode_medians(run["samples"])}
        summary.append(row)
        log(json.dumps(row))
    for tag, res in probes:
        r = probe_ratio(grid_cost, res.samples, res.cold)
        summary.append({"tag": tag, **r, "decode medians ms": decode_medians(res.samples)})
        log(f"{tag}: {json.dumps(summary[-1])}")
    results["summary"] = summary
    results["probes"] = [{"tag": t, "samples": r.samples, "cold": r.cold} for t, r in probes]
    results["grid"] = {"samples": cal.samples, "cold": cal.cold}
    results["total_s"] = time.perf_counter() - t0
    (out / "age.json").write_text(json.dumps(results))
    log(f"done in {results['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
