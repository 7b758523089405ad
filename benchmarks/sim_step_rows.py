"""Decode-only step cost per row, by batch size, in a fidelity run's calibration grid and in
each of its real runs (benchmarks/sim_fidelity.py's output folder): median step time /
rows, and the median context, for the batch sizes with at least 3 such steps. Offline.

    .venv/bin/python benchmarks/sim_step_rows.py out/sim/r10
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

MIXES = ("chat", "prefill-heavy", "decode-heavy")
LEVELS = ("0.4", "0.8")


def per_row(steps: list[tuple[float, list]]) -> dict[int, tuple[float, float, int]]:
    """{batch: (ms a row, median context, steps)} over decode-only steps (every slice one
    token). steps: (seconds, slices), slice = (num_new, num_computed, sampled)."""
    by: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for secs, slices in steps:
        if slices and all(n == 1 for n, _, _ in slices):
            by[len(slices)].append((secs, statistics.mean(c for _, c, _ in slices)))
    return {b: (statistics.median(s for s, _ in v) * 1e3 / b,
                statistics.median(c for _, c in v), len(v))
            for b, v in sorted(by.items()) if len(v) >= 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    args = ap.parse_args()
    cal = json.loads((args.dir / "profile.samples.json").read_text())
    tables = {"grid": per_row([(s, sl) for sl, s in cal["samples"][:cal["grid_steps"]]])}
    for mix in MIXES:
        for level in LEVELS:
            path = args.dir / f"{mix}-{level}-steps.json"
            if path.exists():
                tables[f"{mix} {level}"] = per_row(
                    [(s, sl) for _, s, sl in json.loads(path.read_text())])
    for name, table in tables.items():
        print(f"{name:>18}  " + "  ".join(f"{b}: {ms:.2f} ms @{ctx:.0f}"
                                          for b, (ms, ctx, _) in table.items()))


if __name__ == "__main__":
    main()
