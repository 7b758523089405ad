"""One simulated engine instance: the real `core.scheduler.Scheduler`, unchanged, decides
every step; the step-time model (core/step_time.py) says how long the step takes; the
update mimics the engine's:

    EngineCore.step()                        SimInstance
    ─────────────────                        ───────────
    so = scheduler.schedule()                begin_step(): so = scheduler.schedule()
    ro = runner.execute_model(so)                          duration = seconds(shape of so)
                                             ... simulated time passes ...
    scheduler.update_from_output(so, ro)     end_step():   ro = one synthetic token per
                                                           slice that reaches the end of its
                                                           known tokens; update_from_output

Requests are sampled with `ignore_eos` and max_tokens = the workload's output length, so
they finish exactly where the engine's would (the scheduler's own max_tokens stop).
Requests that arrive while a step runs wait in `pending` and are added before the next
schedule(), as the engine's loop adds them between steps.

Disaggregation: a decode instance receives requests whose prompt KV arrived by transfer.
The scheduler (unchanged) still schedules those positions as a first slice; the instance
counts them as free (`kv_loaded`), so that slice costs what a decode at that context
costs. After a preemption the KV is gone and is recomputed at full cost.
"""
from __future__ import annotations

from duetserve.bench.token_workload import output_token_ids
from duetserve.config import SchedulerConfig
from duetserve.core.scheduler import Scheduler
from duetserve.errors import RequestError
from duetserve.outputs import ModelRunnerOutput, SchedulerOutput
from duetserve.core.step_time import StepPricer, StepShape
from duetserve.request import Request


class SimInstance:
    """Mutates: its scheduler and the Requests handed to it."""

    def __init__(self, index: int, config: SchedulerConfig, step_time: StepPricer,
                 role: str = "both", id_range: tuple[int, int] = (1000, 40000),
                 arrival_s: float = 0.0) -> None:
        """`arrival_s`: the engine's cost of adding one request (validation, detokenizer
        set-up), paid by the step after its arrival."""
        self.index = index
        self.role = role                      # "both" | "prefill" | "decode"
        self.scheduler = Scheduler(config)
        self.step_time = step_time
        self.arrival_s = arrival_s
        self.id_range = id_range
        self.pending: list[Request] = []
        self.busy = False
        # req_id -> (tokens whose KV arrived by transfer, num_preemptions when it arrived)
        self.kv_loaded: dict[str, tuple[int, int]] = {}
        self._so: SchedulerOutput | None = None
        self._sampled: list[str] = []
        self._next_token = index * 7_000_003
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.num_step_tokens = 0
        # the engine releases freed heap memory when it runs out of requests (and after
        # its start-up measurement): its next step is cold (StepShape.cold)
        self.idle = True

    @property
    def num_outstanding(self) -> int:
        """Requests queued here and not finished (the least-loaded router's measure)."""
        return len(self.scheduler.requests) + len(self.pending)

    def submit(self, request: Request, kv_loaded_tokens: int = 0) -> None:
        """Queue a request; it joins the scheduler at the next step boundary. Mutates
        pending, kv_loaded."""
        if kv_loaded_tokens:
            self.kv_loaded[request.req_id] = (kv_loaded_tokens, request.num_preemptions)
        self.pending.append(request)

    def admit_pending(self) -> list[tuple[Request, str]]:
        """Add the pending requests to the scheduler. Returns (request, error) for those it
        refused (prompt too long for the context or the KV cache). Mutates pending."""
        refused = []
        for request in self.pending:
            try:
                self.scheduler.add_request(request)
            except RequestError as e:
                self.kv_loaded.pop(request.req_id, None)
                refused.append((request, str(e)))
        return refused

    def begin_step(self, now: float | None = None) -> float | None:
        """Admit pending requests, schedule one step at simulated time `now` (what the
        goodput-first scheduler plans with) and
        return its duration in seconds (None: nothing to run, the instance goes idle): the
        step-time model's price of the step's shape, plus the arrivals' cost. Mutates the
        scheduler and `idle`."""
        num_added = len(self.pending)
        self.pending = []
        so = self.scheduler.schedule(now)
        if so.total_num_scheduled_tokens == 0:
            self.busy = False
            self._so = None
            return None
        shape = self._shape(so)
        duration = self.step_time.seconds(shape) + self.arrival_s * num_added
        self.idle = False
        self._so = so
        self._sampled = [r for r in so.num_scheduled_tokens if r in so.sampled_req_ids]
        self.busy = True
        self.num_steps += 1
        self.busy_seconds += duration
        self.num_step_tokens += shape.num_rows
        return duration

    def _shape(self, so: SchedulerOutput) -> StepShape:
        """The step's shape, the positions whose KV arrived by transfer counted as free.
        Mutates kv_loaded (a preempted request's transferred KV is gone)."""
        shape = StepShape(self.step_time.layout, cold=self.idle)
        requests = self.scheduler.requests
        for s in so.slices():
            n, c, req = s.num_new_tokens, s.num_computed_before, requests[s.req_id]
            loaded = self.kv_loaded.get(s.req_id)
            if loaded is not None:
                if loaded[1] != req.num_preemptions:        # preempted: KV recomputed
                    del self.kv_loaded[s.req_id]
                elif c < loaded[0]:
                    free = min(n, loaded[0] - c)
                    n, c = n - free, c + free
            if n > 0:
                shape.add(n, c, s.num_logits)
            else:
                shape.num_logits += s.num_logits
        return shape

    def end_step(self, now: float | None = None) -> list[Request]:
        """Apply the step begun by begin_step, ending at simulated time `now`: one
        synthetic token per sampled slice, then the scheduler's update (counters, token
        stops, freeing). Returns the requests that got a token or finished, in schedule
        order. Mutates the scheduler and `idle`; the instance is between steps (`busy`
        False) until the next begin_step."""
        so = self._so
        assert so is not None, "end_step without begin_step"
        ids = output_token_ids(self._next_token, len(self._sampled), self.id_range)
        self._next_token += len(ids)
        ro = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                               sampled_token_ids={r: [t] for r, t in zip(self._sampled, ids)})
        touched = self.scheduler.update_from_output(so, ro, now)
        for req in touched:
            if req.is_finished:
                self.kv_loaded.pop(req.req_id, None)
        self.idle = not self.scheduler.has_unfinished_requests()
        self._so, self._sampled = None, []
        self.busy = False          # between steps until the caller begins the next one
        return touched
