"""Step cost models: the duration of one engine step from its shape.

A step is what the scheduler decided: per scheduled request, (num_new_tokens,
num_computed_tokens_before). `StepShape` reduces it to the few sums both models need:

    request r:  [ 0 ........ c-1 | c ........ c+n-1 ]
                  context (in KV)   new tokens this step
    decode  : n == 1   -> reads c cached positions (memory: KV bytes)
    prefill : n  > 1   -> n*c + n(n+1)/2 (query, key) pairs (compute: attention FLOPs)

On this CPU engine the kinds of prefill slice run different attention kernels
(models/attention.py): a fresh one (c == 0) torch's flash kernel over the causal half,
n(n+1)/2 pairs; a chunk after cached context with at most GROUPED_MAX_SCORES scores
(heads x n x (c+n)) an explicit masked score matrix, n*(c+n) entries, several times
slower per entry; a longer one two flash calls (the chunk over its c cached positions,
then over itself, causal) merged by their log-sum-exps, n*c + n(n+1)/2 pairs. The
calibrated model prices the three apart; `flash_above` (entries n*(c+n) per chunk) is
where the engine switches, GROUPED_MAX_SCORES // heads for the calibrated model.

Two models implement `step_seconds(shape)`:
  - `CalibratedCost`: measured on this machine (`duet simulate --calibrate`); linear in the
    roofline terms, with fitted coefficients (sim/fit.py).
  - `RooflineCost`: a GPU from the hardware table (metrics/hardware.py) with stated,
    editable efficiency factors (MFU, MBU) and per-step overheads (sim/gpu.py builds it).
Both are frozen; nothing here mutates anything.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Protocol, Sequence

KNOT_ROWS = 3      # rows_few_over: where the few-row slope changes (measured, §3)
# rewarm: the steps after a cold step or a many-row one pay an excess that decays by e
# every REWARM_STEPS steps, counted up to REWARM_LIMIT steps (measured on the Intel VM at
# --dtype float32: decode steps 1.47x / 1.23x / 1.02x the fit without it over steps
# 1-3 / 4-8 / 9-32 after a cold step; docs/simulator.md §2, a14)
REWARM_STEPS = 7.0
REWARM_LIMIT = 32
# cold_idle: a cold step's excess grows with how long the engine sat idle before it, as
# ln(1 + idle / IDLE_KNEE_S) (measured on the Intel VM, a 40-token prompt after 0.05 /
# 0.3 / 2 / 5 / 10 s idle: 34 / 48 / 77 / 113 / 130 ms, ~26 ms per unit of that log;
# a 300-token one 365 ms after 0.01 s, 447 ms after 2 s; benchmarks/cold_step.py,
# docs/simulator.md §3 r37)
IDLE_KNEE_S = 0.3

# Feature names of the calibrated model, in coefficient order (see CalibratedCost).
FEATURES = ("step", "requests", "rows_few", "many_rows", "rows_many", "logits",
            "decode_context", "prefill_context", "fresh_pairs", "chunk_scores", "chunk_pairs",
            "mixed_few", "cold_rows", "rows_few_over", "rewarm", "multi_rows", "cold_idle",
            "cold_idle_rows")


@dataclass(slots=True)
class StepShape:
    """The sums of one step that its cost depends on."""

    num_reqs: int = 0
    num_tokens: int = 0          # rows through the linear layers
    num_logits: int = 0          # positions that are sampled (LM head rows)
    num_decodes: int = 0
    decode_context: int = 0      # sum of c over decodes (n == 1)
    prefill_context: int = 0     # sum of c over prefill slices (n > 1)
    prefill_pairs: int = 0       # sum of n*c + n(n+1)/2 over prefill slices
    num_prefills: int = 0        # prefill slices (n > 1)
    fresh_pairs: int = 0         # sum of n(n+1)/2 over prefill slices with c == 0
    chunk_scores: int = 0        # sum of n*(c+n) over chunks after context (c > 0) with
                                 # n*(c+n) <= flash_above (the masked score matrix)
    chunk_pairs: int = 0         # sum of n*c + n(n+1)/2 over the longer ones (flash)
    cold: bool = False           # the first step after the engine went idle (see below)
    idle_s: float = 0.0          # a cold step: seconds the engine sat idle before it (0:
                                 # not recorded, cold_state)
    rewarm: int = 0              # k >= 1: the k-th step after the last reset (a cold step
                                 # or one on the many-row path); 0: a reset itself, before
                                 # any, or not known (rewarm_counts)
    flash_above: int = 0         # the split of chunks after context (0: all score matrix)
    chunk_rows: int = 0          # chunks of up to this many tokens run as decode rows
    # (threads, KV heads) of the engine's paged decode attention, which splits its
    # (row, KV head) items into one contiguous run per thread (at::parallel_for); (0, 0):
    # not known, the decode rows' context counts as their sum
    decode_split: tuple[int, int] = (0, 0)
    decode_lens: list[int] = field(default_factory=list)       # KV entries per decode row
    chunk_lens: list[int] = field(default_factory=list)        # same, chunks as decode rows

    def add(self, num_new: int, num_computed: int, sampled: bool) -> None:
        """Count one request's slice. Mutates self."""
        self.num_reqs += 1
        self.num_tokens += num_new
        self.num_logits += sampled
        if num_new == 1:
            self.num_decodes += 1
            self.decode_context += num_computed
            self.decode_lens.append(num_computed + 1)
        elif num_new <= self.chunk_rows:     # the engine's layout (worker/batch.py): one
            self.num_decodes += num_new      # decode row per token, context = position
            self.decode_context += num_new * num_computed + num_new * (num_new - 1) // 2
            self.chunk_lens.extend(range(num_computed + 1, num_computed + num_new + 1))
        else:
            self.num_prefills += 1
            self.prefill_context += num_computed
            self.prefill_pairs += num_new * num_computed + num_new * (num_new + 1) // 2
            if num_computed:
                entries = num_new * (num_computed + num_new)
                if self.flash_above and entries > self.flash_above:
                    self.chunk_pairs += num_new * num_computed + num_new * (num_new + 1) // 2
                else:
                    self.chunk_scores += entries
            else:
                self.fresh_pairs += num_new * (num_new + 1) // 2

    def decode_busiest(self) -> float:
        """decode_context as the engine's decode attention spends it: threads x the KV
        entries of its busiest thread, over KV heads (equal to decode_context when the
        items split evenly; more when one long row lands on one thread). The rows in the
        engine's order (worker/batch.py): decodes by context, then chunk rows; each row
        is KV-heads items of its length; each thread takes a contiguous run of
        ceil(items / threads). decode_context itself when `decode_split` is unknown."""
        threads, heads = self.decode_split
        if threads <= 1 or heads <= 0 or not (self.decode_lens or self.chunk_lens):
            return float(self.decode_context)
        lens = sorted(self.decode_lens) + self.chunk_lens
        items = len(lens) * heads
        used = min(threads, items)
        run = -(-items // used)
        busiest = 0
        for t in range(used):
            lo, hi = t * run, min(items, (t + 1) * run)
            # rows whose items overlap [lo, hi): row r covers [r*heads, (r+1)*heads)
            total = sum(lens[r] * (min(hi, (r + 1) * heads) - max(lo, r * heads))
                        for r in range(lo // heads, (hi - 1) // heads + 1))
            busiest = max(busiest, total)
        # the same units as decode_context (which counts c, not c + 1, per row)
        return busiest * threads / heads - self.num_decodes

    def rewarming(self) -> float:
        """The rewarm feature: exp(-(k-1)/REWARM_STEPS) for the k-th step after a reset,
        k <= REWARM_LIMIT; 0 otherwise."""
        k = self.rewarm
        return math.exp(-(k - 1) / REWARM_STEPS) if 1 <= k <= REWARM_LIMIT else 0.0

    def idling(self) -> float:
        """The cold_idle feature: ln(1 + idle_s / IDLE_KNEE_S) on a cold step, else 0."""
        return math.log1p(self.idle_s / IDLE_KNEE_S) if self.cold else 0.0


def cold_state(value: float | bool) -> tuple[bool, float]:
    """A recorded per-step cold value -> (cold, idle seconds). The records (bench/replay.py,
    bench/calibrate.py, the simulator's instances) hold, per step, 0 (or False) for a warm
    step and, for a cold one, the seconds the engine sat idle before it; True is a cold
    step whose idle time was not recorded (data from before it was): idle 0, so only
    cold_rows prices it."""
    if isinstance(value, bool):
        return value, 0.0
    return value > 0, max(0.0, float(value))


def with_idle(cold: Sequence[float | bool], starts: Sequence[float],
              seconds: Sequence[float]) -> list[float | bool]:
    """Cold values (cold_state) with the idle time of each cold step recorded as True
    (data from before it was recorded) filled in from the steps' start times and
    durations: from the end of the step before to its start (the engine steps only
    when it has work). The first step of a run stays True."""
    if not len(cold) == len(starts) == len(seconds):
        raise ValueError(f"{len(cold)} cold values, {len(starts)} starts, "
                         f"{len(seconds)} durations")
    out = list(cold)
    for i in range(1, len(out)):
        if out[i] is True:
            out[i] = max(starts[i] - starts[i - 1] - seconds[i - 1], 1e-9)
    return out


def next_rewarm(prev: int | None, cold: float | bool, rows: int, breakpoint: int
                ) -> int | None:
    """The rewarm count of a step after one counted `prev` (None: no reset yet): 0 on a
    reset (a cold step, or more than `breakpoint` rows: the many-row path), else prev + 1."""
    return 0 if cold or rows > breakpoint else (None if prev is None else prev + 1)


def rewarm_counts(cold: Sequence[float | bool], rows: Sequence[int], breakpoint: int
                  ) -> list[int]:
    """StepShape.rewarm of each step of a run, in the order they ran, from its cold values
    (cold_state) and row counts: 0 on a reset (a cold step, or more than `breakpoint` rows: the
    many-row path) and before the first, then 1, 2, ... until the next reset."""
    if len(cold) != len(rows):
        raise ValueError(f"{len(cold)} cold flags for {len(rows)} steps")
    out: list[int] = []
    k: int | None = None           # steps since the last reset; None: none yet
    for c, t in zip(cold, rows):
        k = next_rewarm(k, c, t, breakpoint)
        out.append(k or 0)
    return out


def shape_of(items: Iterable[tuple[int, int, bool]], cold: float | bool = False,
             flash_above: int = 0, chunk_rows: int = 0,
             decode_split: tuple[int, int] = (0, 0), rewarm: int = 0) -> StepShape:
    """StepShape of (num_new, num_computed_before, sampled) per scheduled request; `cold`
    (cold_state): the engine had no requests after its previous step (or had just started),
    and for how many seconds;
    `rewarm`: the step's place after the last reset (rewarm_counts);
    `flash_above`, `chunk_rows`, `decode_split`: see StepShape (a cost model's own:
    `shape_for(cost, ...)`)."""
    is_cold, idle_s = cold_state(cold)
    shape = StepShape(cold=is_cold, idle_s=idle_s, rewarm=rewarm, flash_above=flash_above,
                      chunk_rows=chunk_rows, decode_split=decode_split)
    for n, c, sampled in items:
        if n > 0:
            shape.add(n, c, sampled)
    return shape


def shape_for(cost: "StepCostModel", items: Iterable[tuple[int, int, bool]],
              cold: float | bool = False, rewarm: int = 0) -> StepShape:
    """shape_of with the engine's layout of chunks that `cost` was fitted with."""
    return shape_of(items, cold, int(getattr(cost, "flash_above", 0)),
                    int(getattr(cost, "chunk_rows", 0)),
                    tuple(getattr(cost, "decode_split", (0, 0))), rewarm)


def run_shapes(cost: "StepCostModel", steps: Sequence[Sequence[tuple[int, int, bool]]],
               cold: Sequence[float | bool]) -> list[StepShape]:
    """shape_for of each step (its slices) of one run or of runs one after another, in the
    order they ran, with their rewarm counts under `cost`'s kernel switch (a run starts
    cold, so runs in sequence count apart)."""
    rows = [sum(n for n, _, _ in sl) for sl in steps]
    ks = rewarm_counts(cold, rows, int(getattr(cost, "breakpoint", 0)))
    return [shape_for(cost, sl, c, k) for sl, c, k in zip(steps, cold, ks)]


class StepCostModel(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class CalibratedCost:
    """t = sum_i coef_i * feature_i (seconds), the features being (FEATURES order):

        step            1                     fixed cost: Python, sampler set-up, ...
        requests        scheduled requests    per-request bookkeeping
        rows_few        T if T <= breakpoint  low-bit GEMV path (weight-byte bound)
        many_rows       1 if T >  breakpoint  switching to the dense GEMM path
        rows_many       T if T >  breakpoint  dense GEMM FLOPs per row
        logits          sampled positions     LM head rows, sampling, detokenizing
        decode_context  sum c over decode     KV bytes read by decode attention (a chunk
                        rows                  of <= chunk_rows tokens: one row a token);
                                              with decode_split, as its busiest thread
                                              reads them (StepShape.decode_busiest)
        prefill_context sum c over prefills   cached context gathered for a prefill chunk
        fresh_pairs     sum n(n+1)/2, c == 0  flash attention of fresh prompts
        chunk_scores    sum n*(c+n), c > 0    masked score matrix of chunks after context
                        n*(c+n) <= flash_above
        chunk_pairs     sum n*c + n(n+1)/2    the longer chunks after context: two flash
                        c > 0, above it       calls merged by log-sum-exp
        mixed_few       1 if T <= breakpoint  few rows with a longer prefill slice: the
                        and a prefill slice   modules, not the native decode stack
        cold_rows       T if the step is cold the engine hands freed heap memory back to the
                                              OS when it goes idle (EngineCore._on_idle), so
                                              the next step faults its transients in again
        rows_few_over   T - KNOT_ROWS if      the few-row path's cost per row rises above
                        KNOT_ROWS < T <= bp   KNOT_ROWS rows (decode steps: 1-3 streams
                                              ~1.2 ms each, 4-16 ~1.8 ms, docs/simulator.md
                                              §3); a slope change, not a jump
        rewarm          exp(-(k-1) /          the k-th step after a reset (a cold step
                        REWARM_STEPS)         or a many-row one; k <= REWARM_LIMIT) runs
                                              slower than the same step later: after the
                                              engine idled or ran a long prefill, its
                                              few-row steps take some steps to get back
                                              to their speed (§2, a14)
        multi_rows      1 if 2 <= T <= bp     the few-row path's step from one row to
                                              more (Intel VM, float32 engine: warm decode
                                              steps 4.8 / 7.3 / 8.1 / 8.8 ms at 1-4 rows,
                                              then ~0.85 ms a row; §2, a15)
        cold_idle       ln(1 + idle/IDLE_KNEE_S)  a cold step after `idle` seconds without
                        if the step is cold   requests runs slower the longer the engine
                                              idled (on the VMs measured: a 40-token
                                              prompt 34 ms after 0.05 s, 113 ms after 5 s;
                                              §3, r37); 0 when idle was not recorded
        cold_idle_rows  T x cold_idle         the same excess growing with the step's rows

    `breakpoint` is the row count where the engine switches kernels (fitted).
    `arrival_s` is the engine's cost of adding one request (validation, detokenizer set-up),
    paid by the step after an arrival. `flash_above`: the engine's split of chunks after
    context (StepShape; from the model's head count, not fitted). `chunk_rows`: chunks of
    up to this many tokens run as decode rows (StepShape; the engine's setting, 0 in
    profiles calibrated before it did). `decode_split`: the engine's (threads, KV heads)
    of its paged decode attention (StepShape; (0, 0) in profiles calibrated before it was
    recorded: the sum of the rows' context)."""

    coef: tuple[float, ...]
    breakpoint: int
    arrival_s: float = 0.0
    flash_above: int = 0
    chunk_rows: int = 0
    decode_split: tuple[int, int] = (0, 0)

    def features(self, s: StepShape) -> tuple[float, ...]:
        many = s.num_tokens > self.breakpoint
        idling = s.idling()
        return (1.0, s.num_reqs, 0 if many else s.num_tokens, 1.0 if many else 0.0,
                s.num_tokens if many else 0, s.num_logits, s.decode_busiest(),
                s.prefill_context, s.fresh_pairs, s.chunk_scores, s.chunk_pairs,
                0.0 if many or not s.num_prefills else 1.0, s.num_tokens if s.cold else 0,
                0 if many else max(0, s.num_tokens - KNOT_ROWS), s.rewarming(),
                0.0 if many or s.num_tokens < 2 else 1.0, idling, idling * s.num_tokens)

    def step_seconds(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self.coef, self.features(shape)))

    def scaled(self, factor: float) -> "CalibratedCost":
        """Every coefficient (and the arrival cost) times `factor` > 0: the same engine on
        a machine running 1/factor as fast (sim/speed.py)."""
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor}")
        return CalibratedCost(tuple(c * factor for c in self.coef), self.breakpoint,
                              self.arrival_s * factor, self.flash_above, self.chunk_rows,
                              self.decode_split)

    def describe(self) -> str:
        terms = ", ".join(f"{name} {c * 1e3:.4g} ms" for name, c in zip(FEATURES, self.coef))
        return (f"calibrated (breakpoint {self.breakpoint} rows, chunks after context on "
                f"flash above {self.flash_above} entries, chunks of up to {self.chunk_rows} "
                f"tokens as decode rows, decode attention split (threads, KV heads) "
                f"{self.decode_split}): {terms}")

    def to_json(self) -> dict:
        return {"kind": "calibrated", "features": list(FEATURES), "coef_s": list(self.coef),
                "breakpoint": self.breakpoint, "arrival_s": self.arrival_s,
                "flash_above": self.flash_above, "chunk_rows": self.chunk_rows,
                "decode_split": list(self.decode_split)}

    @classmethod
    def from_json(cls, d: dict) -> "CalibratedCost":
        names = list(d.get("features", FEATURES[:len(d["coef_s"])]))
        if names != list(FEATURES[:len(names)]) or len(d["coef_s"]) != len(names):
            raise ValueError(f"profile features {d.get('features')} != {list(FEATURES)}: "
                             "re-run `duet simulate --calibrate`")
        # a profile fitted before the later features were added: they cost nothing
        coef = [float(c) for c in d["coef_s"]] + [0.0] * (len(FEATURES) - len(names))
        return cls(tuple(coef), int(d["breakpoint"]),
                   float(d.get("arrival_s", 0.0)), int(d.get("flash_above", 0)),
                   int(d.get("chunk_rows", 0)),
                   tuple(int(x) for x in d.get("decode_split", (0, 0))))


@dataclass(frozen=True)
class RooflineCost:
    """A roofline per kernel group, summed (each group runs as its own kernels):

        linear    max(FLOPs_lin / (peak*mfu), weight bytes / (bw*mbu))   weights read once
                  per step, so prefill rows ride on a memory-bound decode step up to the
                  ridge point (FLOPs_lin = per_token * T + per_logit * L)
        prefill attention  max(per_pair * pairs / (peak*mfu), KV read / (bw*mbu))
        decode attention   max(per_pair * (c+1) / (peak*mfu), KV read / (bw*mbu))
        KV write  kv_bytes_per_token * T / (bw*mbu)
        + step_overhead_s + request_overhead_s * requests

    Per-unit FLOPs and bytes follow metrics/cost_model.py (sim/gpu.py derives them)."""

    peak_flops: float
    mem_bandwidth: float
    mfu: float
    mbu: float
    step_overhead_s: float
    request_overhead_s: float
    flops_per_token: float
    flops_per_pair: float
    flops_per_logit: float
    weight_bytes: float          # every step (layers, norms; embedding rows ignored)
    head_bytes: float            # steps that sample anything
    kv_bytes_per_token: float

    def step_seconds(self, s: StepShape) -> float:
        flop_s = self.peak_flops * self.mfu
        byte_s = self.mem_bandwidth * self.mbu
        kv = self.kv_bytes_per_token
        linear = max((self.flops_per_token * s.num_tokens
                      + self.flops_per_logit * s.num_logits) / flop_s,
                     (self.weight_bytes + (self.head_bytes if s.num_logits else 0.0)) / byte_s)
        prefill = max(self.flops_per_pair * s.prefill_pairs / flop_s,
                      kv * s.prefill_context / byte_s)
        decode = max(self.flops_per_pair * (s.decode_context + s.num_decodes) / flop_s,
                     kv * s.decode_context / byte_s)
        return (linear + prefill + decode + kv * s.num_tokens / byte_s
                + self.step_overhead_s + self.request_overhead_s * s.num_reqs)

    def describe(self) -> str:
        return (f"roofline: {self.peak_flops / 1e12:.4g} TFLOP/s x MFU {self.mfu:g}, "
                f"{self.mem_bandwidth / 1e12:.4g} TB/s x MBU {self.mbu:g}, overhead "
                f"{self.step_overhead_s * 1e3:g} ms/step + "
                f"{self.request_overhead_s * 1e3:g} ms/request")

    def to_json(self) -> dict:
        return {"kind": "roofline", **asdict(self)}
