"""The discrete-event simulation: conversations arrive, routers place their turns on
instances, each instance's real Scheduler runs steps whose durations come from the
step-time model (core/step_time.py), and every token is stamped with simulated time.

    events (time-ordered heap)            effect
    ──────────────────────────            ──────
    send(conv, turn)      a turn is sent (arrival, next turn, concurrency slot)
                          -> router -> instance.submit; an idle instance is kicked
    kick(instance)        same instant, after every send of that instant: begin a step
    step_end(instance)    end_step -> stamp tokens; finished turns send their next turn;
                          P/D: a finished prefill starts a KV transfer; kick the instance
                          (so the next turns sent at this instant join its next step)
    kv_arrived(request)   P/D: router -> decode instance.submit (kv_loaded = the prompt)

Latencies follow `duet bench serve` (bench_metrics.py): a token's time is the end of the
step that produced it, measured from the turn's send time. With P/D the first token comes
from the prefill instance (TTFT ends there) and the decode instance continues from it.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

from duetserve.bench.bench_metrics import RequestRecord, TurnInFlight, compute_latencies
from duetserve.bench.token_workload import TokenConversation
from duetserve.config import SchedulerConfig
from duetserve.core.step_time import StepPricer
from duetserve.request import Request
from duetserve.sampling_params import SamplingParams
from duetserve.sim.cluster import ClusterSpec, Link, Router
from duetserve.sim.instance import SimInstance

_SEND, _KICK, _STEP_END, _KV_ARRIVED = 0, 1, 2, 3


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float                 # simulated seconds from start to the last token
    wall_s: float                     # seconds the simulation itself took
    instances: list[dict]             # per instance: role, steps, busy seconds, ...
    kv_transfer: dict | None = None   # P/D: bytes, link busy seconds


class Simulation:
    """One run of a workload on a cluster. Build, then `run()` once."""

    def __init__(self, convs: list[TokenConversation], offsets: list[float],
                 cluster: ClusterSpec, config: SchedulerConfig, step_time: StepPricer,
                 max_concurrency: int | None = None,
                 id_range: tuple[int, int] = (1000, 40000),
                 decode_config: SchedulerConfig | None = None,
                 arrival_s: float = 0.0) -> None:
        self.convs, self.offsets = convs, [float(x) for x in offsets]
        self.cluster = cluster
        self.max_len = config.max_model_len

        def instance(i: int, cfg: SchedulerConfig, role: str) -> SimInstance:
            return SimInstance(i, cfg, step_time, role, id_range, arrival_s)
        if cluster.disaggregated:
            self.prefill = [instance(i, config, "prefill") for i in range(cluster.num_prefill)]
            self.decode = [instance(cluster.num_prefill + i, decode_config or config, "decode")
                           for i in range(cluster.num_decode)]
            self.links = [Link(cluster.bandwidth, cluster.latency) for _ in self.prefill]
        else:
            self.prefill = [instance(i, config, "both") for i in range(cluster.num_instances)]
            self.decode, self.links = [], []
        self.router = Router(cluster.router)
        self.decode_router = Router(cluster.router)
        self.max_concurrency = max_concurrency
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._turns: dict[str, TurnInFlight] = {}
        self._waiting_sends: list[tuple[int, int, list[int]]] = []   # concurrency queue
        self._in_flight = 0
        self.records: list[RequestRecord] = []
        self.now = 0.0

    # -- events -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        """Simulate to the last token. Mutates everything it owns; call once."""
        wall0 = time.perf_counter()
        for cid, t in enumerate(self.offsets):
            self._push(t, _SEND, (cid, 0, []))
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            self.now = t
            if kind == _SEND:
                self._on_send(*payload)
            elif kind == _KICK:
                if not payload.busy:
                    self._begin(payload)
            elif kind == _STEP_END:
                self._on_step_end(payload)
            else:
                self._on_kv_arrived(*payload)
        self.records.sort(key=lambda r: (r.conversation_id, r.turn))
        return SimResult(self.records, self.now, time.perf_counter() - wall0,
                         [self._instance_stats(i) for i in self.prefill + self.decode],
                         self._transfer_stats())

    def _on_send(self, cid: int, turn: int, history: list[int]) -> None:
        if self.max_concurrency and self._in_flight >= self.max_concurrency:
            self._waiting_sends.append((cid, turn, history))
            return
        self._in_flight += 1
        spec = self.convs[cid][turn]
        prompt = history + list(spec.new_token_ids)
        req_id = f"{cid}-{turn}"
        rec = RequestRecord(req_id=req_id, send_time=self.now, expected_output_len=spec.output_len,
                            prompt_tokens=len(prompt), token_source="sim",
                            conversation_id=cid, turn=turn)
        state = TurnInFlight(cid, turn, prompt, rec, self.now)
        self._turns[req_id] = state
        if len(prompt) + spec.output_len > self.max_len:
            self._fail(state, f"prompt ({len(prompt)} tokens) + max_tokens "
                              f"({spec.output_len}) exceeds max_model_len {self.max_len}")
            return
        first_leg = 1 if self.cluster.disaggregated else spec.output_len
        self._submit(self.router.pick(self.prefill), self._request(req_id, prompt, first_leg))

    def _request(self, req_id: str, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return Request(req_id, prompt, params, arrival_time=self.now)

    def _submit(self, inst: SimInstance, request: Request, kv_loaded: int = 0) -> None:
        inst.submit(request, kv_loaded)
        if not inst.busy:
            self._push(self.now, _KICK, inst)

    def _begin(self, inst: SimInstance) -> None:
        for request, error in inst.admit_pending():
            self._fail(self._turns[request.req_id], error)
        duration = inst.begin_step(self.now)
        if duration is not None:
            self._push(self.now + duration, _STEP_END, inst)

    def _on_step_end(self, inst: SimInstance) -> None:
        for req in inst.end_step(self.now):
            state = self._turns.get(req.req_id)
            if state is None:
                continue
            state.chunk_times.append(self.now - state.send)   # touched = one new token
            if not req.is_finished:
                continue
            if inst.role == "prefill" and state.record.expected_output_len > 1:
                self._start_transfer(inst, state, req)
            else:
                self._finish(state, req)
        # the next step begins after the sends of this instant (a finished turn's next
        # turn), as the replay loop adds them before stepping again: a kick, not _begin
        self._push(self.now, _KICK, inst)

    # -- disaggregation -----------------------------------------------------------------
    def _start_transfer(self, inst: SimInstance, state: TurnInFlight, req: Request) -> None:
        link = self.links[inst.index]
        num_bytes = self.cluster.kv_bytes_per_token * len(state.prompt)
        arrive = link.transfer(self.now, num_bytes)
        self._push(arrive, _KV_ARRIVED, (state, req.output_token_ids[0]))

    def _on_kv_arrived(self, state: TurnInFlight, first_token: int) -> None:
        rest = state.record.expected_output_len - 1
        request = self._request(state.record.req_id, state.prompt + [first_token], rest)
        self._submit(self.decode_router.pick(self.decode), request, len(state.prompt))

    # -- outcomes -----------------------------------------------------------------------
    def _finish(self, state: TurnInFlight, req: Request) -> None:
        rec = state.record
        rec.e2e = self.now - state.send
        rec.output_tokens = len(state.chunk_times)
        rec.ttft, rec.tpot, rec.itl = compute_latencies(
            state.chunk_times, [1] * len(state.chunk_times), rec.e2e, rec.output_tokens)
        rec.success = True
        self._close(state, state.prompt + self._reply(state, req))

    def _reply(self, state: TurnInFlight, req: Request) -> list[int]:
        """The reply tokens as the next turn resends them (P/D: the decode request's
        prompt already ends with the first token)."""
        return req.all_token_ids[len(state.prompt):]

    def _fail(self, state: TurnInFlight, error: str) -> None:
        state.record.error = error
        self._close(state, None)

    def _close(self, state: TurnInFlight, history: list[int] | None) -> None:
        """Record the turn, send the next turn of its conversation (not after a failure,
        as `duet bench serve` skips them), free its concurrency slot."""
        self.records.append(state.record)
        del self._turns[state.record.req_id]
        self._in_flight -= 1
        conv = self.convs[state.conv]
        for turn in range(state.turn + 1, len(conv)):
            if history is not None:
                self._push(self.now, _SEND, (state.conv, turn, history))
                break
            skipped = RequestRecord(req_id=f"{state.conv}-{turn}", conversation_id=state.conv,
                                    turn=turn, expected_output_len=conv[turn].output_len,
                                    error="skipped: an earlier turn of this conversation "
                                          "failed", token_source="sim")
            self.records.append(skipped)
        if self._waiting_sends:
            self._push(self.now, _SEND, self._waiting_sends.pop(0))

    def _instance_stats(self, inst: SimInstance) -> dict:
        st = inst.scheduler.make_stats()
        return {"index": inst.index, "role": inst.role, "num_steps": inst.num_steps,
                "busy_s": inst.busy_seconds, "tokens": inst.num_step_tokens,
                "num_preemptions": st.num_preemptions,
                "prefix_cache_hit_rate": (st.prefix_cache_hits / st.prefix_cache_queries
                                          if st.prefix_cache_queries else 0.0)}

    def _transfer_stats(self) -> dict | None:
        if not self.links:
            return None
        return {"bytes": sum(lk.bytes_sent for lk in self.links),
                "link_busy_s": [lk.busy_seconds for lk in self.links],
                "bandwidth": self.cluster.bandwidth}
