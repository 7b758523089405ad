"""Measure real engine steps over a grid of shapes, for `duet simulate --calibrate`.

Drives in-process EngineCores (the real scheduler, runner, sampler and detokenizer) and
times every `engine.step()` call from outside, so a sample is the step as the serving loop
pays it. Two engines share the weights: "served" is built with `duet serve`'s defaults, so
it budgets every step as serving does (core/step_budget.StepBudget from its measured step
cost: up to IDLE_BUDGET tokens when nothing decodes, prefill chunks sized to the running
decodes otherwise), and its big idle prefills and its chunks mixed with decodes are
measured as they happen in serving; "wide" has a fixed budget of CALIBRATION_BUDGET
(prefills and contexts on a grid, for simulations with other budgets). Scenarios (GRID;
--quick: QUICK_GRID):

  prefill   one fresh prompt of n tokens                  -> steps (n, 0)
  context   a cached prefix of c tokens, then n new ones  -> steps (n, c): chunk after context
  ramp      B prompts of L tokens, then decodes whose batch shrinks B -> 1 as requests reach
            staggered max_tokens (request i stops after `stride * (i + 1)` tokens)
                                                          -> batched (or chunked) prefills,
                                                             mixed steps, decode batches 1..B
  mixed     B decoding streams, a fresh prompt of n tokens joining every 4 steps
                                                          -> decodes + one prefill chunk
  decode    B prompts of L tokens decoding M tokens together -> decode-only steps of
            exactly B streams (the small batches low-load serving runs most of its steps
            with, which a ramp passes through in one or two steps)
  idle      the engine idle for S ms, then one prompt of n tokens, 4 tokens out
                                                          -> a cold prefill after S ms idle
            (its excess grows with S, sim/cost.py cold_idle), then decodes of one stream;
            serving records few such steps and mostly long ones, so the grid pins the
            few-row end of that excess

About two minutes on the 135M model with 2 threads, a third of it idle (--quick: seconds).
"""
from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duetserve.bench.cpu_meter import ForeignCpu, wait_until_quiet
from duetserve.bench.replay import cold_record

# (engine, kind, parameters)
GRID: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("served", "ramp", (24, 512, 2)), ("served", "mixed", (8, 64, 768)),
    *(("served", "decode", (b, 160, 24)) for b in (1, 2, 3, 4, 6, 8, 12)),
    *(("served", "idle", (n, ms)) for n in (16, 64) for ms in (100, 500, 2000, 6000)),
    ("served", "idle", (256, 100)), ("served", "idle", (256, 4000)),
    *(("wide", "prefill", (n,)) for n in (8, 32, 128, 512, 768)),
    ("wide", "context", (16, 1024)), ("wide", "context", (256, 512)),
    ("wide", "context", (512, 16)),
    ("wide", "ramp", (64, 32, 2)), ("wide", "ramp", (16, 256, 2)),
    ("wide", "mixed", (16, 128, 256)),
)
QUICK_GRID: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("served", "ramp", (4, 48, 1)), ("served", "decode", (2, 16, 8)),
    *(("wide", "prefill", (n,)) for n in (8, 32, 128)),
    ("wide", "context", (16, 64)), ("wide", "ramp", (8, 16, 1)), ("wide", "mixed", (4, 16, 16)),
    ("served", "idle", (16, 50)),
)
CALIBRATION_BUDGET = 1024
REPEATS = 1
MAX_FOREIGN = 0.15        # a scenario during which other processes used more CPU is redone
MAX_ATTEMPTS = 3


@dataclass
class Calibration:
    """What the grid measured. samples: (slices, seconds); slice = (num_new,
    num_computed_before, sampled)."""

    samples: list[tuple[list[tuple[int, int, bool]], float]] = field(default_factory=list)
    # per sample: 0.0, or the seconds the engine sat idle before it (sim/cost.py cold_state)
    cold: list[float | bool] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # per sample: its start (perf_counter s)
    arrival_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    foreign_cpu_s: float = 0.0     # CPU other processes used meanwhile (bench/cpu_meter.py)
    num_redone: int = 0            # scenarios thrown away for foreign CPU and measured again
    # this process over the grid: user and system CPU seconds, minor page faults
    rusage: dict[str, float] = field(default_factory=dict)


