"""Start-up micro-benchmark of this model on this machine, fitted as
core.step_budget.StepCost: probe steps run through the real runner (fresh prefills of two
sizes, a chunk after a cached context, decode-only steps of two batch sizes).

It takes about a second for small models and is cached in
`$DUET_CACHE_DIR` (default ~/.cache/duetserve)/step_cost.json, keyed by everything that
changes the rate: the checkpoint (path, size, mtime), dtype, threads, torch version, the
CPU model, and a digest of the model/worker source and of this file (so a new kernel or
probe is re-measured). A measurement taken on a busy machine is inflated and would skew
every later run's budget, so: probes whose repeats disagree are not cached, and a cached
fit is checked against one quick step at every start and re-measured when it is stale.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from duetserve.core.step_budget import StepCost, is_plausible
from duetserve.models.native import cache_dir as native_cache_dir
from duetserve.models.native import cpu_name
from duetserve.outputs import NewRequestData, SchedulerOutput
from duetserve.sampling_params import SamplingParams

log = logging.getLogger("duetserve")

SMALL, LARGE = 16, 128     # fresh prefills of these many tokens: the general line (above
                           # the low-bit rows R, when there are some: R + 16 and LARGE)
CONTEXT = 512              # a chunk after this many cached tokens: the context term
LOW_ROWS = 8               # the low-bit piece's smaller probe: at most this many rows
DECODES = 16               # decode-only steps of 1 and min(DECODES, R) streams: decode line
DECODE_CONTEXT = 128       # each probe stream's context
NOISE_RATIO = 1.5          # repeats of one probe further apart than this: a noisy machine
STALE_RATIO = 1.5          # a cached decode step this much slower than now: re-measured
MAX_CACHE_ENTRIES = 64
_PROBE_ID = "__duet_step_probe__"


def cache_dir() -> Path:
    return Path(native_cache_dir())


def _source_digest() -> str:
    """Digest of the code that decides the step time (models/, worker/, the native
    kernels in csrc/) and of the measurement itself (this file)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.blake2b(digest_size=8)
    for sub, pattern in (("models", "*.py"), ("worker", "*.py"), ("csrc", "*.[ch]*")):
        for path in sorted((root / sub).rglob(pattern)):
            h.update(path.read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def cache_key(model_path: str, dtype: str, num_threads: int, lowbit_rows: int = 0) -> str:
    try:
        st = os.stat(model_path)
        stamp = f"{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        stamp = "?"
    parts = [os.path.abspath(model_path), stamp, dtype, str(num_threads), torch.__version__,
             cpu_name(), _source_digest(), str(lowbit_rows)]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


def _load_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _time_step(runner, seqs: list[tuple[int, int]], vocab_size: int, block_size: int
               ) -> float:
    """Milliseconds of one step of probe sequences (context, new tokens): each computes
    its `new` last tokens after `context - new` cached ones, all in blocks 0..k (only
    called before any request exists, so no request's KV is overwritten; a prefix chunk
    reads the KV an earlier probe of the same tokens wrote). The probes' state is
    dropped after the step."""
    news, counts = [], {}
    for i, (ctx, new) in enumerate(seqs):
        rid = f"{_PROBE_ID}{i}"
        token_ids = [(j * 7919) % vocab_size for j in range(ctx)]
        news.append(NewRequestData(rid, token_ids, ctx, SamplingParams(temperature=0),
                                   # block ids interleave the model's KV groups
                                   list(range(-(-ctx // block_size)
                                              * len(runner.kv_windows))), ctx - new))
        counts[rid] = new
    so = SchedulerOutput(scheduled_new_reqs=news, num_scheduled_tokens=counts,
                         total_num_scheduled_tokens=sum(counts.values()))
    decodes = {r for r, n in counts.items() if n == 1}
    so.num_decode_tokens, so.decode_req_ids = len(decodes), decodes
    so.num_prefill_tokens = so.total_num_scheduled_tokens - len(decodes)
    t0 = time.perf_counter()
    runner.execute_model(so)
    ms = (time.perf_counter() - t0) * 1e3
    runner.execute_model(SchedulerOutput(finished_req_ids=set(counts)))   # drop their state
    return ms


class NoisyMeasurement(Exception):
    """Repeats of one probe disagreed by more than NOISE_RATIO (a contended machine).
    `cost` is the fit from the faster repeats anyway."""

    def __init__(self, reason: str, cost: StepCost) -> None:
        super().__init__(reason)
        self.cost = cost


def _decode_streams(lowbit_rows: int) -> int:
    """Streams of the larger decode-only probe (also the quick check's step)."""
    return min(DECODES, lowbit_rows) if lowbit_rows >= 4 else DECODES


def _low_rows(r: int) -> int:
    """Rows of the low-bit piece's smaller probe (R >= 4): 1 decode + a chunk of >= 2."""
    return max(3, min(LOW_ROWS, r // 2))


def _probes(max_tokens: int, lowbit_rows: int) -> tuple[dict, dict]:
    """The probe steps (name -> [(context, new tokens)]) and the sizes they were chosen
    with. Steps with prefill work carry decodes beside their chunk, as the steps the
    budget sizes do (a decode row costs more in the modules than a prompt row)."""
    r = lowbit_rows if lowbit_rows >= 4 else 0    # a low-bit piece needs R/2 >= 2 rows
    small = r + SMALL if r else SMALL
    large = max(small * 2, min(LARGE, max_tokens))
    chunk = r or SMALL
    ctx = min(CONTEXT, max_tokens - chunk)
    dctx = min(DECODE_CONTEXT, max_tokens)
    d2 = _decode_streams(lowbit_rows)
    beside = min(8, small // 2)                # decodes beside a dense line's chunk

    def mixed(rows: int, decodes: int) -> list[tuple[int, int]]:
        return [(dctx, 1)] * decodes + [(rows - decodes, rows - decodes)]
    probes = {"small": mixed(small, beside), "large": mixed(large, beside),
              "decode1": [(dctx, 1)], "decode2": [(dctx, 1)] * d2}
    if r:     # the low-bit piece's ends: a short chunk beside one decode (the steps whose
        # fixed cost decides how small a chunk is worth it, core/step_budget.py), R rows
        probes["low1"], probes["low2"] = mixed(_low_rows(r), 1), mixed(r, r - 2)
    if ctx >= 2 * chunk:
        probes["chunk"] = [(chunk, chunk)]
        probes["context"] = [(ctx + chunk, chunk)]
    return probes, {"r": r, "small": small, "large": large, "chunk": chunk, "ctx": ctx,
                    "d2": d2}


def probe_tokens(max_tokens: int, lowbit_rows: int) -> int:
    """The longest sequence any probe step holds (context included)."""
    probes = _probes(max_tokens, lowbit_rows)[0]
    return max(ctx for seqs in probes.values() for ctx, _ in seqs)


def measure(runner, vocab_size: int, block_size: int, max_tokens: int,
            lowbit_rows: int = 0) -> StepCost:
    """Fit StepCost (core/step_budget.py) from probe steps through the real runner:
    two steps of the low-bit piece, when the model's linears run low-bit kernels up to
    R = `lowbit_rows` >= 4 rows (one decode beside a short chunk, min(8, R/2) rows, and R
    rows, mostly decodes beside a short chunk); steps of R + 16 (or SMALL) and LARGE rows
    (the general line, 8 decodes beside a chunk); a chunk of R (or SMALL) tokens after
    CONTEXT cached tokens against the same chunk fresh (the context term); decode-only
    steps of 1 and min(DECODES, R) streams (the decode line). Each probe is warmed up once
    (first calls pay one-time kernel set-up and first-touch page faults), then timed
    twice, interleaved; the faster counts. Raises NoisyMeasurement (with the fit) when
    the two disagree by more than NOISE_RATIO. `max_tokens` bounds every probe's context."""
    probes, n = _probes(max_tokens, lowbit_rows)
    if "context" in probes:
        full = n["ctx"] + n["chunk"]
        _time_step(runner, [(full, full)], vocab_size, block_size)   # the context's KV
    times: dict[str, list[float]] = {k: [] for k in probes}
    for rep in range(3):                       # rep 0 warms up
        for name, seqs in probes.items():
            ms = _time_step(runner, seqs, vocab_size, block_size)
            if rep:
                times[name].append(ms)
    best = {k: min(v) for k, v in times.items()}
    r = n["r"]
    fixed, per_token = StepCost.line(n["small"], best["small"], n["large"], best["large"])
    per_pair = 0.0
    if "context" in best:
        per_pair = max(best["context"] - best["chunk"], 0.0) / (n["chunk"] * n["ctx"])
    dec_fixed, dec_per = StepCost.line(1, best["decode1"], n["d2"], best["decode2"])
    low_fixed = low_per = 0.0
    if r:
        low_fixed, low_per = StepCost.line(_low_rows(r), best["low1"], r, best["low2"])
    cost = StepCost(fixed, per_token, per_pair, dec_fixed, dec_per, r, low_fixed, low_per)
    noisy = {k: [round(t, 1) for t in v] for k, v in times.items()
             if max(v) > NOISE_RATIO * min(v)}
    if noisy:
        raise NoisyMeasurement(f"repeated probes disagree (ms): {noisy}", cost)
    return cost


def quick_step(runner, vocab_size: int, block_size: int, max_tokens: int,
               lowbit_rows: int) -> float:
    """The fastest of two decode-only steps of the decode line's larger probe (after one
    warm-up), in ms: the sanity check of a cached fit."""
    seqs = _probes(max_tokens, lowbit_rows)[0]["decode2"]
    _time_step(runner, seqs, vocab_size, block_size)
    return min(_time_step(runner, seqs, vocab_size, block_size) for _ in range(2))


def _cached_cost(entry: object) -> StepCost | None:
    """A cache entry as a StepCost; None when it is malformed or from an older model (no
    decode line)."""
    if not isinstance(entry, dict) or entry.get("decode_fixed_ms") is None:
        return None
    try:
        cost = StepCost.from_json(entry)
    except (KeyError, TypeError, ValueError):
        return None
    return cost if is_plausible(cost) else None


def _measure_checked(runner, vocab_size: int, block_size: int, max_tokens: int,
                     lowbit_rows: int) -> tuple[StepCost, str]:
    """(cost, why it must not be cached: "" when it may). Measures up to twice: a noisy
    or implausible measurement is retried once."""
    for _ in range(2):
        try:
            cost = measure(runner, vocab_size, block_size, max_tokens, lowbit_rows)
        except NoisyMeasurement as e:
            cost, reason = e.cost, str(e)
            continue
        if is_plausible(cost):
            return cost, ""
        reason = f"implausible fit ({cost.fixed_ms:.1f} ms + {cost.per_token_ms:.4f} ms/token)"
    return cost, reason


def measured_step_cost(runner, model_path: str, dtype: str, num_threads: int,
                       vocab_size: int, block_size: int, max_tokens: int,
                       lowbit_rows: int = 0) -> tuple[StepCost | None, bool]:
    """(StepCost, from_cache); (None, False) when a sequence of `max_tokens` (the KV
    cache's or the model's limit) cannot hold the probes. A cached fit is used only when a quick decode step now is
    not much faster than it predicts (a fit measured on a busy machine is
    inflated, and would skew every later run's budget): else, or without one, it is
    measured and stored, unless the measurement was noisy or implausible."""
    if probe_tokens(max_tokens, lowbit_rows) > max_tokens:
        return None, False
    key = cache_key(model_path, dtype, num_threads, lowbit_rows)
    path = cache_dir() / "step_cost.json"
    cached = _cached_cost(_load_cache(path).get(key))
    if cached is not None:
        d = _decode_streams(lowbit_rows)
        now = quick_step(runner, vocab_size, block_size, max_tokens, lowbit_rows)
        if now * STALE_RATIO >= cached.decode_ms(d):
            return cached, True
        log.info("cached step cost predicts %.1f ms for a decode step of %d streams but it "
                 "takes %.1f ms now (measured on a busy machine?): measuring again",
                 cached.decode_ms(d), d, now)
    cost, reason = _measure_checked(runner, vocab_size, block_size, max_tokens, lowbit_rows)
    if reason:
        log.warning("step cost measurement not cached: %s", reason)
        return cost, False
    cache = _load_cache(path)                 # re-read: another engine may have written
    cache[key] = {**cost.to_json(), "model": os.path.basename(model_path),
                  "measured_at": time.time()}
    if len(cache) > MAX_CACHE_ENTRIES:   # keep the newest entries
        cache = dict(sorted(cache.items(), key=lambda kv: kv[1].get("measured_at", 0)
                            if isinstance(kv[1], dict) else 0)[-MAX_CACHE_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache the step cost in %s: %s", path, e)
    return cost, False
