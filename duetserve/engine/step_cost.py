"""Start-up micro-benchmark of this model on this machine: the time of two prefill steps
(SMALL and LARGE tokens) run through the real runner, fitted as core.step_budget.StepCost.

It takes well under a second for small models and is cached in
`$DUET_CACHE_DIR` (default ~/.cache/duetserve)/step_cost.json, keyed by everything that
changes the rate: the checkpoint (path, size, mtime), dtype, threads, torch version, the
CPU model, and a digest of the model/worker source (so a new kernel is re-measured).
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

SMALL, LARGE = 16, 128
MAX_CACHE_ENTRIES = 64
_PROBE_ID = "__duet_step_probe__"


def cache_dir() -> Path:
    return Path(native_cache_dir())



def _source_digest() -> str:
    """Digest of the code that decides the step time (models/, worker/)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.blake2b(digest_size=8)
    for sub in ("models", "worker"):
        for path in sorted((root / sub).rglob("*.py")):
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(model_path: str, dtype: str, num_threads: int) -> str:
    try:
        st = os.stat(model_path)
        stamp = f"{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        stamp = "?"
    parts = [os.path.abspath(model_path), stamp, dtype, str(num_threads), torch.__version__,
             cpu_name(), _source_digest()]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


def _load_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _time_prefill(runner, num_tokens: int, vocab_size: int, block_size: int) -> float:
    """Milliseconds of one prefill step of `num_tokens` fresh tokens (blocks 0..k; only
    called before any request exists, so no cached KV is overwritten)."""
    num_blocks = -(-num_tokens // block_size)
    token_ids = [(i * 7919) % vocab_size for i in range(num_tokens)]
    new = NewRequestData(_PROBE_ID, token_ids, num_tokens, SamplingParams(temperature=0),
                         list(range(num_blocks)), 0)
    so = SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={_PROBE_ID: num_tokens},
                         total_num_scheduled_tokens=num_tokens)
    t0 = time.perf_counter()
    runner.execute_model(so)
    ms = (time.perf_counter() - t0) * 1e3
    runner.execute_model(SchedulerOutput(finished_req_ids={_PROBE_ID}))   # drop its state
    return ms


def measure(runner, vocab_size: int, block_size: int, max_tokens: int) -> StepCost:
    """Fit StepCost from SMALL- and LARGE-token prefills, interleaved, best of 2 each,
    after one warm-up of each size (first calls pay one-time kernel set-up).
    `max_tokens` bounds LARGE (context length and KV capacity)."""
    large = max(SMALL * 2, min(LARGE, max_tokens))
    _time_prefill(runner, SMALL, vocab_size, block_size)            # warm-up
    _time_prefill(runner, large, vocab_size, block_size)
    small_ms, large_ms = [], []
    for _ in range(2):
        small_ms.append(_time_prefill(runner, SMALL, vocab_size, block_size))
        large_ms.append(_time_prefill(runner, large, vocab_size, block_size))
    return StepCost.fit(SMALL, min(small_ms), large, min(large_ms))


def measured_step_cost(runner, model_path: str, dtype: str, num_threads: int,
                       vocab_size: int, block_size: int, max_tokens: int
                       ) -> tuple[StepCost, bool]:
    """(StepCost, from_cache). Measures and stores it when the cache has no entry."""
    key = cache_key(model_path, dtype, num_threads)
    path = cache_dir() / "step_cost.json"
    cache = _load_cache(path)
    entry = cache.get(key)
    if isinstance(entry, dict) and {"fixed_ms", "per_token_ms"} <= set(entry):
        return StepCost(float(entry["fixed_ms"]), float(entry["per_token_ms"])), True
    cost = measure(runner, vocab_size, block_size, max_tokens)
    if not is_plausible(cost):
        cost = measure(runner, vocab_size, block_size, max_tokens)     # once more
    if not is_plausible(cost):
        log.warning("step cost measurement too noisy (%.1f ms + %.4f ms/token); not "
                    "cached", cost.fixed_ms, cost.per_token_ms)
        return cost, False
    cache[key] = {"fixed_ms": cost.fixed_ms, "per_token_ms": cost.per_token_ms,
                  "model": os.path.basename(model_path), "measured_at": time.time()}
    if len(cache) > MAX_CACHE_ENTRIES:   # keep the newest entries
        cache = dict(sorted(cache.items(), key=lambda kv: kv[1].get("measured_at", 0))
                     [-MAX_CACHE_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache the step cost in %s: %s", path, e)
    return cost, False
