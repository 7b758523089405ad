"""Measured / predicted step time by step kind, in a fidelity run (benchmarks/sim_fidelity.py's
output folder) under its profile: the calibrations' own steps, then each cell's real runs
pooled. Kinds as benchmarks/sim_refit.py's step_class: decode-only (every slice one
token), prefill-only (none), mixed (both). Offline; shows where the cost model's shape
misses a workload.

--by-rows: instead, the median measured / predicted of the steps whose rows all run as
decode rows (no prefill slice; decodes and chunks of up to the engine's chunk_rows) by row
count band, warm steps only; the calibrations split into their grid and their serving
scenario. A flat row means the fit's row terms hold for that workload; a tilt means they
do not (docs/simulator.md §3, "row tilt").

--per-repeat: with --by-rows, one row per measured repeat instead of a cell's repeats
pooled (whether a cell's tilt holds within each run or comes from runs at different
speeds).

--after-prefill: instead, the median measured / predicted of the same warm decode-row
steps split by what ran just before: a step with a prefill slice, or not (the cost of
decoding right after a prefill has evicted the caches, which the fit has no term for).

--prefill-kinds: instead, the steps with a prefill slice split by kind (prefill-only,
mixed), by whether a prefill slice continues a prompt after context (a chunk after
context) or starts one (fresh), and warm or cold: steps, total measured / predicted, and
the median step's; the calibration grid and serving scenario first (which of these shapes
the fit has seen warm).

    .venv/bin/python benchmarks/sim_step_kinds.py out/sim/r23 [--profile OTHER.json] \
        [--by-rows [--per-repeat] | --after-prefill | --prefill-kinds]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from sim_refit import cell_tags, step_class, step_cold  # noqa: E402 (benchmarks/ is the script's dir)

from duetserve.sim.cost import run_shapes
from duetserve.sim.profile import load_profile

KINDS = ("decode-only", "prefill-only", "mixed")
CELLS = [(m, lv) for m in ("chat", "prefill-heavy", "decode-heavy") for lv in ("0.4", "0.8")]
BANDS = ((1, 1), (2, 4), (5, 8), (9, 16))
AFTER = ("after a prefill", "after no prefill")   # after_prefill's split, in print order


def shaped(cost, steps):
    """(slices, seconds, cold, StepShape) of each step (slices, seconds, cold), the steps
    in the order they ran (their rewarm counts: sim/cost.run_shapes)."""
    steps = list(steps)
    shapes = run_shapes(cost, [sl for sl, _, _ in steps], [cold for _, _, cold in steps])
    for (slices, secs, cold), shape in zip(steps, shapes):
        yield slices, secs, cold, shape


def tally(profile, steps) -> dict[str, list[float]]:
    """{kind or "all": [measured s, predicted s, steps]}; steps: (slices, seconds, cold)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for slices, secs, cold, shape in shaped(profile.cost, steps):
        pred = profile.cost.step_seconds(shape)
        for k in (step_class(slices, profile.cost.breakpoint).split()[0], "all"):
            acc[k][0] += secs
            acc[k][1] += pred
            acc[k][2] += 1
    return acc


def row_bands(cost, steps) -> dict[tuple[int, int], list[float]]:
    """{band: [measured / predicted of each warm step in it]} over the steps (slices,
    seconds, cold) whose rows all run as decode rows, by row count (BANDS)."""
    out: dict[tuple[int, int], list[float]] = defaultdict(list)
    for slices, secs, cold, shape in shaped(cost, steps):
        if cold:
            continue
        if shape.num_prefills:
            continue
        for lo, hi in BANDS:
            if lo <= shape.num_tokens <= hi:
                out[(lo, hi)].append(secs / cost.step_seconds(shape))
    return out


def band_names() -> list[str]:
    return [f"{lo}-{hi} rows" if hi > lo else f"{lo} row" for lo, hi in BANDS]


def band_cells(bands: dict[tuple[int, int], list[float]]) -> list[str]:
    return [f"{np.median(bands[b]):.3f} ({len(bands[b])})" if bands.get(b) else "-"
            for b in BANDS]


def repeat_steps(folder: Path, mix: str, level: str):
    """(tag, [(slices, seconds, cold)] in step order) of each measured repeat of a cell
    (sim_refit.cell_tags; none when the folder has no run of it)."""
    for tag in cell_tags(folder, f"{mix}-{level}"):
        steps = json.loads((folder / f"{tag}-steps.json").read_text())
        yield tag, [(slices, secs, c) for (_, secs, slices), c
                    in zip(steps, step_cold(folder, tag, steps))]


def run_steps(folder: Path, mix: str, level: str):
    for _, steps in repeat_steps(folder, mix, level):
        yield from steps


def after_prefill(cost, steps) -> dict[str, list[float]]:
    """{"after a prefill", "after no prefill": [measured / predicted]} of the warm steps
    whose rows all run as decode rows (as row_bands takes them), by whether the step just
    before had a prefill slice; `steps` (slices, seconds, cold) in one run's order (its
    first step has no step before it and is left out)."""
    out: dict[str, list[float]] = {k: [] for k in AFTER}
    prev = None
    for slices, secs, cold, shape in shaped(cost, steps):
        if prev is not None and not cold and not shape.num_prefills and shape.num_tokens:
            key = AFTER[0] if prev else AFTER[1]
            out[key].append(secs / cost.step_seconds(shape))
        prev = shape.num_prefills > 0
    return out


