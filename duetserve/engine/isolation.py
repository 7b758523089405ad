"""Run a step so that a request whose processing raises fails alone.

    execute(so) ──ok──> ModelRunnerOutput
        │ raises
        v
    bisect the step's requests (schedule order kept): run each group as its own step,
    re-sending every member as NewRequestData rebuilt from the scheduler (the runner's
    copy may be half-updated by the failed attempt); a group that raises is split in two;
    a single request that raises is a culprit.

Every group that runs without raising is a legitimate smaller step: its outputs are
merged into the step's ModelRunnerOutput, so the other requests lose nothing (KV writes
of the failed attempt are rewritten with the same values). Requests that depend on a
culprit are failed with it:
  - those holding one of the blocks the culprit was filling in this step (a same-step
    prefix hit on blocks registered before they were computed: their KV is not there);
  - those scoring prompt logprobs in the middle of their prompt (the runner accumulates
    them across chunks and a re-sent request starts that list afresh).
A failure that is not any one request's (every group raises) ends after MAX_ATTEMPTS
executions with the remaining requests failed: bounded work, never an endless retry.
"""
from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable

from duetserve.core.scheduler import Scheduler
from duetserve.errors import RequestError
from duetserve.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput

log = logging.getLogger("duetserve")

MAX_ATTEMPTS = 32
# Why a request failed: the error's text, or the RequestError itself when the request's
# own input made it fail (the server then answers 400 naming its field).
Failure = str | RequestError
StepResult = tuple[ModelRunnerOutput, dict[str, Failure]]


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _failure(e: BaseException) -> Failure:
    """What a culprit failed with: the RequestError itself (its request's own input made
    it fail, e.g. a constraint no token can continue), else the exception's text."""
    return e if isinstance(e, RequestError) else _error_text(e)


def _merge(into: ModelRunnerOutput, part: ModelRunnerOutput) -> None:
    into.req_ids.extend(part.req_ids)
    into.sampled_token_ids.update(part.sampled_token_ids)
    into.spec_token_ids.update(part.spec_token_ids)
    if part.logprobs:
        into.logprobs = {**(into.logprobs or {}), **part.logprobs}
    if part.prompt_logprobs:
        into.prompt_logprobs = {**(into.prompt_logprobs or {}), **part.prompt_logprobs}


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # duetserve/


def _where(e: BaseException) -> str:
    """Where `e` was raised: the innermost frame in duetserve's own code (a kernel's error
    text rarely says which caller passed it what)."""
    ours = [f for f in traceback.extract_tb(e.__traceback__)
            if f.filename.startswith(_PACKAGE + os.sep)]
    if not ours:
        return "raised outside duetserve"
    f = ours[-1]
    return f"raised in {f.name} at {os.path.relpath(f.filename, _PACKAGE)}:{f.lineno}"


class IsolatedExecutor:
    """execute(so) -> (ModelRunnerOutput, {req_id: error text or RequestError}) for one
    step."""

    def __init__(self, execute: Callable[[SchedulerOutput], ModelRunnerOutput],
                 scheduler: Scheduler) -> None:
        self._execute = execute
        self.scheduler = scheduler
        self.num_isolations = 0          # steps that needed the bisection

    def execute(self, so: SchedulerOutput) -> StepResult:
        try:
            return self._execute(so), {}
        except Exception as e:  # noqa: BLE001 - find whose it is
            if not so.num_scheduled_tokens:
                raise
            self.num_isolations += 1
            log.warning("step of %d request(s) raised %s (%s); isolating the request(s) at "
                        "fault", len(so.num_scheduled_tokens), _error_text(e), _where(e))
            return self._bisect(so, e)

    def _group_output(self, so: SchedulerOutput, req_ids: list[str]) -> SchedulerOutput:
        kv = self.scheduler.kv_cache_manager
        out = SchedulerOutput(finished_req_ids=set(so.finished_req_ids),
                              preempted_req_ids=set(so.preempted_req_ids))
        for req_id in req_ids:
            r = self.scheduler.requests[req_id]
            out.scheduled_new_reqs.append(NewRequestData(
                req_id, list(r.all_token_ids), r.num_prompt_tokens, r.sampling_params,
                kv.get_block_ids(req_id), r.num_computed_tokens, r.lora_request))
            out.num_scheduled_tokens[req_id] = so.num_scheduled_tokens[req_id]
            if req_id in so.scheduled_spec_token_ids:
                out.scheduled_spec_token_ids[req_id] = so.scheduled_spec_token_ids[req_id]
            if req_id in so.num_drafts_to_propose:
                out.num_drafts_to_propose[req_id] = so.num_drafts_to_propose[req_id]
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        return out

    def _bisect(self, so: SchedulerOutput, first: BaseException) -> StepResult:
        kv = self.scheduler.kv_cache_manager
        merged = ModelRunnerOutput()
        failed: dict[str, Failure] = {}
        suspect_blocks: set[int] = set()
        first_text = _error_text(first)
        for req_id in so.num_scheduled_tokens:       # cannot be re-sent mid-prompt scoring
            r = self.scheduler.requests[req_id]
            if (r.sampling_params.prompt_logprobs is not None
                    and 0 < r.num_computed_tokens < r.num_prompt_tokens):
                failed[req_id] = f"the step failed while scoring its prompt: {first_text}"
        attempts = 1
        pending = [[r for r in so.num_scheduled_tokens if r not in failed]]
        while pending:
            group = [r for r in pending.pop(0) if r not in failed]
            for req_id in list(group):               # dependents of culprits
                if suspect_blocks & set(kv.get_block_ids(req_id)):
                    failed[req_id] = f"shares KV blocks with a failed request: {first_text}"
                    group.remove(req_id)
            if not group:
                continue
            if attempts >= MAX_ATTEMPTS:
                for req_id in group:
                    failed[req_id] = first_text
                    suspect_blocks.update(kv.unverified_block_ids(
                        self.scheduler.requests[req_id]))
                continue
            attempts += 1
            try:
                _merge(merged, self._execute(self._group_output(so, group)))
            except Exception as e:  # noqa: BLE001
                if len(group) == 1:
                    failed[group[0]] = _failure(e)
                    suspect_blocks.update(kv.unverified_block_ids(
                        self.scheduler.requests[group[0]]))
                else:
                    half = len(group) // 2
                    pending[:0] = [group[:half], group[half:]]
        log.warning("isolated %d failing request(s) in %d executions: %s", len(failed),
                    attempts, sorted(failed))
        return merged, failed