class _Driver:
    """Adds requests and steps an engine, timing each step. Mutates the engines."""

    def __init__(self, engines: dict[str, Any], id_range: tuple[int, int], seed: int) -> None:
        from duetserve.sampling_params import SamplingParams
        self.engines = engines
        self.engine = next(iter(engines.values()))
        self.params = SamplingParams
        self.rng = np.random.default_rng(seed)
        self.lo, self.hi = id_range
        self.prompt_len: dict[str, int] = {}
        # id(engine) -> whether its last step left it with no requests (its next one is cold)
        self.idle: dict[int, bool] = {}
        # when the last step of any engine ended: a cold step's idle time is the process's
        # (the engines share the weights and the cores), not the time since that engine ran
        self.last_end: float | None = None
        self.cal = Calibration()
        self._ids = 0

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(self.lo, self.hi, size=n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        req_id = f"cal-{self._ids}"
        self._ids += 1
        params = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        self.engine.add_request(req_id, prompt, params)
        self.cal.arrival_s.append(time.perf_counter() - t0)
        self.prompt_len[req_id] = len(prompt)
        return req_id

    def step(self, record: bool = True) -> None:
        t0 = time.perf_counter()
        cold: float | bool = True         # a new engine: cold, its idle time not known
        if id(self.engine) in self.idle and self.last_end is not None:
            cold = cold_record(self.last_end if self.idle[id(self.engine)] else None, t0)
        self.engine.step_deltas()
        t1 = time.perf_counter()
        dt = t1 - t0
        items = self.engine.last_step.items
        if items:
            self.idle[id(self.engine)] = not self.engine.has_unfinished_requests()
            self.last_end = t1
        if record and items:
            self.cal.cold.append(cold)
            self.cal.starts.append(t0)
            slices = [(s.num_new_tokens, s.num_computed_before,
                       s.num_computed_before + s.num_new_tokens >= self.prompt_len[s.req_id])
                      for s in items]
            self.cal.samples.append((slices, dt))

    def drain(self, between: Callable[[int], None] | None = None) -> None:
        k = 0
        while self.engine.has_unfinished_requests():
            if between is not None:
                between(k)
            self.step()
            k += 1


def _scenario(d: _Driver, kind: str, p: tuple[int, ...]) -> None:
    if kind == "prefill":
        d.add(d.tokens(p[0]), 1)
    elif kind == "context":
        n, c = p
        prefix = d.tokens(c)
        d.add(prefix, 1)
        d.drain()
        d.add(prefix + d.tokens(n), 1)
    elif kind == "ramp":
        batch, length, stride = p
        for i in range(batch):
            d.add(d.tokens(length), stride * (i + 1))
    elif kind == "decode":
        batch, length, steps = p
        for _ in range(batch):
            d.add(d.tokens(length), steps)
    elif kind == "idle":
        n, ms = p
        time.sleep(ms / 1e3)          # the idle spell itself is what this scenario measures
        d.add(d.tokens(n), 4)
    elif kind == "mixed":
        batch, length, joiner = p
        for _ in range(batch):
            d.add(d.tokens(length), 48)

        def join(k: int) -> None:
            if k >= 8 and k % 4 == 0 and k < 40:
                d.add(d.tokens(joiner), 1)
        d.drain(join)
        return
    d.drain()


def measure_grid(engines: dict[str, Any], grid=GRID, repeats: int = REPEATS,
                 id_range: tuple[int, int] = (1000, 40000), seed: int = 0,
                 progress: Callable[[str], None] | None = None,
                 max_foreign: float = MAX_FOREIGN) -> Calibration:
    """Run every scenario `repeats` times after one unrecorded warm-up of the grid's first
    scenarios. A scenario during which other processes used more than `max_foreign` of a
    core (bench/cpu_meter.py) is thrown away and redone after the machine is quiet, up to
    MAX_ATTEMPTS times (torch's threads collapse when the cores are oversubscribed, so
    such steps measure the neighbours, not the engine). The engine must start idle; the
    context scenarios use its prefix cache (fresh random ids elsewhere, so nothing else
    hits). `engines` maps the grid's engine names to idle EngineCores. Mutates them."""
    d = _Driver(engines, id_range, seed)
    for name in engines:                       # warm-up: first calls pay one-time set-up
        d.engine = engines[name]
        _scenario(d, "ramp", (4, 48, 1))
    d.cal.samples.clear()
    d.cal.cold.clear()
    d.cal.starts.clear()
    d.cal.arrival_s.clear()
    whole = ForeignCpu()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for r in range(repeats):
        for name, kind, p in grid:
            d.engine = engines[name]
            for attempt in range(1, MAX_ATTEMPTS + 1):
                gc.collect()
                mark = len(d.cal.samples)
                meter = ForeignCpu()
                _scenario(d, kind, p)
                foreign = meter.foreign_fraction()
                if progress is not None:
                    progress(f"repeat {r + 1}/{repeats}: {name} {kind} {p}: "
                             f"{len(d.cal.samples) - mark} steps, foreign CPU {foreign:.2f}")
                # NOTE: /proc/stat counts 10 ms ticks: a short scenario needs a margin.
                if (meter.foreign_s() <= max_foreign * meter.elapsed_s() + 0.05
                        or attempt == MAX_ATTEMPTS):
                    break
                del d.cal.samples[mark:]
                del d.cal.cold[mark:]
                del d.cal.starts[mark:]
                d.cal.num_redone += 1
                wait_until_quiet(max_foreign / 2, 5.0, 300.0)
    d.cal.seconds = time.perf_counter() - t0
    d.cal.foreign_cpu_s = whole.foreign_s()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    d.cal.rusage = {"user_s": ru.ru_utime - ru0.ru_utime, "sys_s": ru.ru_stime - ru0.ru_stime,
                    "minor_faults": ru.ru_minflt - ru0.ru_minflt}
    return d.cal
