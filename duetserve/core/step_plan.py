"""StepPlan: the work one Scheduler.schedule() call assembles, and the SchedulerOutput
made from it (where the phase of every slice is decided, once).

The scheduler adds a slice per request it schedules (charging the step's token budget)
and removes it again when it preempts that request in the same step; `to_output` then
turns the plan into the runner's diff: a NewRequestData for a request the runner does not
hold, a CachedRequestData (new block ids only) for one it does.
"""
from __future__ import annotations

from typing import NamedTuple

from duetserve.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from duetserve.request import Request


class PlannedSlice(NamedTuple):
    request: Request
    num_new: int              # tokens computed this step, drafts included
    block_ids: list[int]      # the whole table (is_new) or the blocks added this step
    is_new: bool              # the runner learns the request in this step
    drafts: list[int]         # drafts verified at the end of the slice
    propose: int              # drafts the runner proposes after the step


class StepPlan:
    """The work being assembled by one schedule() call. Mutated only through its
    methods and its spec fields (set by core/spec_schedule.plan_spec)."""

    __slots__ = ("budget", "full", "idle", "scheduled", "charged", "preempted", "spec_plan",
                 "spec_open", "spec_next_rows")

    def __init__(self, budget: int, idle: bool = False) -> None:
        self.budget = budget                    # left
        self.full = budget                      # the step's whole budget
        self.idle = idle                        # no decode running (no gap to protect)
        self.charged: dict[str, int] = {}      # req_id -> budget taken (>= its tokens)
        self.scheduled: dict[str, PlannedSlice] = {}   # in schedule order
        self.preempted: set[str] = set()
        self.spec_plan: dict[str, int] = {}     # drafts per request (speculative decoding)
        self.spec_open = False                  # the step may propose drafts
        self.spec_next_rows = 1                 # the next step's rows without drafts

    def add(self, request: Request, num_new: int, block_ids: list[int], is_new: bool,
            drafts: list[int] = (), propose: int = 0,  # type: ignore[assignment]
            charge: int | None = None) -> None:
        """Schedule `num_new` tokens of `request`, taking `charge` (default num_new)
        from the budget. Mutates the plan only."""
        self.scheduled[request.req_id] = PlannedSlice(request, num_new, block_ids, is_new,
                                                      list(drafts), propose)
        self.charged[request.req_id] = num_new if charge is None else charge
        self.budget -= self.charged[request.req_id]

    def widen(self, extra: int) -> None:
        """Leave `extra` more tokens for the slices still to be added (not counted in
        `full`, the step's own budget, which sizes prefill chunks). Mutates the plan."""
        self.budget += extra

    def remove(self, request: Request) -> None:
        """Undo `add` for `request` (preempted in this step), giving its charge back;
        nothing when it was not scheduled. Mutates the plan only."""
        if self.scheduled.pop(request.req_id, None) is not None:
            self.budget += self.charged.pop(request.req_id)

    def to_output(self, finished_req_ids: set[str]) -> SchedulerOutput:
        """The SchedulerOutput of this plan (it takes `finished_req_ids` as its own).
        Copies each new request's token ids (the runner keeps them); mutates nothing."""
        out = SchedulerOutput(finished_req_ids=finished_req_ids,
                              preempted_req_ids=self.preempted)
        num_prefill = num_decode = 0
        for req_id, (request, num_new, block_ids, is_new, drafts, propose) in \
                self.scheduled.items():
            if is_new:
                out.scheduled_new_reqs.append(NewRequestData(
                    req_id=req_id, token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params, block_ids=block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                    lora_request=request.lora_request))
            else:
                out.scheduled_cached_reqs.append(CachedRequestData(
                    req_id=req_id, new_block_ids=block_ids,
                    num_computed_tokens=request.num_computed_tokens))
            out.num_scheduled_tokens[req_id] = num_new
            if drafts:
                out.scheduled_spec_token_ids[req_id] = list(drafts)
            if request.num_computed_tokens + num_new - len(drafts) == request.num_tokens:
                out.sampled_req_ids.add(req_id)
            if propose:
                out.num_drafts_to_propose[req_id] = propose
            # NOTE: the one place the phase of a slice is decided; everything downstream
            # (StepStats, metrics, traces, benchmarks) reads it from the SchedulerOutput.
            # A verify slice (the decode's token plus its drafts) is a decode of k+1 rows.
            if drafts:
                num_decode += num_new
                out.decode_req_ids.add(req_id)
            elif (num_new == 1 and request.num_computed_tokens >= request.num_prompt_tokens
                    and request.num_computed_tokens + 1 == request.num_tokens):
                num_decode += 1
                out.decode_req_ids.add(req_id)
            else:
                num_prefill += num_new
        out.total_num_scheduled_tokens = num_prefill + num_decode
        out.num_prefill_tokens, out.num_decode_tokens = num_prefill, num_decode
        return out
