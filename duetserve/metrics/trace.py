"""Step timeline as a Chrome / Perfetto trace (open in https://ui.perfetto.dev or
chrome://tracing).

One process ("duetserve", pid 1) with:

    tid 0            "engine steps"   one complete event ("ph": "X") per step, named by
                                      phase, args: prefill/decode tokens, running, waiting,
                                      kv_usage, mfu, mbu, flops, bytes
    tid 1, 2, ...    "req <id>"       one track per request, in order of first sight:
                                      queued (arrival -> first scheduled step; the
                                        first step seen when the arrival is unknown)
                                      prefill (one event per prefill chunk step)
                                      decode  (consecutive decode steps merged in one span)
                                      finished (instant event at the end of its last step)

Times are microseconds since the earliest time seen (arrival or step start). The file is
written by `flush()` (atomically: temp file + rename, so a reader never sees half a file)
and by `close()`; `flush_every_s` also flushes from `observe` periodically.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from duetserve.kv_transfer.state import Transfer
from duetserve.metrics.step_accounting import StepAccountant
from duetserve.outputs import StepStats

PID = 1
STEPS_TID = 0
STEPS_TRACK = "engine steps"


@dataclass(slots=True)
class _Span:
    name: str
    start: float        # seconds, time.time() clock
    end: float
    args: dict[str, Any]


@dataclass(slots=True)
class _ReqTrack:
    tid: int
    arrival: float | None = None
    num_prompt_tokens: int | None = None
    scheduled: bool = False
    finished: bool = False
    decode: _Span | None = None       # the open (mergeable) decode span
    last_decode_step: int = -2


class TraceWriter:
    """A step observer writing a Chrome trace JSON to `path`.

    `engine.add_step_observer(writer.observe)`; optionally `writer.request_arrived(req_id,
    t, num_prompt_tokens)` from add_request; `writer.close()` at the end. When an
    `accountant` (StepAccountant) is given, step events carry its MFU/MBU/FLOPs/bytes.
    """

    def __init__(self, path: str, accountant: StepAccountant | None = None, *,
                 metadata: dict[str, Any] | None = None,
                 flush_every_s: float | None = None) -> None:
        self.path = path
        self.accountant = accountant
        self.metadata = dict(metadata or {})
        self.flush_every_s = flush_every_s
        self._events: list[dict[str, Any]] = []     # finished events, times in seconds
        self._tracks: dict[str, _ReqTrack] = {}
        self._step_index = 0
        self._t0: float | None = None
        self._first_start: float | None = None     # start of the first step observed
        self._last_time = 0.0
        self._last_flush = time.monotonic()
        self._closed = False

    # -- inputs ----------------------------------------------------------------------
    def request_arrived(self, req_id: str, t: float | None = None,
                        num_prompt_tokens: int | None = None) -> None:
        """Record the arrival time (time.time() clock; default now) and, optionally, the
        prompt length of `req_id`."""
        track = self._track(req_id)
        track.arrival = time.time() if t is None else t
        track.num_prompt_tokens = num_prompt_tokens
        self._see(track.arrival)

    def observe(self, stats: StepStats) -> None:
        """Record one step. Mutates the in-memory event lists."""
        if self._closed:
            return
        start, dur = float(stats.start_time), max(0.0, float(stats.step_seconds))
        end = start + dur
        if self._first_start is None:
            self._first_start = start
        self._see(start)
        self._see(end)
        args: dict[str, Any] = {
            "step": self._step_index,
            "prefill_tokens": stats.num_prefill_tokens,
            "decode_tokens": stats.num_decode_tokens,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage,
            "num_requests": len(stats.items)}
        if stats.spec is not None:      # cumulative speculative-decoding counters
            spec = stats.spec
            args.update(spec_drafts=spec.num_drafts, spec_draft_tokens=spec.num_draft_tokens,
                        spec_accepted_tokens=spec.num_accepted_tokens,
                        spec_acceptance_rate=spec.acceptance_rate,
                        spec_mean_accepted_length=spec.mean_accepted_length)
        name = stats.phase
        if self.accountant is not None:
            acc = self.accountant.account_for(stats)
            args.update(mfu=acc.mfu, mbu=acc.mbu, flops=acc.flops, bytes=acc.bytes,
                        flops_per_s=acc.flops_per_s, bytes_per_s=acc.bytes_per_s,
                        compute=acc.compute)
        else:
            args.update(mfu=None, mbu=None)
        self._events.append({"name": name, "ph": "X", "tid": STEPS_TID, "start": start,
                             "end": end, "args": args})
        for item in stats.items:
            self._observe_item(item.req_id, item.num_new_tokens, item.num_computed_before,
                               item.is_decode, start, end)
        for req_id in stats.finished_req_ids:
            self._finish(req_id, end)
        self._step_index += 1
        if (self.flush_every_s is not None
                and time.monotonic() - self._last_flush >= self.flush_every_s):
            self.flush()

    __call__ = observe

    def _observe_item(self, req_id: str, num_new: int, computed: int, is_decode: bool,
                      start: float, end: float) -> None:
        track = self._track(req_id)
        if not track.scheduled:
            track.scheduled = True
            # NOTE: arrival unknown (request_arrived not called) -> queued since the
            # first step this writer saw.
            queued_from = track.arrival if track.arrival is not None else self._first_start
            if queued_from is not None and queued_from < start:
                self._events.append({"name": "queued", "ph": "X", "tid": track.tid,
                                     "start": queued_from, "end": start,
                                     "args": {"arrival_known": track.arrival is not None}})
        if not is_decode:      # the scheduler's decision (StepStats items)
            self._close_decode(track)
            self._events.append({"name": "prefill", "ph": "X", "tid": track.tid,
                                 "start": start, "end": end,
                                 "args": {"tokens": num_new, "computed_before": computed}})
            return
        if track.decode is not None and track.last_decode_step == self._step_index - 1:
            track.decode.end = end
            track.decode.args["tokens"] += num_new
            track.decode.args["steps"] += 1
        else:
            self._close_decode(track)
            track.decode = _Span("decode", start, end, {"tokens": num_new, "steps": 1,
                                                         "context_start": computed})
        track.last_decode_step = self._step_index

    def _finish(self, req_id: str, end: float) -> None:
        """Close the tracks of `req_id` and of its samples `{req_id}-{i}` (n > 1)."""
        for rid, track in self._tracks.items():
            if track.finished:
                continue
            if rid == req_id or (rid.startswith(req_id + "-")
                                 and rid[len(req_id) + 1:].isdigit()):
                self._close_decode(track)
                track.finished = True
                self._events.append({"name": "finished", "ph": "i", "s": "t",
                                     "tid": track.tid, "start": end, "end": end, "args": {}})

    def transfer(self, t: Transfer, backend: str) -> None:
        """A KV transfer ended: a span
        "kv transfer (backend)" on its request's track, from start (or, for blocks a
        prefill instance held, creation) to end, with bytes and status."""
        if self._closed:
            return
        start = t.created if backend == "held" else (t.started or t.created)
        end = t.finished or start
        if backend != "held" and t.seconds is not None:    # the copy itself
            end = start + t.seconds
        self._see(start)
        self._see(end)
        self._events.append({"name": f"kv transfer ({backend})", "ph": "X",
                             "tid": self._track(t.req_id).tid, "start": start, "end": end,
                             "args": {"bytes": t.nbytes, "status": t.status.value,
                                      "transfer_id": t.transfer_id, "error": t.error}})

    def _close_decode(self, track: _ReqTrack) -> None:
        if track.decode is not None:
            d = track.decode
            self._events.append({"name": d.name, "ph": "X", "tid": track.tid,
                                 "start": d.start, "end": d.end, "args": d.args})
            track.decode = None

    def _track(self, req_id: str) -> _ReqTrack:
        track = self._tracks.get(req_id)
        if track is None:
            track = self._tracks[req_id] = _ReqTrack(tid=len(self._tracks) + 1)
        return track

    def _see(self, t: float) -> None:
        self._t0 = t if self._t0 is None else min(self._t0, t)
        self._last_time = max(self._last_time, t)

    # -- output ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Return the trace as a Chrome trace JSON object (open decode spans included,
        without closing them)."""
        t0 = self._t0 or 0.0
        us = lambda t: round((t - t0) * 1e6, 3)   # noqa: E731
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "ts": 0, "pid": PID, "tid": STEPS_TID,
             "args": {"name": "duetserve"}},
            {"name": "thread_name", "ph": "M", "ts": 0, "pid": PID, "tid": STEPS_TID,
             "args": {"name": STEPS_TRACK}},
            {"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": PID, "tid": STEPS_TID,
             "args": {"sort_index": 0}}]
        for req_id, track in self._tracks.items():
            events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": PID,
                           "tid": track.tid, "args": {"name": f"req {req_id}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": PID,
                           "tid": track.tid, "args": {"sort_index": track.tid}})
        pending = list(self._events)
        for track in self._tracks.values():
            if track.decode is not None:
                d = track.decode
                pending.append({"name": d.name, "ph": "X", "tid": track.tid,
                                "start": d.start, "end": d.end, "args": dict(d.args)})
        for e in pending:
            out = {"name": e["name"], "ph": e["ph"], "ts": us(e["start"]), "pid": PID,
                   "tid": e["tid"], "args": e["args"]}
            if e["ph"] == "X":
                out["dur"] = max(0.0, round((e["end"] - e["start"]) * 1e6, 3))
            elif e["ph"] == "i":
                out["s"] = e.get("s", "t")
            events.append(out)
        meta = {"source": "duetserve", "t0_unix_s": t0, "num_steps": self._step_index,
                "num_requests": len(self._tracks)}
        if self.accountant is not None:
            meta["hardware"] = {"name": self.accountant.hardware.name,
                                "compute_dtype": self.accountant.compute_dtype,
                                "peak_flops": self.accountant.peak_flops,
                                "mem_bandwidth": self.accountant.mem_bandwidth}
            meta["summary"] = self.accountant.summary()
        meta.update(self.metadata)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}

    def flush(self) -> None:
        """Write the trace so far to `path` atomically (temp file, then rename)."""
        data = self.to_dict()
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, self.path)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Close every open span and write the file. Later steps are ignored. Idempotent."""
        if self._closed:
            return
        for track in self._tracks.values():
            self._close_decode(track)
        self.flush()
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["TraceWriter", "PID", "STEPS_TID", "STEPS_TRACK"]
