"""Measure real engine steps over a grid of shapes, for `duet simulate --calibrate`.

Drives an in-process EngineCore (the real scheduler, runner, sampler and detokenizer) and
times every `engine.step()` call from outside, so a sample is the step as the serving loop
pays it. The grid (GRID; --quick: QUICK_GRID), each scenario run in turn:

  prefill   one fresh prompt of n tokens                  -> steps (n, 0)
  context   a cached prefix of c tokens, then n new ones  -> steps (n, c): chunk after context
  ramp      B prompts of L tokens, then decodes whose batch shrinks B -> 1 as requests reach
            staggered max_tokens (request i stops after `stride * (i + 1)` tokens)
                                                          -> batched prefills, mixed steps,
                                                             decode batches 1..B at context ~L
  mixed     B decoding streams, a fresh prompt of n tokens joining every 4 steps
                                                          -> decodes + one prefill chunk

About a minute and a half on the 135M model with 2 threads (--quick: seconds).

Ids are drawn from ordinary vocabulary ids; requests are greedy with ignore_eos. The
engine is built with a token budget large enough for every slice above; the profile
records the scheduler settings `duet serve` would use by default (budget derived from
the engine's own start-up measurement).
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duetserve.bench.cpu_meter import ForeignCpu, wait_until_quiet

# (kind, parameters)
GRID: tuple[tuple[str, tuple[int, ...]], ...] = (
    *(("prefill", (n,)) for n in (8, 32, 64, 128, 256, 512)),
    *(("context", (n, c)) for n in (16, 64) for c in (256, 1024)),
    ("context", (256, 512)),
    ("ramp", (64, 32, 2)), ("ramp", (32, 256, 2)), ("ramp", (8, 1024, 3)),
    ("mixed", (16, 128, 64)), ("mixed", (24, 256, 256)),
)
QUICK_GRID: tuple[tuple[str, tuple[int, ...]], ...] = (
    *(("prefill", (n,)) for n in (8, 32, 128)),
    ("context", (16, 64)), ("ramp", (8, 16, 1)), ("mixed", (4, 16, 16)),
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
    arrival_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    foreign_cpu_s: float = 0.0     # CPU other processes used meanwhile (bench/cpu_meter.py)
    num_redone: int = 0            # scenarios thrown away for foreign CPU and measured again


class _Driver:
    """Adds requests and steps the engine, timing each step. Mutates the engine."""

    def __init__(self, engine: Any, id_range: tuple[int, int], seed: int) -> None:
        from duetserve.sampling_params import SamplingParams
        self.engine = engine
        self.params = SamplingParams
        self.rng = np.random.default_rng(seed)
        self.lo, self.hi = id_range
        self.prompt_len: dict[str, int] = {}
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
        self.engine.step()
        dt = time.perf_counter() - t0
        items = self.engine.last_step.items
        if record and items:
            slices = [(n, c, c + n >= self.prompt_len[r]) for r, n, c in items]
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


def measure_grid(engine: Any, grid=GRID, repeats: int = REPEATS,
                 id_range: tuple[int, int] = (1000, 40000), seed: int = 0,
                 progress: Callable[[str], None] | None = None,
                 max_foreign: float = MAX_FOREIGN) -> Calibration:
    """Run every scenario `repeats` times after one unrecorded warm-up of the grid's first
    scenarios. A scenario during which other processes used more than `max_foreign` of a
    core (bench/cpu_meter.py) is thrown away and redone after the machine is quiet, up to
    MAX_ATTEMPTS times (torch's threads collapse when the cores are oversubscribed, so
    such steps measure the neighbours, not the engine). The engine must start idle; the
    context scenarios use its prefix cache (fresh random ids elsewhere, so nothing else
    hits). Mutates the engine."""
    d = _Driver(engine, id_range, seed)
    for kind, p in grid[:3]:                  # warm-up: first calls pay one-time set-up
        _scenario(d, kind, p)
    d.cal.samples.clear()
    d.cal.arrival_s.clear()
    whole = ForeignCpu()
    t0 = time.perf_counter()
    for r in range(repeats):
        for kind, p in grid:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                gc.collect()
                mark = len(d.cal.samples)
                meter = ForeignCpu()
                _scenario(d, kind, p)
                foreign = meter.foreign_fraction()
                if progress is not None:
                    progress(f"repeat {r + 1}/{repeats}: {kind} {p}: "
                             f"{len(d.cal.samples) - mark} steps, foreign CPU {foreign:.2f}")
                if foreign <= max_foreign or attempt == MAX_ATTEMPTS:
                    break
                del d.cal.samples[mark:]
                d.cal.num_redone += 1
                wait_until_quiet(max_foreign / 2, 5.0, 300.0)
    d.cal.seconds = time.perf_counter() - t0
    d.cal.foreign_cpu_s = whole.foreign_s()
    return d.cal
