"""Replay a `duet bench serve` workload on an in-process engine, on the wall clock.

The measured side of the simulator's fidelity check (benchmarks/sim_fidelity.py): the same
token-level conversations (bench/token_workload.py) and arrival schedule the simulator
uses, sent to a real EngineCore by a loop that does what the serving engine thread does:

    loop:  add every turn whose send time has come (and a concurrency slot is free)
           step the engine (if it has work; else sleep until the next send)
           stamp each new token with the time the step returned; a finished turn sends
           the conversation's next turn (prompt = previous prompt + reply + new message)

Records and latencies are bench_metrics' (send time = the scheduled arrival), so the result
is summarized and plotted exactly like `duet bench serve`'s. No HTTP: this measures the
engine, not the server in front of it. Every step's slices and duration are kept, so the
engine can check a cost model's prediction step by step.
"""
from __future__ import annotations

import heapq
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from duetserve.bench.bench_metrics import RequestRecord, TurnInFlight, compute_latencies
from duetserve.bench.cpu_meter import ForeignCpu
from duetserve.bench.token_workload import TokenConversation
from duetserve.errors import EngineOverloadedError
from duetserve.outputs import OutputAccumulator


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    duration_s: float
    # per step: (start s from run start, seconds,
    #            [(num_new, num_computed_before, num_logits)])
    steps: list[tuple[float, float, list[tuple[int, int, int]]]] = field(default_factory=list)
    foreign_cpu_s: float | None = None    # CPU seconds other processes used during the run
    steal_s: float | None = None          # CPU seconds the hypervisor took meanwhile
    # per step (same order as steps): minor page faults this process took during it, and
    # whether it was cold (the engine had no requests after the step before, so it gave
    # its freed heap back: core/step_time.py cold_step): 0.0 if not, else the seconds it
    # sat idle
    step_faults: list[int] = field(default_factory=list)
    step_cold: list[float] = field(default_factory=list)
    # this process over the run: user and system CPU seconds, minor page faults
    rusage: dict[str, float] = field(default_factory=dict)


def cold_record(idle_since: float | None, start: float) -> float:
    """A step's recorded cold value: 0.0 for a warm step (the engine had requests,
    `idle_since` None), else the seconds it sat idle before `start`, floored just above 0
    so a cold step never reads as warm."""
    return 0.0 if idle_since is None else max(start - idle_since, 1e-9)


def replay(engine: Any, convs: list[TokenConversation], offsets: list[float],
           max_concurrency: int | None = None) -> ReplayResult:
    """Run the workload to completion on `engine` (idle on entry). Mutates the engine."""
    from duetserve.sampling_params import SamplingParams
    heap = [(float(t), cid, 0, []) for cid, t in enumerate(offsets)]
    heapq.heapify(heap)
    live: dict[str, TurnInFlight] = {}
    acc = OutputAccumulator()
    waiting: list[tuple[float, int, int, list[int]]] = []
    records: list[RequestRecord] = []
    steps: list[tuple[float, float, list[tuple[int, int, int]]]] = []
    meter = ForeignCpu()
    step_faults: list[int] = []
    step_cold: list[float] = []
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    # when the engine last ran out of requests (a new engine released its start-up
    # memory: idle from the start), None while it has some
    idle_since: float | None = t0

    def send(cid: int, turn: int, history: list[int], now: float) -> None:
        spec = convs[cid][turn]
        prompt = history + list(spec.new_token_ids)
        req_id = f"{cid}-{turn}"
        rec = RequestRecord(req_id=req_id, send_time=now, expected_output_len=spec.output_len,
                            prompt_tokens=len(prompt), token_source="engine",
                            conversation_id=cid, turn=turn)
        params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
        try:
            engine.add_request(req_id, prompt, params)
        except (ValueError, EngineOverloadedError) as e:   # refused: recorded, never fatal
            rec.error = str(e)
            records.append(rec)
            return
        live[req_id] = TurnInFlight(cid, turn, prompt, rec, now)

    while heap or waiting or live:
        now = time.perf_counter() - t0
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)
            if max_concurrency and len(live) >= max_concurrency:
                waiting.append(item)
            else:
                send(item[1], item[2], item[3], item[0])
        while waiting and (not max_concurrency or len(live) < max_concurrency):
            _, cid, turn, history = waiting.pop(0)
            send(cid, turn, history, now)
        if not live:
            if heap:
                time.sleep(max(0.0, heap[0][0] - (time.perf_counter() - t0)))
            continue
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        outputs = engine.step_deltas()
        end = time.perf_counter()
        items = engine.last_step.items
        if items:
            step_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            step_cold.append(cold_record(idle_since, start))
            idle_since = None if engine.has_unfinished_requests() else end
            steps.append((start - t0, end - start, [
                (s.num_new_tokens, s.num_computed_before, s.num_logits) for s in items]))
        t = end - t0
        for out in outputs:
            st = live.get(out.request_id)
            if st is None:
                continue
            out = acc.add(out)          # the cumulative view, for the next turn's prompt
            n = len(out.outputs[0].token_ids)
            for _ in range(n - st.num_tokens):
                st.chunk_times.append(t - st.send)
            st.num_tokens = n
            if out.finished:
                rec = st.record
                rec.e2e = t - st.send
                rec.output_tokens = n
                rec.ttft, rec.tpot, rec.itl = compute_latencies(
                    st.chunk_times, [1] * len(st.chunk_times), rec.e2e, n)
                rec.success = out.error is None
                rec.error = out.error or ""
                records.append(rec)
                del live[out.request_id]
                if st.turn + 1 < len(convs[st.conv]):
                    reply = out.outputs[0].token_ids
                    heapq.heappush(heap, (t, st.conv, st.turn + 1, st.prompt + reply))
    duration = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    usage = {"user_s": ru.ru_utime - ru0.ru_utime, "sys_s": ru.ru_stime - ru0.ru_stime,
             "minor_faults": ru.ru_minflt - ru0.ru_minflt}
    records.sort(key=lambda r: (r.conversation_id, r.turn))
    return ReplayResult(records, duration, steps, meter.foreign_s(), meter.steal_s(),
                        step_faults, step_cold, usage)
