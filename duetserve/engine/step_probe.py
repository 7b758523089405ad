"""The one probe harness: time steps of chosen shapes through the real runner and fit the
step-time model (core/step_time.py) to them.

    EngineCore start-up   `startup_step_time`: STARTUP probes (about a second on small
                          models), fitted over STARTUP_TERMS, cached in
                          $DUET_CACHE_DIR/step_time.json (default ~/.cache/duetserve)
    duet simulate         `measure` with `calibration_probes` (more shapes, cold steps,
      --calibrate         more repeats), fitted over every term with the served engine's
                          own steps (entrypoints/sim_calibrate.py)

A probe step is a SchedulerOutput of probe sequences (context, new tokens) handed to
`runner.execute_model`, before any request exists, on KV blocks spread over the pool
(ProbeBlocks: as a served engine's are, in mapped pages); each
probe is warmed up once (first calls pay kernel set-up and first-touch page faults), then
timed REPEATS times, interleaved with the others; the fastest counts. Repeats further
apart than NOISE_RATIO mean a contended machine: the start-up measures again once and
does not cache a noisy result.

The cache key names everything that changes which kernels run or how fast: the
checkpoint (path, size, mtime), the kernel switches of the EngineConfig
(`EngineConfig.kernel_switches`: dtype, quantization, KV dtype, native kernels, decode
stack, K-quant forms, huge pages, KV prefault), the threads, torch, the CPU, the layout
(few-row limit, chunk rows) and a digest of the model, worker and kernel sources and of
this file. At each start a cached model is checked against one quick decode step and
measured again when it predicts STALE_RATIO x slower than now (it was measured on a busy
machine).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from duetserve.config import ConfigError, cache_dir
from duetserve.core.step_budget import IDLE_PROBE
from duetserve.core.step_fit import fit_step_time
from duetserve.core.step_time import Layout, StepShape, StepTime
from duetserve.loader import release_free_memory
from duetserve.models.attention import GROUPED_MAX_SCORES
from duetserve.models.kernels import few_row_limit
from duetserve.models.native import cpu_name
from duetserve.outputs import NewRequestData, SchedulerOutput
from duetserve.sampling_params import SamplingParams
from duetserve.worker.batch import SeqWork, build_step_batch
from duetserve.worker.kv_cache import release_pages

log = logging.getLogger("duetserve")

DECODE_CONTEXT = 128       # each decode probe stream's context
LONG_CONTEXT = 512         # decodes and chunks after this many cached tokens: attention
DECODES = 16               # the larger decode-only probe: min(DECODES, few-row limit)
LARGE = 128                # rows of the largest start-up probe (dense GEMMs)
# Few-row limits above this (prefill chunks on the low-bit kernels, or every step): the
# start-up probes are sized as for this limit and kept within the real one, so start-up
# takes what it does at 64; the many-row path, if any, is priced as the mixed one
# (core/step_fit.fit_step_time).
PROBE_FEW_ROWS = 64
REPEATS = 2
NOISE_RATIO = 1.5          # repeats of one probe further apart than this: a noisy machine
STALE_RATIO = 1.5          # a cached decode step this much slower than now: re-measured
MAX_CACHE_ENTRIES = 64
CACHE_FILE = "step_time.json"
# the terms the start-up probes tell apart (the rest: calibration only, core/step_time.py)
STARTUP_TERMS = ("few_step", "few_row", "mixed_step", "mixed_row", "many_step", "many_row",
                 "logit", "decode_kv", "decode_kv_reread", "fresh_pair", "chunk_score",
                 "chunk_pair")
_PROBE_ID = "__duet_step_probe__"


@dataclass(frozen=True)
class Probe:
    """One probe step: sequences of (context, new tokens), each computing its `new` last
    tokens (its last row sampled); `cold`: the step follows a release of the freed heap,
    as the first step after the engine went idle does."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    cold: bool = False

    @property
    def longest(self) -> int:
        return max(ctx for ctx, _ in self.seqs)

    def shape(self, layout: Layout) -> StepShape:
        return StepShape.of(((new, ctx - new, 1) for ctx, new in self.seqs), layout,
                            self.cold)


