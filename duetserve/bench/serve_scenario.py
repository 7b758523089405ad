"""The serving scenario of `duet simulate --calibrate`: steps measured while requests arrive
on the wall clock, as they do in serving.

Probe steps (engine/step_probe.py) run back to back on a runner that does nothing else; a
served engine's steps are spaced by arrivals, idle spells and output handling (the
scheduler, the detokenizer), and run mixes of contexts no probe set produces; on the
2-core VMs measured they took 6-16% longer than probes of the same shape. So the
calibration also replays generic traces on an engine (bench/replay.py: wall clock, no
HTTP) and their steps join the fit.

The traces are deliberately none of the fidelity benchmark's mixes (benchmarks/
sim_fidelity.py: chat 3 turns 32-128 in 32-96 out, prefill-heavy 384-768 in, decode-heavy
16-64 in 96-192 out), so the fit is not tuned on what it is judged on. Each replays in load
phases of `phase_s` seconds at rising fractions of a capacity the caller estimates for it
(idle gaps and cold steps at the low phases, queueing and big batches at the high ones):

  long    two-turn conversations, 8-640 words in, 4-160 out: long prompts and contexts,
          few streams (its capacity is low, so its phases hold few conversations)
  short   more, shorter two-turn conversations, 8-96 in, 24-224 out: 4-16 streams decoding
          at contexts of tens to hundreds of tokens, with prompts chunked beside them (the
          shapes low and moderate load spends most steps on)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duetserve.bench.cpu_meter import wait_until_quiet
from duetserve.bench.datasets import make_dataset
from duetserve.bench.replay import ReplayResult, replay
from duetserve.bench.token_workload import (TokenConversation, arrival_offsets,
                                             token_conversations)

@dataclass(frozen=True)
class Trace:
    """One scenario trace: dataset settings (bench/datasets.make_dataset), load phases as
    fractions of its capacity, seconds per phase, and its seed."""

    name: str
    spec: dict
    levels: tuple[float, ...]
    phase_s: float
    seed: int


TRACES = (
    Trace("long", dict(dataset="chat", num_turns=2, input_len="8:640", output_len="4:160"),
          (0.2, 0.45, 0.7, 0.95), 12.0, 7),
    Trace("short", dict(dataset="chat", num_turns=2, input_len="8:96", output_len="24:224"),
          (0.3, 0.6, 0.9), 14.0, 11),
)
QUICK_TRACES = (
    Trace("quick", dict(dataset="chat", num_turns=2, input_len="4:24", output_len="2:8"),
          (0.3, 0.9), 1.5, 7),
)
MAX_ATTEMPTS = 2
# at most this many arrivals per load phase: a tiny model's capacity can be hundreds of
# conversations a second, and a phase of rate x phase_s arrivals would then overrun the
# engine's waiting queue (EngineConfig.max_waiting_requests, 1024); a capped phase keeps
# its rate and ends early (traces of 4 phases queue at most 4 x 200 turns at once)
MAX_PER_PHASE = 200


def traces(quick: bool = False) -> tuple[Trace, ...]:
    return QUICK_TRACES if quick else TRACES


@dataclass
class ServingSteps:
    """What the scenario measured: each step's slices and seconds, whether it was cold,
    plus the run's record."""

    # (slices: (num_new, num_computed_before, num_logits), seconds)
    samples: list[tuple[list[tuple[int, int, int]], float]] = field(default_factory=list)
    # per sample: 0.0, or the seconds the engine sat idle before it (a cold step)
    cold: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)   # per sample: s from the trace's start
    conversations: int = 0
    requests: int = 0              # turns that finished (every one must)
    duration_s: float = 0.0
    foreign_cpu_s: float = 0.0
    attempts: int = 0
    rates: list[float] = field(default_factory=list)


def trace(tr: Trace, capacity: float, id_range: tuple[int, int]
          ) -> tuple[list[TokenConversation], list[float], list[float]]:
    """The trace's conversations, their send offsets (s) and the phases' rates
    (conversations/s), for an engine that serves `capacity` conversations/s of this trace.
    A phase holds round(rate x phase_s) arrivals, at least 2 and at most MAX_PER_PHASE
    (then it ends before phase_s). Deterministic for a trace (its seed)."""
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0 conversations/s, got {capacity}")
    rates = [capacity * f for f in tr.levels]
    offsets: list[float] = []
    for i, rate in enumerate(rates):
        n = min(MAX_PER_PHASE, max(2, int(round(rate * tr.phase_s))))
        offsets += (i * tr.phase_s + arrival_offsets(n, rate, 1.0, tr.seed + i)).tolist()
    spec = tr.spec
    convs = make_dataset(spec["dataset"], num_prompts=len(offsets),
                         input_len=spec["input_len"], output_len=spec["output_len"],
                         num_turns=spec["num_turns"], seed=tr.seed)
    return token_conversations(convs, id_range), offsets, rates


def capacity_sample(tr: Trace, id_range: tuple[int, int], n: int = 120
                    ) -> list[TokenConversation]:
    """Conversations of the trace's kind (another seed) to estimate its capacity on."""
    spec = tr.spec
    convs = make_dataset(spec["dataset"], num_prompts=n, input_len=spec["input_len"],
                         output_len=spec["output_len"], num_turns=spec["num_turns"],
                         seed=tr.seed + 92)
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
    out.starts = [start for start, _, _ in res.steps]
    out.cold = list(res.step_cold)
    out.conversations = len(convs)
    out.requests = len(res.records)
    out.duration_s = res.duration_s
    out.foreign_cpu_s = float(res.foreign_cpu_s or 0.0)
    return out


def summary(measured: list[tuple[Trace, ServingSteps]]) -> dict:
    """The profile's meta entry for the scenario: totals over its traces, and each trace's
    settings and record (`steps.rates` set by the caller)."""
    per = []
    for tr, st in measured:
        secs = np.array([s for _, s in st.samples]) if st.samples else np.zeros(1)
        per.append({"name": tr.name, "trace": tr.spec, "levels": list(tr.levels),
                    "phase_s": tr.phase_s, "rates": st.rates,
                    "conversations": st.conversations, "requests": st.requests,
                    "steps": len(st.samples), "duration_s": st.duration_s,
                    "engine_s": float(secs.sum()), "foreign_cpu_s": st.foreign_cpu_s,
                    "attempts": st.attempts})
    total = {k: sum(p[k] for p in per) for k in ("conversations", "requests", "steps",
                                                 "duration_s", "engine_s", "foreign_cpu_s")}
    return {**total, "traces": per}