def prefill_kind(cost, slices, cold: bool) -> str | None:
    """"prefill-only|mixed, fresh|chunk after context, warm|cold" of a step with a
    prefill slice (more than one token; None for a decode-only step). A chunk after context:
    some prefill slice has tokens computed before it."""
    kind = step_class(slices, cost.breakpoint).split()[0]
    if kind == "decode-only":
        return None
    after = any(n > 1 and c > 0 for n, c, _ in slices)
    return f"{kind}, {'chunk after context' if after else 'fresh'}, {'cold' if cold else 'warm'}"


def prefill_kinds(cost, steps) -> dict[str, list[tuple[float, float]]]:
    """{prefill_kind: [(measured s, predicted s)]} over the steps (slices, seconds, cold)
    that have a prefill slice."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for slices, secs, cold, shape in shaped(cost, steps):
        key = prefill_kind(cost, slices, cold)
        if key is not None:
            out[key].append((secs, cost.step_seconds(shape)))
    return out


def kind_cell(pairs: list[tuple[float, float]]) -> str:
    """"total ratio / median ratio (steps)" of (measured, predicted) pairs, or "-"."""
    if not pairs:
        return "-"
    total = sum(m for m, _ in pairs) / sum(p for _, p in pairs)
    return f"{total:.3f} / {np.median([m / p for m, p in pairs]):.3f} ({len(pairs)})"


def calibration_parts(prof_path: Path):
    """[(name, steps)] of the calibration behind PROF_PATH: its pooled samples, or split
    into grid and serving scenario where each calibration's own samples file says where
    its grid ends (PROFILE-K.samples.json beside it, or the file itself)."""
    own = sorted(prof_path.parent.glob(f"{prof_path.stem}-[0-9]*.samples.json")) \
        or [prof_path.with_suffix(".samples.json")]
    grid, serving = [], []
    for path in own:
        if not path.exists():
            continue
        raw = json.loads(path.read_text())
        cut = raw.get("grid_steps")
        for i, ((slices, secs), c) in enumerate(zip(raw["samples"], raw["cold"])):
            (grid if cut is None or i < cut else serving).append((slices, secs, c))
    return [(name, steps) for name, steps in (("calibration grid", grid),
                                              ("calibration serving", serving)) if steps]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="a sim_fidelity output folder (profile.json, *-steps.json)")
    ap.add_argument("--profile", default=None,
                    help="predict with this profile (its own steps as the first row) "
                         "instead of the run's")
    ap.add_argument("--by-rows", action="store_true",
                    help="median measured / predicted of decode-row steps by row count")
    ap.add_argument("--per-repeat", action="store_true",
                    help="with --by-rows: a row per measured repeat, not per cell")
    ap.add_argument("--after-prefill", action="store_true",
                    help="median measured / predicted of decode-row steps by whether the "
                         "step before had a prefill slice")
    ap.add_argument("--prefill-kinds", action="store_true",
                    help="steps with a prefill slice by kind, fresh or chunk after "
                         "context, warm or cold")
    args = ap.parse_args()
    folder = Path(args.run)
    prof_path = Path(args.profile) if args.profile else folder / "profile.json"
    profile = load_profile(prof_path)
    if args.prefill_kinds:
        rows = [(name, prefill_kinds(profile.cost, steps))
                for name, steps in calibration_parts(prof_path)]
        rows += [(f"{m} {lv}", prefill_kinds(profile.cost, run_steps(folder, m, lv)))
                 for m, lv in CELLS]
        keys = sorted({k for _, kinds in rows for k in kinds})
        print("measured / predicted: total / median step (steps)")
        print("| steps | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        for name, kinds in rows:
            print(f"| {name} | " + " | ".join(kind_cell(kinds.get(k, [])) for k in keys)
                  + " |")
        return 0
    if args.after_prefill:
        print("| steps | " + " | ".join(AFTER) + " |")
        print("|---|" + "---|" * len(AFTER))
        for m, lv in CELLS:
            acc: dict[str, list[float]] = {k: [] for k in AFTER}
            for _, steps in repeat_steps(folder, m, lv):
                for k, v in after_prefill(profile.cost, steps).items():
                    acc[k] += v
            print(f"| {m} {lv} | " + " | ".join(f"{np.median(acc[k]):.3f} ({len(acc[k])})"
                                                if acc[k] else "-" for k in AFTER) + " |")
        return 0
    if args.by_rows:
        rows = [(name, row_bands(profile.cost, steps))
                for name, steps in calibration_parts(prof_path)]
        if args.per_repeat:
            rows += [(tag, row_bands(profile.cost, steps)) for m, lv in CELLS
                     for tag, steps in repeat_steps(folder, m, lv)]
        else:
            rows += [(f"{m} {lv}", row_bands(profile.cost, run_steps(folder, m, lv)))
                     for m, lv in CELLS]
        print("| steps | " + " | ".join(band_names()) + " |")
        print("|---|" + "---|" * len(BANDS))
        for name, bands in rows:
            print(f"| {name} | " + " | ".join(band_cells(bands)) + " |")
        return 0
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