def layout_of(runner, num_attention_heads: int) -> Layout:
    """The engine's step layout: the model's few-row kernel limit, the runner's chunks
    as decode rows, the attention backend's masked-matrix bound per head."""
    return Layout(few_row_limit(runner.model), runner.chunk_rows,
                  GROUPED_MAX_SCORES // num_attention_heads)


def _mixed(name: str, rows: int, decodes: int, ctx: int = DECODE_CONTEXT) -> Probe:
    """`decodes` streams beside one fresh chunk: `rows` rows in all."""
    chunk = rows - decodes
    return Probe(name, ((ctx, 1),) * decodes + ((chunk, chunk),))


def startup_probes(layout: Layout) -> list[Probe]:
    """The start-up probe set: decode-only steps of 1 and min(DECODES, R) streams (R: the
    few-row limit, at most PROBE_FEW_ROWS) and of those streams after LONG_CONTEXT
    (decode attention), steps of a short chunk beside one decode and of R rows (the
    few-row kernels with prompt work), of R + 16 and LARGE rows (8 decodes beside a
    chunk: the dense GEMMs) and of 32 decodes past R (the LM head's rows on the dense
    path), a chunk of decode rows and a prefill-laid chunk each after LONG_CONTEXT cached
    tokens against the same fresh, and a fresh prompt of IDLE_PROBE tokens (the largest
    step a lone prompt gets). With a few-row limit past PROBE_FEW_ROWS no other probe
    exceeds it: they run the few-row kernels."""
    r = min(layout.few_rows, PROBE_FEW_ROWS) if layout.few_rows >= 4 else 0
    most = layout.few_rows if layout.few_rows > PROBE_FEW_ROWS else None
    d2 = min(DECODES, r) if r else DECODES
    small = r + 16 if r else 16
    probes = [Probe("decode1", ((DECODE_CONTEXT, 1),)),
              Probe("decode", ((DECODE_CONTEXT, 1),) * d2),
              Probe("decode_long", ((LONG_CONTEXT, 1),) * d2),
              Probe("decode_many", ((DECODE_CONTEXT, 1),) * _within(max(32, r + 8), most)),
              _mixed("small", _within(small, most), min(8, small // 2)),
              _mixed("large", _within(max(LARGE, small * 2), most), 8)]
    if r:
        probes += [_mixed("low1", max(3, min(8, r // 2)), 1), _mixed("low2", r, r - 2)]
    row_chunk = min(r or 16, layout.chunk_rows) if layout.chunk_rows else 0
    if row_chunk >= 2:
        probes += [Probe("rows_fresh", ((row_chunk, row_chunk),)),
                   Probe("rows_context", ((LONG_CONTEXT + row_chunk, row_chunk),))]
    # past the chunks laid out as rows (at most PROBE_FEW_ROWS of them: deterministic mode
    # lays out every chunk so, and its probe chunk stays small)
    chunk = _within(max(min(layout.chunk_rows, PROBE_FEW_ROWS) + 32, 64), most)
    probes += [Probe("chunk_fresh", ((chunk, chunk),)),
               Probe("chunk_context", ((LONG_CONTEXT + chunk, chunk),))]
    # a lone prompt's big step, whatever its kernels: the idle chunk is chosen among sizes
    # up to this one (core/step_budget.idle_chunk), so its per-row cost and its flash
    # attention are measured, not extrapolated (a 1.5B model: ~2 s, once per machine)
    probes.append(Probe("prefill_idle", ((IDLE_PROBE, IDLE_PROBE),)))
    return probes


def _within(rows: int, most: int | None) -> int:
    return rows if most is None else min(rows, most)


def calibration_probes(layout: Layout) -> list[Probe]:
    """`duet simulate --calibrate`'s probe set: decode batches of 1 to 64 streams at three
    contexts, fresh prefills of 8 to 1,024 tokens, chunks after context of both attention
    layouts, decodes beside chunks of several sizes, and cold steps (after the freed heap
    was released) of one decode and of fresh prefills."""
    probes = [Probe(f"decode{b}x{c}", ((c, 1),) * b)
              for c in (DECODE_CONTEXT, LONG_CONTEXT, 1024)
              for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)]
    probes += [Probe(f"prefill{n}", ((n, n),)) for n in (8, 32, 96, 128, 256, 512, 1024)]
    probes += [Probe(f"chunk{n}@{c}", ((c + n, n),))
               for n, c in ((16, 1024), (48, 512), (96, 512), (256, 512), (512, 16),
                            (128, 1024))]
    probes += [_mixed(f"mixed{d}+{n}", d + n, d) for d in (1, 4, 8, 16)
               for n in (8, 64, 128, 256)]
    probes += [Probe("cold_decode", ((DECODE_CONTEXT, 1),), cold=True)]
    probes += [Probe(f"cold_prefill{n}", ((n, n),), cold=True) for n in (16, 64, 256)]
    return probes


class ProbeBlocks:
    """The KV blocks of probe steps: each step's sequences take consecutive runs of one
    fixed shuffle of the pool, so a probe reads KV scattered over the pool as a served
    engine does once its free list has churned (SmolLM2, 8-12 decode streams: on shuffled
    blocks 1.45x the step of every stream reading blocks 0..k, 1.3x that of distinct
    blocks in order: TLB and cache misses), from pages that hold memory: a lazily mapped
    cache's unwritten pages all read the one zero page, which stays in cache. As a context:
    entering writes zeros to the blocks the probes use (mapping their pages); leaving
    hands a lazily mapped cache's pages back (worker/kv_cache.release_pages), so an
    idle engine holds none of them. Only while no request exists: a chunk after context
    reads whatever KV those blocks hold."""

    def __init__(self, runner, probes: Sequence[Probe], block_size: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.groups = len(runner.kv_windows)
        self.order = list(range(runner.num_blocks))
        random.Random(0).shuffle(self.order)
        self.num_used = min(runner.num_blocks, max(
            (sum(self._count(ctx) for ctx, _ in p.seqs) for p in probes), default=0))

    def _count(self, ctx: int) -> int:
        return -(-ctx // self.block_size) * self.groups   # ids interleave the KV groups

    def tables(self, probe: Probe) -> list[list[int]]:
        """Each sequence's block ids (wrapping around the pool when the step needs more)."""
        tables, at, n = [], 0, len(self.order)
        for ctx, _ in probe.seqs:
            k = self._count(ctx)
            tables.append([self.order[(at + j) % n] for j in range(k)])
            at += k
        return tables

    def __enter__(self) -> "ProbeBlocks":
        ids = torch.tensor(self.order[:self.num_used], dtype=torch.long)
        with torch.no_grad():
            for k, v in self.runner.kv_caches:
                k.index_fill_(1, ids.to(k.device), 0)
                v.index_fill_(1, ids.to(v.device), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner.kv_lazy:
            release_pages(self.runner.kv_caches)


def _time_step(runner, probe: Probe, blocks: ProbeBlocks, vocab_size: int) -> float:
    """Seconds of one probe step on `blocks` (only called before any request exists). The
    probes' state is dropped after the step."""
    news, counts = [], {}
    for i, ((ctx, new), table) in enumerate(zip(probe.seqs, blocks.tables(probe))):
        rid = f"{_PROBE_ID}{i}"
        token_ids = [(j * 7919) % vocab_size for j in range(ctx)]
        news.append(NewRequestData(rid, token_ids, ctx, SamplingParams(temperature=0),
                                   table, ctx - new))
        counts[rid] = new
    so = SchedulerOutput(scheduled_new_reqs=news, num_scheduled_tokens=counts,
                         total_num_scheduled_tokens=sum(counts.values()),
                         sampled_req_ids=set(counts))
    so.decode_req_ids = {r for r, n in counts.items() if n == 1}
    so.num_decode_tokens = len(so.decode_req_ids)
    so.num_prefill_tokens = so.total_num_scheduled_tokens - so.num_decode_tokens
    if probe.cold:
        release_free_memory()
    t0 = time.perf_counter()
    runner.execute_model(so)
    seconds = time.perf_counter() - t0
    runner.execute_model(SchedulerOutput(finished_req_ids=set(counts)))   # drop their state
    return seconds


def measure(runner, probes: Sequence[Probe], layout: Layout, vocab_size: int,
            block_size: int, repeats: int = REPEATS
            ) -> tuple[list[tuple[StepShape, float]], str]:
    """(shape, fastest seconds) of each probe: one warm-up round, then `repeats` timed
    rounds over all probes in turn, on ProbeBlocks; and "" or, when some probe's repeats
    disagree by more than NOISE_RATIO (a contended machine), which ones. Only before any
    request exists."""
    times: dict[str, list[float]] = {p.name: [] for p in probes}
    with ProbeBlocks(runner, probes, block_size) as blocks:
        for rep in range(repeats + 1):                 # round 0 warms up
            for p in probes:
                dt = _time_step(runner, p, blocks, vocab_size)
                if rep:
                    times[p.name].append(dt)
    noisy = {k: [round(t * 1e3, 1) for t in v] for k, v in times.items()
             if max(v) > NOISE_RATIO * min(v)}
    samples = [(p.shape(layout), min(times[p.name])) for p in probes]
    return samples, f"repeated probes disagree (ms): {noisy}" if noisy else ""


def fits(probes: Sequence[Probe], max_tokens: int) -> list[Probe]:
    """The probes whose sequences a context of `max_tokens` holds."""
    return [p for p in probes if p.longest <= max_tokens]


@dataclass(frozen=True)
class StepTimeSource:
    """Where the engine's step time came from, for the start-up log and --print-config."""

    how: str                 # "measured", "cached", "file", "none"
    detail: str = ""
    key: str = ""            # the cache key (measured or cached)


def read_step_time(path: str) -> StepTime:
    """The step-time model in a JSON file: a StepTime's own JSON, or `duet serve
    --print-config`'s output (its "step_time"). ConfigError naming the file otherwise."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--step-time {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"--step-time {path} is not JSON: {e}") from None
    if isinstance(doc, dict) and "step_time" in doc:
        doc = doc["step_time"]
    try:
        return StepTime.from_json(doc)
    except ValueError as e:
        raise ConfigError(f"--step-time {path}: {e}") from None


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


def cache_key(model_path: str, switches: dict, num_threads: int, layout: Layout) -> str:
    """The step-time cache key: every input that changes which kernels run or how fast
    (module docstring)."""
    try:
        st = os.stat(model_path)
        stamp = f"{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        stamp = "?"
    parts = [os.path.abspath(model_path), stamp, json.dumps(switches, sort_keys=True),
             str(num_threads), torch.__version__, cpu_name(), _source_digest(),
             json.dumps(layout.to_json(), sort_keys=True)]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


def cache_path() -> Path:
    return Path(cache_dir()) / CACHE_FILE


def _load_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _store(path: Path, key: str, entry: dict) -> None:
    """Add `entry` under `key` to the cache file (the newest MAX_CACHE_ENTRIES kept);
    a failure to write is logged, not raised."""
    cache = _load_cache(path)             # re-read: another engine may have written
    cache[key] = entry
    if len(cache) > MAX_CACHE_ENTRIES:
        cache = dict(sorted(cache.items(), key=lambda kv: kv[1].get("measured_at", 0)
                            if isinstance(kv[1], dict) else 0)[-MAX_CACHE_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache the step time in %s: %s", path, e)


def _cached_model(entry: object, layout: Layout) -> StepTime | None:
    if not isinstance(entry, dict):
        return None
    try:
        model = StepTime.from_json(entry.get("step_time"))
    except ValueError:
        return None
    return model if model.layout == layout and model.is_plausible() else None


def _measure_startup(runner, layout: Layout, vocab_size: int, block_size: int,
                     max_tokens: int) -> tuple[StepTime | None, str]:
    """(model, why it must not be cached: "" when it may). Measures up to twice: a noisy
    or implausible measurement is tried once more. (None, why) when the probes cannot
    identify the layout's terms (a few-row limit measured very low on a busy machine
    routes more of them to other kernels than there are probes)."""
    probes = fits(startup_probes(layout), max_tokens)
    for _ in range(2):
        samples, noisy = measure(runner, probes, layout, vocab_size, block_size)
        try:
            model, _ = fit_step_time(samples, layout, STARTUP_TERMS)
        except ValueError as e:
            return None, f"no fit: {e}"
        reason = noisy or ("" if model.is_plausible() else
                           f"implausible fit ({model.describe()})")
        if not reason:
            break
    return model, reason


def _quick_decode(runner, layout: Layout, vocab_size: int, block_size: int) -> float:
    """The fastest of two decode-only steps of the decode probe (after a warm-up), s."""
    probe = startup_probes(layout)[1]
    with ProbeBlocks(runner, [probe], block_size) as blocks:
        _time_step(runner, probe, blocks, vocab_size)
        return min(_time_step(runner, probe, blocks, vocab_size) for _ in range(2))


def startup_step_time(runner, model_path: str, switches: dict, num_threads: int,
                      vocab_size: int, num_heads: int, block_size: int, max_tokens: int
                      ) -> tuple[StepTime | None, StepTimeSource]:
    """The engine's step-time model and where it came from: the cached one when its key
    matches and a quick decode step now is not much faster than it predicts; else
    measured (and cached unless noisy or implausible). (None, source "none") when a
    sequence of `max_tokens` (the KV cache's or the model's limit) cannot hold the
    probes. Call it before any request exists."""
    layout = layout_of(runner, num_heads)
    if any(p.longest > max_tokens for p in startup_probes(layout)[:2]):
        return None, StepTimeSource("none", f"a context of {max_tokens} tokens cannot hold "
                                            "the probes")
    key = cache_key(model_path, switches, num_threads, layout)
    path = cache_path()
    entry = _load_cache(path).get(key)
    cached = _cached_model(entry, layout)
    if cached is not None:
        probe = startup_probes(layout)[1]
        now = _quick_decode(runner, layout, vocab_size, block_size)
        predicted = cached.seconds(probe.shape(layout))
        if now * STALE_RATIO >= predicted:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["measured_at"]))
            return cached, StepTimeSource("cached", f"{path} key {key}, measured {when}",
                                          key)
        log.info("cached step time predicts %.1f ms for a decode step of %d streams but it "
                 "takes %.1f ms now (measured on a busy machine?): measuring again",
                 predicted * 1e3, len(probe.seqs), now * 1e3)
    t0 = time.perf_counter()
    model, reason = _measure_startup(runner, layout, vocab_size, block_size, max_tokens)
    took = time.perf_counter() - t0
    if model is None:
        log.warning("step time measurement failed: %s", reason)
        return None, StepTimeSource("none", f"measurement failed ({reason})")
    if reason:
        log.warning("step time measurement not cached: %s", reason)
        return model, StepTimeSource("measured", f"in {took:.1f} s, not cached ({reason})",
                                     key)
    _store(path, key, {"step_time": model.to_json(), "model": os.path.basename(model_path),
                       "switches": switches, "threads": num_threads,
                       "measured_at": time.time()})
    return model, StepTimeSource("measured", f"in {took:.1f} s, cached in {path} key {key}",
                                 key)


@torch.inference_mode()
def forward_seconds(model: torch.nn.Module, kv_caches: list, block_size: int,
                    vocab_size: int, rows: int = 1, paged_decode: bool = True,
                    repeats: int = 3, num_ids: int | None = None) -> float:
    """Median seconds of one forward of `rows` decode rows (one sequence's consecutive
    positions from block_size on, logits of every row, of ids [0, num_ids) when given)
    on a bare model and its KV cache: a draft model's cost per proposed token. Runs
    1 + repeats steps into KV blocks 0 .. (block_size + rows - 1) // block_size (call it
    before any request exists)."""
    windows = tuple(g.window for g in model.config.kv_groups())
    blocks = list(range(((block_size + rows - 1) // block_size + 1) * len(windows)))
    work = [SeqWork("probe", [(7919 * j) % vocab_size], block_size + j, blocks, True)
            for j in range(rows)]
    batch = build_step_batch(work, block_size, "cpu", paged_decode, windows)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        hidden = model(batch.input_ids, batch.positions, kv_caches, batch.meta)
        model.compute_logits(hidden[batch.logits_indices], num_ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])
