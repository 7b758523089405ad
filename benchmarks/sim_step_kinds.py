"""Measured / predicted step time by step kind, in a fidelity run (benchmarks/sim_fidelity.py's
output folder) under its profile: the calibrations' own steps, then each cell's real runs
pooled. Kinds as benchmarks/sim_refit.py's step_class: decode-only (every slice one
token), prefill-only (none), mixed (both). Offline; shows where the cost model's shape
misses a workload.

    .venv/bin/python benchmarks/sim_step_kinds.py out/sim/r23 [--profile OTHER.json]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from sim_refit import step_class, step_cold  # noqa: E402 (benchmarks/ is the script's dir)

from duetserve.sim.cost import shape_for
from duetserve.sim.profile import load_profile

KINDS = ("decode-only", "prefill-only", "mixed")
CELLS = [(m, lv) for m in ("chat", "prefill-heavy", "decode-heavy") for lv in ("0.4", "0.8")]


def tally(profile, steps) -> dict[str, list[float]]:
    """{kind or "all": [measured s, predicted s, steps]}; steps: (slices, seconds, cold)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for slices, secs, cold in steps:
        pred = profile.cost.step_seconds(shape_for(profile.cost, slices, cold))
        for k in (step_class(slices, profile.cost.breakpoint).split()[0], "all"):
            acc[k][0] += secs
            acc[k][1] += pred
            acc[k][2] += 1
    return acc


def run_steps(folder: Path, mix: str, level: str):
    for f in sorted(folder.glob(f"{mix}-{level}-rep*-steps.json")):
        steps = json.loads(f.read_text())
        for (_, secs, slices), c in zip(steps, step_cold(folder, f.name[:-11], steps)):
            yield slices, secs, c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="a sim_fidelity output folder (profile.json, *-steps.json)")
    ap.add_argument("--profile", default=None,
                    help="predict with this profile (its own steps as the first row) "
                         "instead of the run's")
    args = ap.parse_args()
    folder = Path(args.run)
    prof_path = Path(args.profile) if args.profile else folder / "profile.json"
    profile = load_profile(prof_path)
    rows = []
    samples = prof_path.with_suffix(".samples.json")
    if samples.exists():
        cal = json.loads(samples.read_text())
        rows.append(("calibrations", tally(profile, [(sl, s, c) for (sl, s), c in
                                                     zip(cal["samples"], cal["cold"])])))
    rows += [(f"{m} {lv}", tally(profile, run_steps(folder, m, lv))) for m, lv in CELLS]
    print("| steps | " + " | ".join(KINDS) + " | all |")
    print("|---|" + "---|" * (len(KINDS) + 1))
    for name, acc in rows:
        cells = [f"{acc[k][0] / acc[k][1]:.3f} ({acc[k][0]:.0f} s)" if acc[k][2] else "-"
                 for k in (*KINDS, "all")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
