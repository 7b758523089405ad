"""One simulated engine instance: the real `core.scheduler.Scheduler`, unchanged, decides
every step; a cost model says how long the step takes; the update mimics the engine's:

    EngineCore.step()                        SimInstance
    ─────────────────                        ───────────
    so = scheduler.schedule()                begin_step(): so = scheduler.schedule()
    ro = runner.execute_model(so)                          duration = cost(shape of so)
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
from duetserve.request import Request
from duetserve.sim.cost import StepCostModel, StepShape, next_rewarm
from duetserve.sim.noise import NoiseSampler


class SimInstance:
    """Mutates: its scheduler and the Requests handed to it."""

    def __init__(self, index: int, config: SchedulerConfig, cost: StepCostModel,
                 role: str = "both", id_range: tuple[int, int] = (1000, 40000),
                 noise: NoiseSampler | None = None) -> None:
        self.index = index
        self.role = role                      # "both" | "prefill" | "decode"
        self.scheduler = Scheduler(config)
        self.cost = cost
        self.arrival_s = float(getattr(cost, "arrival_s", 0.0))
        self.flash_above = int(getattr(cost, "flash_above", 0))    # see sim/cost.py
        self.chunk_rows = int(getattr(cost, "chunk_rows", 0))
        self.decode_split = tuple(getattr(cost, "decode_split", (0, 0)))
        self.id_range = id_range
        self.noise = noise                    # the machine's step-time noise (sim/noise.py)
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
        # its start-up measurement): its next step is cold. When it last ran out of
        # requests (simulated s; 0: it started idle), None while it has some
        self.idle_since: float | None = 0.0
        self.rewarm: int | None = None   # the last step's rewarm count (next_rewarm)
        self._end = 0.0                  # when the step begun last ends

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

    def begin_step(self, now: float = 0.0) -> float | None:
        """Admit pending requests, schedule one step starting at simulated time `now` and
        return its duration in seconds (None: nothing to run, the instance goes idle): the
        cost model's time, times the noise sampler's factor when there is one. Mutates the
        scheduler, the noise sampler, `idle_since`, `rewarm` and the step's end."""
        num_added = len(self.pending)
        self.pending = []
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens == 0:
            self.busy = False
            self._so = None
            return None
        requests = self.scheduler.requests
        since, self.idle_since = self.idle_since, None
        shape = StepShape(cold=since is not None, flash_above=self.flash_above,
                          idle_s=0.0 if since is None else max(0.0, now - since),
                          chunk_rows=self.chunk_rows, decode_split=self.decode_split)
        sampled = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = requests[req_id]
            c = req.num_computed_tokens
            if c + n == req.num_tokens:
                sampled.append(req_id)
            loaded = self.kv_loaded.get(req_id)
            if loaded is not None:
                if loaded[1] != req.num_preemptions:        # preempted: KV recomputed
                    del self.kv_loaded[req_id]
                elif c < loaded[0]:
                    free = min(n, loaded[0] - c)
                    n, c = n - free, c + free
            if n > 0:
                shape.add(n, c, c + n == req.num_tokens)
            elif req_id in sampled:
                shape.num_logits += 1
        self.rewarm = next_rewarm(self.rewarm, shape.cold, shape.num_tokens,
                                  getattr(self.cost, "breakpoint", 0))
        shape.rewarm = self.rewarm or 0
        duration = self.cost.step_seconds(shape) + self.arrival_s * num_added
        if self.noise is not None:
            duration *= self.noise.factor(now)
        self._so, self._sampled = so, sampled
        self._end = now + duration
        self.busy = True
        self.num_steps += 1
        self.busy_seconds += duration
        self.num_step_tokens += shape.num_tokens
        return duration

    def end_step(self) -> list[Request]:
        """Apply the step begun by begin_step: one synthetic token per sampled slice, then
        the scheduler's update (counters, token stops, freeing). Returns the requests that
        got a token or finished, in schedule order. Mutates the scheduler and
        `idle_since`; the instance is idle (`busy` False) until the next begin_step."""
        so = self._so
        assert so is not None, "end_step without begin_step"
        ids = output_token_ids(self._next_token, len(self._sampled), self.id_range)
        self._next_token += len(ids)
        ro = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                               sampled_token_ids={r: [t] for r, t in zip(self._sampled, ids)})
        touched = self.scheduler.update_from_output(so, ro)
        for req in touched:
            if req.is_finished:
                self.kv_loaded.pop(req.req_id, None)
        self.idle_since = None if self.scheduler.has_unfinished_requests() else self._end
        self._so, self._sampled = None, []
        self.busy = False          # between steps until the caller begins the next one
        return touched
