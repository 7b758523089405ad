"""LiveRecorder (the dashboard's ring of recent steps, requests and transfers): records
steps only while watched, O(1) per step, `since` cursors, bounded rings, decode rows
under speculation, request totals and percentiles, transfer counts."""
from __future__ import annotations

import time

import pytest

from duetserve.kv_transfer.state import Transfer, TransferStatus
from duetserve.metrics.live import (STEP_FIELDS, LiveRecorder, latency_summary,
                                    percentile)
from duetserve.metrics.step_accounting import StepAccount
from duetserve.outputs import (CompletionOutput, RequestMetrics, RequestOutput,
                               ScheduledSlice, SpecDecodeStats, StepStats)


class NoIterList(list):
    """A step's items that may be counted but not walked: observe_step must be O(1)."""

    def __iter__(self):
        raise AssertionError("observe_step iterated the step's items")


def step(t: float, prefill: int = 0, decode: int = 1, rows: int = 1, **kw) -> StepStats:
    items = NoIterList(ScheduledSlice(f"r{i}", 1, 5, True) for i in range(rows))
    return StepStats(start_time=t, step_seconds=0.01, num_prefill_tokens=prefill,
                     num_decode_tokens=decode, items=items, **kw)


def field(row: list, name: str):
    return row[STEP_FIELDS.index(name)]


def test_steps_are_recorded_only_while_watched() -> None:
    rec = LiveRecorder(watch_s=30.0)
    now = time.time()
    rec.observe_step(step(now, num_running=3))
    assert rec.steps_since(0) == ([], False, 0)
    assert rec.latest.num_running == 3              # the state is always current
    rec.watch(now)
    assert rec.watching
    rec.observe_step(step(now + 1.0, prefill=7, decode=2, rows=3, kv_usage=0.25))
    rec.observe_step(step(now + 31.0))              # past the watch: not recorded
    rows, dropped, seq = rec.steps_since(0)
    assert (len(rows), dropped, seq) == (1, False, 1)
    assert field(rows[0], "prefill_tokens") == 7 and field(rows[0], "rows") == 3
    assert field(rows[0], "decode_rows") == 2 and field(rows[0], "kv_usage") == 0.25


def test_since_cursor_and_bounded_ring() -> None:
    rec = LiveRecorder(step_capacity=4)
    now = time.time()
    rec.watch(now)
    for i in range(6):
        rec.observe_step(step(now + i * 0.01))
    rows, dropped, seq = rec.steps_since(0)
    assert seq == 6 and dropped                      # seq 1 and 2 fell out of the ring
    assert [field(r, "seq") for r in rows] == [3, 4, 5, 6]
    rows, dropped, seq = rec.steps_since(4)
    assert [field(r, "seq") for r in rows] == [5, 6] and not dropped
    assert rec.steps_since(6)[0] == [] and rec.steps_since(99)[0] == []


def test_account_fields_and_decode_rows_under_speculation() -> None:
    rec = LiveRecorder()
    now = time.time()
    rec.watch(now)
    acc = StepAccount(phase="decode", start_time=now, seconds=0.01, num_prefill_tokens=0,
                      num_decode_tokens=8, num_logits=8, flops=4000, bytes=1000.0,
                      flops_per_s=4e5, bytes_per_s=1e5, mfu=0.1, mbu=0.2)
    # 2 requests verify 3 drafts each: 8 decode tokens in 2 rows.
    rec.observe_step(step(now, decode=2, rows=2, spec=SpecDecodeStats(0, 0, 0, [])))
    st = step(now + 0.1, decode=8, rows=2, spec=SpecDecodeStats(2, 6, 4, [2, 1, 1]))
    st.account = acc
    rec.observe_step(st)
    rows = rec.steps_since(1)[0]
    assert field(rows[0], "decode_rows") == 2 and field(rows[0], "decode_tokens") == 8
    assert field(rows[0], "ai") == 4.0 and field(rows[0], "mbu") == 0.2
    assert field(rows[0], "spec_draft_tokens") == 6 and field(rows[0], "spec_accepted") == 4
    assert rec.state()["spec"] == {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 4,
                                   "accepted_per_pos": [2, 1, 1]}


def _finished(ttft: float, tpot_s: float, n: int, prompt: int = 3) -> RequestOutput:
    t0 = time.time() - 5.0
    m = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.1,
                       first_token_time=t0 + ttft, num_generation_tokens=n,
                       last_token_time=t0 + ttft + tpot_s * (n - 1),
                       finished_time=t0 + ttft + tpot_s * (n - 1))
    return RequestOutput("r", "p", list(range(prompt)),
                         [CompletionOutput(0, "x", [1] * n, finish_reason="length")], True, m)


def test_requests_totals_and_percentiles() -> None:
    rec = LiveRecorder()
    for ttft in (0.1, 0.2, 0.3, 0.4, 0.5):
        rec.observe_finished(_finished(ttft, 0.05, 11), "length")
    rec.observe_finished(None, "abort")
    s = rec.request_summary(60.0, time.time())
    assert s["finished"] == 6 and s["finished_by_reason"] == {"length": 5, "abort": 1}
    assert s["generation_tokens"] == 55 and s["prompt_tokens"] == 15
    assert s["ttft"]["n"] == 5 and s["ttft"]["p50"] == pytest.approx(0.3)
    assert s["tpot"]["p90"] == pytest.approx(0.05)
    assert rec.request_summary(1.0, time.time())["ttft"]["n"] == 0   # ended 5 s ago


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert latency_summary([None, 2.0, 1.0])["mean"] == 1.5


def test_transfers_counted_like_prometheus() -> None:
    rec = LiveRecorder()
    now = time.time()
    done = Transfer("t1", "r1", 0.0, TransferStatus.DONE, started=now - 0.5, finished=now,
                    nbytes=1000, seconds=0.25)
    failed = Transfer("t2", "r2", 0.0, TransferStatus.FAILED, finished=now)
    rec.observe_transfer(done, "shm")
    rec.observe_transfer(failed, "shm")
    rec.observe_transfer(done, "held")
    s = rec.transfer_summary(60.0, now)
    assert s["counts"] == {"shm:done": 1, "shm:failed": 1, "held:done": 1}
    assert s["bytes"] == 1000 and s["seconds"] == 0.25 and len(s["recent"]) == 1


def test_snapshot_watches_and_is_json_ready() -> None:
    import json
    rec = LiveRecorder(watch_s=5.0)
    assert not rec.watching
    snap = rec.snapshot(0)
    assert rec.watching and snap["seq"] == 0 and snap["fields"] == list(STEP_FIELDS)
    rec.observe_step(step(time.time(), prefill=4, decode=0))
    snap = rec.snapshot(0)
    assert len(snap["steps"]) == 1 and snap["recent"]["steps"] == 1
    assert rec.snapshot(1)["steps"] == [] and rec.snapshot(0, with_steps=False)["steps"] == []
    json.dumps(snap)
    with pytest.raises(ValueError):
        LiveRecorder(step_capacity=0)
