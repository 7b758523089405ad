"""The serving scenario of `duet simulate --calibrate`: steps measured while requests arrive
on the wall clock, as they do in serving.

Grid steps (bench/calibrate.py) run back to back on an engine that does nothing else; a
served engine's steps are spaced by arrivals, idle spells and output handling, run mixes
of contexts no grid produces, and measured 6-16% slower than grid steps of the same shape
(docs/simulator.md §3). So the calibration also replays a generic trace on the served
engine (bench/replay.py, the measured side of the fidelity check, wall clock, no HTTP) and
its steps join the fit.

The trace is deliberately not one of the fidelity benchmark's mixes (benchmarks/
sim_fidelity.py: chat 3 turns 32-128 in, prefill-heavy 384-768, decode-heavy 16-64 in
96-192 out), so the fit is not tuned on what it is judged on: two-turn conversations with
wide prompt (TRACE input_len) and reply lengths, in load phases of PHASE_S seconds each at
rising fractions of a capacity the caller estimates (idle gaps and cold steps at the low
phases, queueing and big batches at the high ones).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duetserve.bench.cpu_meter import wait_until_quiet
from duetserve.bench.datasets import make_dataset
from duetserve.bench.replay import ReplayResult, replay
from duetserve.bench.token_workload import (TokenConversation, arrival_offsets,
                                             token_conversations)

TRACE = dict(dataset="chat", num_turns=2, input_len="8:640", output_len="4:160")
LEVELS = (0.2, 0.45, 0.7, 0.95)     # fractions of the estimated capacity, one per phase
PHASE_S = 12.0
QUICK_TRACE = dict(dataset="chat", num_turns=2, input_len="4:24", output_len="2:8")
QUICK_LEVELS = (0.3, 0.9)
QUICK_PHASE_S = 1.5
MAX_ATTEMPTS = 2


@dataclass
class ServingSteps:
    """What the scenario measured: samples (slices, seconds) and cold flags as
    bench/calibrate.Calibration's, plus the run's record."""

    samples: list[tuple[list[tuple[int, int, bool]], float]] = field(default_factory=list)
    cold: list[bool] = field(default_factory=list)
    conversations: int = 0
    requests: int = 0              # turns that finished (every one must)
    duration_s: float = 0.0
    foreign_cpu_s: float = 0.0
    attempts: int = 0
    rates: list[float] = field(default_factory=list)


def trace(capacity: float, id_range: tuple[int, int], seed: int = 7, quick: bool = False
          ) -> tuple[list[TokenConversation], list[float], list[float]]:
    """The scenario's conversations, their send offsets (s) and the phases' rates
    (conversations/s), for an engine that serves `capacity` conversations/s of this trace.
    Deterministic for a seed."""
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0 conversations/s, got {capacity}")
    spec, levels, phase_s = (QUICK_TRACE, QUICK_LEVELS, QUICK_PHASE_S) if quick \
        else (TRACE, LEVELS, PHASE_S)
    rates = [capacity * f for f in levels]
    offsets: list[float] = []
    for i, rate in enumerate(rates):
        n = max(2, int(round(rate * phase_s)))
        offsets += (i * phase_s + arrival_offsets(n, rate, 1.0, seed + i)).tolist()
    convs = make_dataset(spec["dataset"], num_prompts=len(offsets),
                         input_len=spec["input_len"], output_len=spec["output_len"],
                         num_turns=spec["num_turns"], seed=seed)
    return token_conversations(convs, id_range), offsets, rates


def capacity_sample(id_range: tuple[int, int], quick: bool = False,
                    n: int = 120) -> list[TokenConversation]:
    """Conversations of the trace's kind (another seed) to estimate its capacity on."""
    spec = QUICK_TRACE if quick else TRACE
    convs = make_dataset(spec["dataset"], num_prompts=n, input_len=spec["input_len"],
                         output_len=spec["output_len"], num_turns=spec["num_turns"], seed=99)
    return token_conversations(convs, id_range)


def measure_serving(engine, convs: list[TokenConversation], offsets: list[float],
                    max_foreign: float = 0.15) -> ServingSteps:
    """Replay the trace on `engine` (idle on entry) on the wall clock; redo it once, on a
    quiet machine, when other processes used more than `max_foreign` of a core meanwhile.
    Every step with work is a sample. Mutates the engine."""
    out = ServingSteps()
    res: ReplayResult | None = None
    for attempt in range(1, MAX_ATTEMPTS + 1):
        res = replay(engine, convs, offsets)
        out.attempts = attempt
        if res.foreign_cpu_s <= max_foreign * res.duration_s:
            break
        if attempt < MAX_ATTEMPTS:
            wait_until_quiet(max_foreign / 2, 5.0, 300.0)
    assert res is not None
    failed = [r.error for r in res.records if not r.success]
    if failed:
        raise RuntimeError(f"serving scenario: {len(failed)} requests failed: {failed[0]}")
    out.samples = [(slices, dt) for _, dt, slices in res.steps]
    out.cold = list(res.step_cold)
    out.conversations = len(convs)
    out.requests = len(res.records)
    out.duration_s = res.duration_s
    out.foreign_cpu_s = float(res.foreign_cpu_s or 0.0)
    return out


def summary(steps: ServingSteps, quick: bool = False) -> dict:
    """The profile's meta entry for the scenario (`steps.rates` set by the caller)."""
    secs = np.array([s for _, s in steps.samples]) if steps.samples else np.zeros(1)
    spec, levels, phase_s = (QUICK_TRACE, QUICK_LEVELS, QUICK_PHASE_S) if quick \
        else (TRACE, LEVELS, PHASE_S)
    return {"trace": spec, "levels": list(levels), "phase_s": phase_s,
            "rates": steps.rates, "conversations": steps.conversations,
            "requests": steps.requests, "steps": len(steps.samples),
            "duration_s": steps.duration_s, "engine_s": float(secs.sum()),
            "foreign_cpu_s": steps.foreign_cpu_s, "attempts": steps.attempts}
