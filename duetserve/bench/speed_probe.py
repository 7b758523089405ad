"""The speed probe: a fixed sequence of step shapes, run on a fresh engine, that says how
fast this machine runs the engine now compared with when a profile was calibrated.

The machine's speed drifts: the same step shape took 0.88-1.15x the profile's prediction
from one run to the next (docs/simulator.md §3), more than the fidelity targets allow. A
calibration runs the probe once (between the step grid and the serving scenario, so it
sees the speed the fit was measured at) and records, in the profile, the probe's measured
time against the profile's prediction of the same steps. Running the probe again later
(`duet simulate --speed-probe`, or benchmarks/sim_fidelity.py before each measured run)
gives a speed factor: now / then, and `CalibratedCost.scaled` multiplies every coefficient
by it (sim/speed.py computes the factor). The probe's requests are random token ids of
fixed shapes (its own seed), never a workload's: it measures the machine, not the
requests it is later judged on. It follows drift that lasts a minute or more, not the
faster changes seen within a run (docs/simulator.md §3, r5).

The shapes are the ones serving spends its time on: decode-only batches of 1 to 16
streams at a context of 128 (the native decode stack), fresh prefills of 32 to 512
tokens, a chunk after cached context, and decodes with chunks joining (the modules).
One unrecorded warm-up, then PASSES passes of the sequence (measure_grid: a shape during
which other processes used more than max_foreign of a core is redone), about 25 s in all
on the 135M model with 2 threads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from duetserve.bench.calibrate import measure_grid

# (engine, kind, parameters): bench/calibrate.py's scenario kinds, on the served engine
PROBE: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    *(("served", "decode", (b, 128, 16)) for b in (1, 2, 3, 4, 6, 8, 16)),
    *(("served", "prefill", (n,)) for n in (32, 128, 512)),
    ("served", "context", (256, 512)),
    ("served", "mixed", (8, 64, 256)),
)
QUICK_PROBE: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("served", "decode", (2, 16, 6)), ("served", "prefill", (32,)),
)
PASSES = 2
SEED = 20261124            # the probe's own token ids: no workload's


@dataclass
class ProbeResult:
    """The probe's steps: samples (slices, seconds) and cold flags as
    bench/calibrate.Calibration's."""

    samples: list[tuple[list[tuple[int, int, bool]], float]] = field(default_factory=list)
    cold: list[float | bool] = field(default_factory=list)
    seconds: float = 0.0
    foreign_cpu_s: float = 0.0


def run_probe(engine, id_range: tuple[int, int], quick: bool = False,
              max_foreign: float = 0.15, passes: int = PASSES) -> ProbeResult:
    """Run the probe on `engine` (idle on entry; built with the serving settings, ideally
    fresh). Mutates the engine (its prefix cache holds the probe's blocks afterwards)."""
    cal = measure_grid({"served": engine}, QUICK_PROBE if quick else PROBE, repeats=passes,
                       id_range=id_range, seed=SEED, max_foreign=max_foreign)
    return ProbeResult(cal.samples, cal.cold, cal.seconds, cal.foreign_cpu_s)
