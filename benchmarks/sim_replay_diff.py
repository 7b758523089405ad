"""Does the simulator schedule what the engine scheduled? A fidelity run's step log, replayed.

benchmarks/sim_fidelity.py keeps every real step (start, seconds, slices). Here the
simulator runs the same workload (conversations, arrival offsets, the engine's
SchedulerConfig) with a trace cost model: step i lasts what the engine's step i lasted
(plus the replay loop's gap after it when the engine did not go idle). With identical
durations, any difference between the simulated and the real batches is a difference in
scheduling (arrivals, chunking, prefix caching, the budget), not in cost. Reported per run:
the first step whose batch differs, how many of the first N (and of all) steps differ, and
the sim / real TTFT and TPOT percentiles under the trace cost (1.00 when the simulation
reproduces the engine's decisions and timing).

    PYTHONPATH=. .venv/bin/python benchmarks/sim_replay_diff.py out/sim/fidelity [--steps 100]

Reads the folder only.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duetserve.bench.token_workload import DEFAULT_ID_RANGE, arrival_offsets
from duetserve.config import SchedulerConfig
from duetserve.core.step_budget import StepBudget, StepCost
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.cost import StepShape, shape_of
from duetserve.sim.run import decode_instance_config, run_json
from duetserve.sim.simulator import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_fidelity import PERCENTILES, conversations, ratios  # noqa: E402

IDLE_GAP_S = 0.003     # a gap between two real steps longer than this: the engine idled


@dataclass
class TraceCost:
    """Step i of the simulation lasts durations[i] (the last one repeated past the end);
    records every simulated step's shape. Mutates its own counters."""

    durations: list[float]
    shapes: list[StepShape] = field(default_factory=list)
    arrival_s: float = 0.0
    flash_above: int = 0

    def step_seconds(self, shape: StepShape) -> float:
        i = len(self.shapes)
        self.shapes.append(shape)
        return self.durations[min(i, len(self.durations) - 1)]

    def describe(self) -> str:
        return f"trace of {len(self.durations)} measured steps"


def scheduler_config(d: dict) -> SchedulerConfig:
    """SchedulerConfig from its asdict() (fidelity.json "scheduler")."""
    d = dict(d)
    sb = d.pop("step_budget", None)
    d.pop("spec_policy", None)
    if sb is not None:
        sb = StepBudget(StepCost(**sb["cost"]), sb.get("max_step_ms"),
                        sb.get("min_chunk", 1), sb.get("idle", 2048))
    return SchedulerConfig(**d, step_budget=sb)


def durations(steps) -> list[float]:
    """Each real step's seconds plus the loop's gap to the next step when it was short
    (longer gaps are idle spells the simulation reproduces from the arrivals)."""
    gaps = [s1[0] - (s0[0] + s0[1]) for s0, s1 in zip(steps, steps[1:])]
    short = [g for g in gaps if g < IDLE_GAP_S]
    typical = float(np.median(short)) if short else 0.0
    return [dt + (g if g < IDLE_GAP_S else typical)
            for (_, dt, _), g in zip(steps, gaps + [typical])]


def key(s: StepShape) -> tuple:
    return (s.num_reqs, s.num_tokens, s.num_decodes, s.decode_context, s.prefill_context,
            s.prefill_pairs, s.num_logits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=100, help="compare the first N in detail")
    ap.add_argument("--runs", default="", help="only these runs (mix-level)")
    ap.add_argument("--show", type=int, default=5, help="differing steps to print")
    ap.add_argument("--seed", type=int, default=1, help="the fidelity run's --seed")
    args = ap.parse_args()
    d = Path(args.dir)
    fid = json.loads((d / "fidelity.json").read_text())
    for run in fid["runs"]:
        tag = f"{run['mix']}-{run['level']:g}"
        if args.runs and tag not in args.runs.split(","):
            continue
        # a repeated cell keeps one step log per repeat (TAG-repK-*), each with its engine
        for rec in run.get("per_repeat") or [{"tag": tag}]:
            replay(d, run, rec["tag"], rec.get("scheduler") or run.get("scheduler")
                   or fid["scheduler"], args)
    return 0


def replay(d: Path, run: dict, tag: str, sched: dict, args) -> None:
    """Replay one measured run's step log (OUT/TAG-steps.json) and print its diff."""
    cfg = scheduler_config(sched)
    steps = json.loads((d / f"{tag}-steps.json").read_text())
    # the workload is the same every repeat (sim_fidelity.measure: seed 1 unless --seed)
    convs = conversations(run["mix"], run["conversations"], args.seed, DEFAULT_ID_RANGE)
    offsets = arrival_offsets(len(convs), run["rate"], 1.0, args.seed).tolist()
    cost = TraceCost(durations(steps))
    sim = Simulation(convs, offsets, ClusterSpec(1), cfg, cost, None, DEFAULT_ID_RANGE,
                     decode_instance_config(cfg))
    res = sim.run()
    real_keys = [key(shape_of(sl)) for _, _, sl in steps]
    sim_keys = [key(s) for s in cost.shapes]
    diff = [i for i in range(min(len(real_keys), len(sim_keys)))
            if real_keys[i] != sim_keys[i]]
    first_n = sum(1 for i in diff if i < args.steps)
    print(f"\n{tag}: real {len(real_keys)} steps, sim {len(sim_keys)}; differing: "
          f"{first_n} of the first {min(args.steps, len(real_keys))}, {len(diff)} of all; "
          f"first at {diff[0] if diff else None}")
    for i in diff[:args.show]:
        print(f"  step {i}: real {sorted(steps[i][2])}")
        print(f"  {' ' * len(str(i))}       sim  (reqs, rows, decodes, Σc dec, Σc pre, "
              f"pairs, logits) {sim_keys[i]} vs real {real_keys[i]}")
    real = json.loads((d / f"{tag}-real.json").read_text())
    simdoc = {"runs": [run_json(res, run["rate"], 1.0, None, PERCENTILES, {})]}
    r = ratios(real, simdoc)
    print("  trace cost: " + "  ".join(f"{k} {v['ratio']:.2f}" for k, v in r.items()))


if __name__ == "__main__":
    sys.exit(main())
