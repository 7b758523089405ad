"""The dashboard's live record: bounded rings of recent steps, requests and KV transfers.

Fed by the same hooks as the Prometheus exporter, on the engine thread:
  * `observe_step(StepStats)`        every step that ran tokens (a step observer)
  * `observe_state(StepStats)`       a queue/KV snapshot after aborts (idle stats observer)
  * `observe_finished(out, reason)`  once per ended request (finish observer)
  * `observe_transfer(t, backend)`   once per ended KV transfer (connector observer)
and read by `snapshot(since)` on the HTTP side (`/dashboard/data`, about once a second).

Cost. A step observer does one attribute store when nobody watches: the ring is filled
only while a reader asked within the last `watch_s` seconds (a dashboard page is open),
and then with one tuple appended under an uncontended lock (O(1): no loop over the
step's requests; decode rows are the decode tokens less the drafts verified, from the
scheduler's cumulative speculation counters). Totals that must match /metrics at any
time are not counted here: steps and tokens per phase are the engine accountant's
(`StepAccountant.summary()`), queue, KV and cache counters the latest StepStats'. Ended
requests (a few per second at most) are always recorded: counts, token totals, and
their latencies in a ring for percentiles.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from itertools import islice
from typing import Any

from duetserve.outputs import RequestOutput, StepStats

# One row per recorded step, in this order (the JSON sends the names once).
STEP_FIELDS = ("seq", "t", "seconds", "prefill_tokens", "decode_tokens", "rows",
               "decode_rows", "running", "waiting", "kv_usage", "ai", "flops_per_s",
               "bytes_per_s", "mfu", "mbu", "prefix_queries", "prefix_hits",
               "spec_draft_tokens", "spec_accepted")
REQUEST_FIELDS = ("t", "ttft", "tpot", "e2e", "queue", "prompt_tokens", "generation_tokens")
TRANSFER_FIELDS = ("t", "status", "bytes", "seconds")
PERCENTILES = (50, 90, 99)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0-100) of an ascending list; None when empty."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def latency_summary(values: list[float]) -> dict[str, Any]:
    """{"n", "mean", "p50", "p90", "p99"} of `values` (seconds; None entries skipped)."""
    xs = sorted(v for v in values if v is not None)
    out: dict[str, Any] = {"n": len(xs), "mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    return out


class LiveRecorder:
    """Recent steps, requests and transfers of one engine, for the dashboard.

    Observers run on the engine thread; `snapshot` on any other. `latest` is the newest
    StepStats seen (a step's or an idle snapshot's): the dashboard's queue, KV and
    cumulative cache counters."""

    def __init__(self, step_capacity: int = 4096, request_capacity: int = 2048,
                 transfer_capacity: int = 1024, watch_s: float = 30.0) -> None:
        if min(step_capacity, request_capacity, transfer_capacity) < 1 or watch_s <= 0:
            raise ValueError("capacities must be >= 1 and watch_s > 0")
        self.watch_s = watch_s
        self.latest = StepStats()
        self._lock = threading.Lock()
        self._steps: deque[tuple] = deque(maxlen=step_capacity)
        self._requests: deque[tuple] = deque(maxlen=request_capacity)
        self._transfers: deque[tuple] = deque(maxlen=transfer_capacity)
        self._seq = 0
        self._watch_until = 0.0          # time.time(): record steps while below it
        self._prev_draft_tokens: int | None = None
        self._finished: dict[str, int] = {}
        self._prompt_tokens = self._generation_tokens = 0
        self._transfer_counts: dict[str, int] = {}
        self._transfer_bytes = 0
        self._transfer_seconds = 0.0

    # -- engine-thread feeds ----------------------------------------------------------
    def observe_step(self, st: StepStats) -> None:
        """A step ran: becomes `latest`; appended to the step ring while watched."""
        self.latest = st
        if st.start_time > self._watch_until:
            return
        spec = st.spec
        decode_rows = st.num_decode_tokens
        if spec is not None:
            prev = self._prev_draft_tokens
            self._prev_draft_tokens = spec.num_draft_tokens
            if prev is not None:
                decode_rows = max(0, decode_rows - (spec.num_draft_tokens - prev))
        acc = st.account
        ai = fps = bps = mfu = mbu = 0.0
        if acc is not None:
            ai, fps, bps = acc.ai, acc.flops_per_s, acc.bytes_per_s
            mfu, mbu = acc.mfu, acc.mbu
        with self._lock:
            self._seq += 1
            self._steps.append((
                self._seq, st.start_time, st.step_seconds, st.num_prefill_tokens,
                st.num_decode_tokens, len(st.items), decode_rows, st.num_running,
                st.num_waiting, st.kv_usage, ai, fps, bps, mfu, mbu,
                st.prefix_cache_queries, st.prefix_cache_hits,
                spec.num_draft_tokens if spec is not None else 0,
                spec.num_accepted_tokens if spec is not None else 0))

    def observe_state(self, st: StepStats) -> None:
        """A queue/KV snapshot outside a step (after aborts): becomes `latest`."""
        self.latest = st

    def observe_finished(self, out: RequestOutput | None, reason: str) -> None:
        """A request ended: counted by reason; its token counts and latencies recorded."""
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1
            if out is None:
                return
            m = out.metrics
            num_gen = m.num_generation_tokens if m is not None else 0
            num_prompt = len(out.prompt_token_ids)
            self._prompt_tokens += num_prompt
            self._generation_tokens += num_gen
            if m is None:
                return
            self._requests.append((m.finished_time or time.time(), m.ttft, m.tpot,
                                   m.e2e_latency, m.queue_time, num_prompt, num_gen))

    def observe_transfer(self, t: Any, backend: str) -> None:
        """A KV transfer ended (a kv_transfer.state.Transfer; duck-typed). Counted by
        backend and status as duet:kv_transfers_total; bytes and seconds of the done
        reads (not the prefill side's "held" records) as duet:kv_transfer_*_total."""
        status = t.status.value
        with self._lock:
            key = f"{backend}:{status}"
            self._transfer_counts[key] = self._transfer_counts.get(key, 0) + 1
            if backend == "held" or status != "done":
                return
            seconds = t.seconds if t.seconds is not None else \
                max(0.0, (t.finished or 0.0) - (t.started or 0.0))
            self._transfer_bytes += t.nbytes
            self._transfer_seconds += seconds
            self._transfers.append((t.finished or time.time(), status, t.nbytes, seconds))

    # -- reader side --------------------------------------------------------------------
    def watch(self, now: float | None = None) -> None:
        """Someone is looking: record steps for the next `watch_s` seconds. A new watch
        after a lapse forgets the speculation baseline (its first step counts no drafts)."""
        now = time.time() if now is None else now
        if now > self._watch_until:
            self._prev_draft_tokens = None
        self._watch_until = now + self.watch_s

    @property
    def watching(self) -> bool:
        return time.time() <= self._watch_until

    def steps_since(self, since: int) -> tuple[list[tuple], bool, int]:
        """(recorded steps with seq > since, oldest first; True when steps after `since`
        were already dropped from the ring; the newest seq, the next `since`)."""
        with self._lock:
            seq = self._seq
            newer = max(0, seq - max(since, 0))
            n = len(self._steps)
            rows = list(islice(self._steps, max(0, n - newer), n))
        return rows, newer > n, seq

    def recent(self, window_s: float, now: float) -> dict[str, Any]:
        """Rates over the recorded steps that began in the last `window_s` seconds."""
        with self._lock:
            rows = [r for r in self._steps if r[1] >= now - window_s]
        prefill = sum(r[3] for r in rows)
        decode = sum(r[4] for r in rows)
        busy = sum(r[2] for r in rows)
        return {"window_s": window_s, "steps": len(rows),
                "prefill_tokens_per_s": prefill / window_s,
                "decode_tokens_per_s": decode / window_s,
                "busy_fraction": min(1.0, busy / window_s)}

    def request_summary(self, window_s: float, now: float) -> dict[str, Any]:
        """Ended requests: totals since start, latency percentiles over `window_s`."""
        with self._lock:
            rows = [r for r in self._requests if r[0] >= now - window_s]
            out: dict[str, Any] = {
                "finished": sum(self._finished.values()),
                "finished_by_reason": dict(self._finished),
                "prompt_tokens": self._prompt_tokens,
                "generation_tokens": self._generation_tokens}
        out["window_s"] = window_s
        for i, name in enumerate(REQUEST_FIELDS[1:5], start=1):
            out[name] = latency_summary([r[i] for r in rows])
        return out

    def transfer_summary(self, window_s: float, now: float) -> dict[str, Any]:
        """Ended KV transfers: counts by backend:status, bytes and seconds of the reads,
        and the reads of the last `window_s` seconds."""
        with self._lock:
            recent = [list(r) for r in self._transfers if r[0] >= now - window_s]
            return {"counts": dict(self._transfer_counts), "bytes": self._transfer_bytes,
                    "seconds": self._transfer_seconds, "window_s": window_s,
                    "fields": list(TRANSFER_FIELDS), "recent": recent}

    def state(self) -> dict[str, Any]:
        """The latest queue, KV and cumulative cache/speculation counters."""
        st = self.latest
        spec = st.spec
        return {"running": st.num_running, "waiting": st.num_waiting,
                "kv_usage": st.kv_usage, "used_blocks": st.num_used_blocks,
                "preemptions": st.num_preemptions,
                "prefix_queries": st.prefix_cache_queries,
                "prefix_hits": st.prefix_cache_hits,
                "spec": None if spec is None else {
                    "drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
                    "accepted_tokens": spec.num_accepted_tokens,
                    "accepted_per_pos": list(spec.accepted_per_pos)}}

    def snapshot(self, since: int = 0, *, with_steps: bool = True, window_s: float = 60.0,
                 recent_s: float = 10.0) -> dict[str, Any]:
        """What one dashboard poll gets (JSON-serialisable): the steps recorded after
        `since` (none when not with_steps), the state, request and transfer summaries, and
        rates over the last `recent_s` seconds. Marks the recorder watched."""
        now = time.time()
        self.watch(now)
        rows, dropped, seq = self.steps_since(since) if with_steps else ([], False,
                                                                           self._seq)
        return {"now": now, "seq": seq, "watching_s": self.watch_s,
                "fields": list(STEP_FIELDS), "steps": [list(r) for r in rows],
                "dropped": dropped, "state": self.state(),
                "recent": self.recent(recent_s, now),
                "requests": self.request_summary(window_s, now),
                "transfers": self.transfer_summary(window_s, now)}


__all__ = ["LiveRecorder", "STEP_FIELDS", "latency_summary", "percentile"]
