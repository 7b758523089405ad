"""Scheduler: decides each step which requests compute how many tokens.

One counter per request, `num_computed_tokens`, catches up with `len(all_token_ids)` under
one token budget per step (max_num_batched_tokens) and a cap on running requests
(max_num_seqs). A decode is the case "1 token behind", a prefill chunk "many behind";
both share a step (mixed batches). Prefix hits, chunking and preemption are arithmetic
on the counter:

    step:  running requests first (oldest admitted first), each gets
               min(num_tokens - num_computed_tokens, budget left [, long_prefill cap])
           (with a StepBudget, a prefill chunk after s cached tokens is charged more
           than its length, so deep in a long context it gets fewer tokens)
           when its slots do not fit: preempt the lowest-priority / newest running request
           (possibly itself) and retry; then, if nothing was preempted, admit waiting
           requests in queue order (prefix-cache lookup, chunk to the budget left) until
           one does not fit (it blocks the ones behind it: FCFS within a priority).

Speculative decoding (config.spec_policy) is arithmetic on the same counter: a decode's
slice is its last token plus k drafts (request.spec_token_ids, proposed by the runner
after the previous step), so k+1 positions are computed; after the step the counter
advances by k+1 and falls back by the number of rejected drafts. Their KV slots are simply
overwritten later. Drafts never enter all_token_ids, so block hashes (and the prefix
cache) only ever see verified tokens. A fixed budget caps drafts with everything else; a
StepBudget (a time target, for the gaps prefill chunks cause) is widened by the drafts
the policy planned, which already weighed their rows' cost against their tokens, so
prefill chunks get the room they would have had without speculation.

Waiting order and preemption victims follow one key, (priority, arrival): smaller
priority first, then earlier add_request; preempted requests go to the front of their
priority in the waiting queue.

Goodput-first (config.slo, core/slo.py): for the prompt next in line the budget is
widened within the running streams' TPOT slack (to light steps while they have it,
further for a prompt that would miss its TTFT target; never narrowed below
StepBudget's); a waiting request joins running ones only while
their decode-only step stays within the TPOT target (a wider bound once it has waited
part of its TTFT target: SloPolicy.admits); the waiting order within a priority
is the TTFT deadline. The scheduler reads no clock: `schedule(now)` and
`update_from_output(..., now)` are given the time (the engine's time.time(), the
simulator's simulated time), in the clock of Request.arrival_time; without it the budget
is StepBudget's.

In their own modules: the step being assembled and its SchedulerOutput, where the phase
of each slice is decided (step_plan.py); speculation's per-step arithmetic
(spec_schedule.py); the disaggregation states and transitions (remote_kv.py).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from duetserve.config import SchedulerConfig
from duetserve.core import hashing
from duetserve.core.disk_tier import DiskTier
from duetserve.core.kv_cache_manager import KVCacheManager, cdiv
from duetserve.core.remote_kv import RemoteKV
from duetserve.core.request_queue import RequestQueue
from duetserve.core.slo import SloPolicy
from duetserve.core.spec_policy import SpecPolicy
from duetserve.core.spec_schedule import (count_spec, drafts_for, lookahead, num_to_propose,
                                          plan_spec)
from duetserve.core.step_plan import StepPlan
from duetserve.errors import RequestError
from duetserve.outputs import ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from duetserve.request import LoRARequest, Request, RequestStatus


@dataclass
class SchedulerStats:
    """A snapshot for metrics. Token counts of `last step` refer to the last schedule()."""

    num_running: int = 0
    num_waiting: int = 0
    num_prefill_tokens: int = 0      # last step
    num_decode_tokens: int = 0       # last step
    prefix_cache_queries: int = 0    # tokens, cumulative
    prefix_cache_hits: int = 0       # tokens found in memory, cumulative
    prefix_cache_disk_hits: int = 0  # tokens loaded from the disk tier, cumulative
    num_preemptions: int = 0         # cumulative
    kv_usage: float = 0.0            # fraction of blocks held by requests
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    # blocks held per attention kind ("full", "sliding": KVCacheManager.used_blocks_by_kind)
    used_blocks_by_kind: dict[str, int] = field(default_factory=dict)
    spec: SpecDecodeStats | None = None  # cumulative; None without speculation


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size,
                                               config.enable_prefix_caching,
                                               config.kv_windows)
        # A request can never grow past what the whole pool holds.
        self.max_len = min(config.max_model_len, self.kv_cache_manager.max_request_tokens(
            config.max_num_batched_tokens))
        self.requests: dict[str, Request] = {}   # every unfinished request
        self.slo: SloPolicy | None = config.slo  # type: ignore[assignment]
        self.waiting = RequestQueue(None if self.slo is None else self.slo.deadline)
        self._now: float | None = None           # the last schedule()'s time
        self.running: list[Request] = []         # in admission order
        self._finished_req_ids: set[str] = set() # since the last schedule()
        self._arrival = itertools.count()
        self._arrival_seq: dict[str, int] = {}
        self.num_preemptions = 0
        self._last_num_prefill_tokens = 0
        self._last_num_decode_tokens = 0
        self.remote = RemoteKV()                 # disaggregation: held / loading requests
        self.disk: DiskTier | None = None        # the prefix cache's disk tier (the engine)
        self.spec_policy: SpecPolicy | None = config.spec_policy  # type: ignore[assignment]
        self.spec_stats = SpecDecodeStats() if self.spec_policy is not None else None
        # Whether a LoRA adapter's weights are resident for this step, given the adapters
        # the running requests use (the engine's LoRASlots.ready, which otherwise starts
        # reading them off the step loop): a waiting request whose adapter is not is
        # skipped, the ones behind it go on. Default: always (tests without a runner).
        self.lora_ready: Callable[[LoRARequest, set[int]], bool] = lambda lora, used: True
        self._num_lora_skipped = 0               # waiting requests the last pass skipped

    # --- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises RequestError (nothing changed) when its prompt can
        never be scheduled or the id is in use. Mutates: waiting queue, request.block_hashes.
        """
        if request.req_id in self.requests:
            raise RequestError(f"request id {request.req_id!r} is already in use")
        self.check_prompt_len(request.num_tokens)
        if self.enable_caching:
            hashing.update_block_hashes(request, self.block_size)
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self._arrival_seq[request.req_id] = next(self._arrival)
        self.waiting.push(request)

    def check_prompt_len(self, num_tokens: int) -> None:
        """Raises RequestError(param "prompt") naming the limit when a prompt of
        `num_tokens` can never be scheduled: empty, or no room left to generate one token
        within max_model_len and the whole KV cache. The one length check of a request
        (EngineCore.validate_request calls it). Reads only immutable state (any thread)."""
        if num_tokens < 1:
            raise RequestError("the prompt is empty (it must contain at least one token)",
                               "prompt")
        if num_tokens >= self.max_len:
            raise RequestError(
                f"the prompt has {num_tokens} tokens; the limit is {self.max_len - 1} "
                f"(max_model_len {self.config.max_model_len}, KV cache "
                f"{self.max_len} tokens of one request: {self.kv_cache_manager.num_blocks} "
                f"blocks x {self.block_size}), leaving room for at least one generated "
                "token", "prompt")

    def has_room(self, num_requests: int) -> bool:
        """Whether `num_requests` more requests fit in the waiting queue (max_num_waiting;
        0 = unbounded). Mutates nothing."""
        cap = self.config.max_num_waiting
        return cap <= 0 or len(self.waiting) + num_requests <= cap

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        """Finish the given requests with finish_reason "abort"; unknown or already finished
        ids are ignored. Mutates: queues, block tables, request status."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        self.finish_requests(req_ids, "abort")

    def finish_requests(self, req_ids: str | Iterable[str], finish_reason: str,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Engine-triggered finish (e.g. a stop string matched). Frees the blocks, removes the
        requests from the queues; their ids go into the next SchedulerOutput.finished_req_ids.
        Returns the requests that were finished by this call (unknown ids are ignored)."""
        return self._finish([req_ids] if isinstance(req_ids, str) else req_ids,
                            finish_reason, stop_reason, failed=False)

    def fail_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish requests whose processing raised inside the current step (finish_reason
        "error"). Call it after schedule() and before update_from_output(): their
        num_computed_tokens has not advanced, so the blocks the step was filling are
        dropped from the prefix cache (their KV may be unwritten) before they are freed.
        Returns the requests finished by this call; unknown ids are ignored."""
        return self._finish(req_ids, "error", None, failed=True)

    def _finish(self, req_ids: Iterable[str], finish_reason: str,
                stop_reason: int | str | None, failed: bool) -> list[Request]:
        """Mutates the queues, the requests and the block pool (see the two callers)."""
        done = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if req_id in self.remote.loaded:
                del self.remote.loaded[req_id]
                request.set_finished(finish_reason, stop_reason)
                self._release(request)
                done.append(request)
                continue
            if req_id in self.remote.loading:
                # a reader thread may still write its blocks: freed when the load ends
                del self.remote.loading[req_id]
                request.set_finished(finish_reason, stop_reason)
                self.remote.orphaned[req_id] = request
                self._forget(request)
                done.append(request)
                continue
            if request.is_waiting:
                self.waiting.remove(req_id)
                self._num_lora_skipped = 0       # look again at who can run
            else:
                self.running.remove(request)
            self.remote.fresh.discard(req_id)
            request.set_finished(finish_reason, stop_reason)
            self._release(request, request.num_computed_tokens if failed else None)
            done.append(request)
        return done

    def _release(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Forget a finished request and free its blocks, unless it is a producer whose
        KV a decode instance will read (held until free_held). Mutates: block tables,
        self.requests, self.remote.held."""
        if RemoteKV.should_hold(request, num_valid_tokens is not None):
            self.remote.held[request.req_id] = request
        else:
            self.kv_cache_manager.free(request, num_valid_tokens)
        self._forget(request)

    def _forget(self, request: Request) -> None:
        if self.disk is not None:
            self.disk.forget(request.req_id)
        del self.requests[request.req_id]
        del self._arrival_seq[request.req_id]
        self._finished_req_ids.add(request.req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether a step could run something now (requests loading KV cannot, nor
        those waiting for their LoRA adapter's weights: the engine wakes when a read
        ends)."""
        return bool(len(self.waiting) > self._num_lora_skipped or self.running
                    or self.remote.loaded)

    # --- disaggregation (the transitions are in core/remote_kv.py) --------------------
    def free_held(self, req_id: str) -> bool:
        """Free a held producer's blocks (transferred, or timed out). Returns whether it
        was held. Mutates: the block pool, self.remote.held."""
        return self.remote.free_held(req_id, self.kv_cache_manager)

    def finish_load(self, req_id: str, ok: bool) -> Request | None:
        """A consumer's load ended (RemoteKV.finish_load): loaded, it runs from the next
        step with a free running slot; failed, it is finished with "error", forgotten and
        returned (the engine reports it). Mutates: the request, the block pool,
        self.remote, and on failure self.requests."""
        failed = self.remote.finish_load(req_id, ok, self.kv_cache_manager)
        if failed is not None:
            self._forget(failed)
        return failed

    def finish_disk_load(self, req_id: str, num_tokens: int) -> None:
        """A load from the disk tier ended with the request's first `num_tokens` tokens
        verified (at least its in-memory hit): it runs from there (RemoteKV.finish_load).
        Mutates: the request, the block pool, self.remote, self.disk.hits."""
        request = self.remote.loading.get(req_id)
        if request is not None and self.disk is not None:
            self.disk.hits += num_tokens - request.num_computed_tokens
        self.remote.finish_load(req_id, True, self.kv_cache_manager, num_tokens)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step ------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Pick this step's work. `now`: the time, in the clock of Request.arrival_time
        (the goodput-first budget needs it; None: StepBudget's alone). Mutates:
        running/waiting queues, block tables, and for the requests it touches status,
        num_computed_tokens (admission: prefix hit; preemption: 0), num_preemptions.
        num_computed_tokens of scheduled requests is advanced later, by
        update_from_output. Returns the SchedulerOutput for the runner."""
        self._now = now
        step = StepPlan(*self._token_budget(now))
        self.remote.run_loaded(self.running, self.config.max_num_seqs)
        if self.spec_policy is not None:
            plan_spec(self.spec_policy, self.running, step)
            if self.config.step_budget is not None:
                step.widen(sum(step.spec_plan.values()))
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        return self._build_output(step)

    def _token_budget(self, now: float | None) -> tuple[int, bool]:
        """(this step's budget, whether it is idle): the budget fixed (never idle: a fixed
        budget charges chunks their length anyway), or re-derived from the number of
        running decodes (requests one token behind; idle when none) and of requests with
        prompt tokens to compute (the other running ones and the waiting ones that could
        be admitted) when the config carries a StepBudget; with an SloPolicy and the time,
        the larger of that and the budget the decodes' TPOT slack allows for the prompt
        next in line."""
        policy = self.config.step_budget
        if policy is None:
            return self.config.max_num_batched_tokens, False
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        admissible = min(len(self.waiting), max(self.config.max_num_seqs - len(self.running),
                                                0))
        prefills = len(self.running) - len(decodes) + admissible
        budget = policy.for_step(len(decodes), prefills)
        prompt = self._next_prompt()
        if self.slo is None or now is None or not decodes or prompt is None:
            return budget, not decodes
        return min(max(policy.idle, budget),
                   self.slo.token_budget(now, decodes, prompt, budget)), False

    def _next_prompt(self) -> Request | None:
        """The prompt next in line: the first running request more than one token behind,
        else the first waiting one that may be admitted (its prefix hit not known yet:
        counted as uncached); None. Mutates nothing."""
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens > 1:
                return r
        if not self.waiting or len(self.running) >= self.config.max_num_seqs or (
                self.slo is not None and not self.slo.admits(
                    len(self.running), self.waiting.peek(), self._now)):
            return None
        return self.waiting.peek()

    def _chunk(self, num_new: int, start: int, step: StepPlan) -> tuple[int, int]:
        """(tokens, budget charged) of a request's slice of up to `num_new` tokens after
        `start` computed ones in `step`. A prefill chunk under a StepBudget, in a step
        with decodes running, is sized and charged for its attention over the cached
        context (see core/step_budget.py); a decode, a slice under a fixed budget, or
        any slice of a step without decodes (no gap to protect: a prompt prefills in the
        idle chunks `idle_chunk` priced, without a short tail chunk) costs its length."""
        budget, step_budget = step.budget, step.full
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        num_new = min(num_new, budget)
        policy = self.config.step_budget
        if policy is None or num_new <= 1 or start == 0 or step.idle:
            return num_new, num_new
        num_new = policy.max_chunk(budget, start, num_new, step_budget)
        return num_new, policy.chunk_cost(num_new, start, step_budget)

    def _schedule_running(self, step: StepPlan) -> None:
        for request in list(self.running):
            if step.budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new, charge = self._chunk(request.num_tokens - request.num_computed_tokens,
                                          request.num_computed_tokens, step)
            if num_new <= 0:
                continue
            if self.spec_policy is None:        # no drafts to verify or to propose
                drafts, propose, num_slots = (), 0, num_new
            else:
                drafts = drafts_for(request, num_new, step, self.max_len)
                propose = num_to_propose(self.spec_policy, request,
                                         request.num_computed_tokens, num_new, len(drafts),
                                         step, self.max_len)
                num_slots = num_new + len(drafts) + lookahead(self.spec_policy, propose)
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_slots)
                if new_block_ids is not None:
                    if request.req_id in self.remote.fresh:    # loaded: runner learns it
                        self.remote.fresh.discard(request.req_id)
                        step.add(request, num_new + len(drafts),
                                 self.kv_cache_manager.get_block_ids(request.req_id), True,
                                 drafts=drafts, propose=propose, charge=charge + len(drafts))
                    else:
                        step.add(request, num_new + len(drafts), new_block_ids, is_new=False,
                                 drafts=drafts, propose=propose, charge=charge + len(drafts))
                    break
                victim = max(self.running, key=self._victim_key)
                self._preempt(victim, step)
                if victim is request:
                    break

    def _victim_key(self, request: Request) -> tuple[int, int]:
        return (request.priority, self._arrival_seq[request.req_id])

    def _preempt(self, request: Request, step: StepPlan) -> None:
        """Free the request's KV and send it to the front of the waiting queue. Undoes its
        scheduling if it was already scheduled in this step."""
        self.running.remove(request)
        step.remove(request)
        self.remote.fresh.discard(request.req_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.spec_streak = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.add(request.req_id)
        self.waiting.push_front(request)

    def _schedule_waiting(self, step: StepPlan) -> None:
        kv = self.kv_cache_manager
        skipped: list[Request] = []      # their LoRA adapter is being read: back in front
        while self.waiting and step.budget > 0:
            request = self.waiting.peek()
            remote = RemoteKV.needs_load(request)   # loads do not wait for a running slot
            if not self._lora_fits(request) or not remote and (
                    len(self.running) >= self.config.max_num_seqs or (
                        self.slo is not None and not self.slo.admits(
                            len(self.running), request, self._now))):
                break
            if not self._lora_resident(request):
                skipped.append(self.waiting.pop())
                continue
            if remote:
                if not self.remote.admit_load(request, kv, self.waiting):
                    break
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            loads = self._admit_disk_load(request, num_hit)
            if loads is not None:
                if not loads:
                    break
                continue
            num_new, charge = self._chunk(request.num_tokens - num_hit, num_hit, step)
            propose = num_to_propose(self.spec_policy, request, num_hit, num_new, 0, step,
                                     self.max_len)
            new_block_ids = kv.allocate_slots(request,
                                              num_new + lookahead(self.spec_policy, propose),
                                              hit_blocks)
            if new_block_ids is None:
                break  # FCFS: nobody behind it jumps the queue
            self.waiting.pop()
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.add(request, num_new, kv.get_block_ids(request.req_id), is_new=True,
                     propose=propose, charge=charge)
        for request in reversed(skipped):
            self.waiting.push_front(request)
        self._num_lora_skipped = len(skipped)

    def _admit_disk_load(self, request: Request, num_hit: int) -> bool | None:
        """When the disk tier holds blocks after the request's in-memory hit of
        `num_hit` tokens, admit it to load them (RemoteKV.admit_load): True, or False
        when its blocks do not fit or max_num_seqs requests run or load already
        (nothing changed). None: nothing on disk. Mutates: the request, the block pool,
        `waiting`, self.remote, self.disk.loads."""
        if self.disk is None:
            return None
        num_disk = self.disk.num_blocks_on_disk(request, num_hit // self.block_size)
        if num_disk == 0:
            return None
        if len(self.running) + len(self.remote.loading) + len(self.remote.loaded) \
                >= self.config.max_num_seqs:
            return False
        request.num_external_tokens = num_hit + num_disk * self.block_size
        if not self.remote.admit_load(request, self.kv_cache_manager, self.waiting,
                                      disk=True):
            request.num_external_tokens = 0
            return False
        self.disk.add_load(request, self.kv_cache_manager.get_block_ids(request.req_id),
                           request.num_computed_tokens)
        return True

    def _lora_fits(self, request: Request) -> bool:
        """Whether admitting `request` keeps the running requests' distinct LoRA adapters
        within max_loras (the worker's resident slots)."""
        cap, lora = self.config.max_loras, request.lora_request
        if not cap or lora is None:
            return True
        used = self._running_loras()
        return lora.lora_int_id in used or len(used) < cap

    def _lora_resident(self, request: Request) -> bool:
        """Whether the request's LoRA adapter (if any) is resident for this step
        (self.lora_ready; when not, the engine reads it in the background)."""
        lora = request.lora_request
        return lora is None or self.lora_ready(lora, self._running_loras())

    def _running_loras(self) -> set[int]:
        """The adapters of the running requests and of those loading KV (they run next)."""
        remote = self.remote
        return {r.lora_request.lora_int_id for group in (self.running, remote.loading.values(),
                                                         remote.loaded.values())
                for r in group if r.lora_request}

    def _build_output(self, step: StepPlan) -> SchedulerOutput:
        """The step's SchedulerOutput (core/step_plan.py). Mutates: the finished ids
        (handed over), the last step's token counts (for make_stats)."""
        out = step.to_output(self._finished_req_ids)
        self._finished_req_ids = set()
        self._last_num_prefill_tokens = out.num_prefill_tokens
        self._last_num_decode_tokens = out.num_decode_tokens
        return out

    # --- after the step ------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           now: float | None = None) -> list[Request]:
        """Apply a step's results. For every scheduled request still alive: advance
        num_computed_tokens, append the sampled tokens (stopping at the first one that
        finishes it), start its TPOT clock at its first output (at `now`, the step's end;
        None: the time given to schedule()), extend block hashes, and free it when
        finished. Returns the requests that got new tokens or finished in this step, in
        schedule order."""
        now = self._now if now is None else now
        touched = []
        sampled = runner_output.sampled_token_ids
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted/finished/preempted since schedule(): drop the results
            request.num_computed_tokens += num_new
            new_token_ids = sampled.get(req_id) or []
            drafts = scheduler_output.scheduled_spec_token_ids.get(req_id)
            if drafts:
                # The runner returns the accepted drafts plus one token of the target's;
                # the rejected drafts' positions are not computed after all (their KV
                # slots get overwritten when those positions are computed again).
                num_accepted = max(0, len(new_token_ids) - 1)
                request.num_computed_tokens -= len(drafts) - num_accepted
                assert self.spec_stats is not None
                count_spec(self.spec_stats, request, len(drafts), num_accepted)
            elif self.spec_stats is not None:
                count_spec(self.spec_stats, request, 0, 0)
            request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
            for token_id in new_token_ids:
                request.append_output_token_ids(token_id)
                if self._check_stop(request, token_id):
                    break
            if request.slo_anchor_time is None and new_token_ids and now is not None:
                request.slo_anchor_time, request.slo_anchor_tokens = \
                    now, request.num_output_tokens
            if self.enable_caching:
                hashing.update_block_hashes(request, self.block_size)
            if self.disk is not None:
                self.disk.offer(request, self.kv_cache_manager.req_to_blocks.get(req_id))
            if request.is_finished:
                self.running.remove(request)
                self._release(request)
            if new_token_ids or request.is_finished:
                touched.append(request)
        return touched

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Stop checks after appending `token_id`; marks the request finished (status,
        finish_reason, stop_reason) and returns True when it is."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.set_finished("stop", token_id)
                return True
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.set_finished("stop")
                return True
        if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
            request.set_finished("length")
            return True
        if request.num_tokens >= self.max_len:
            request.set_finished("length")
            return True
        return False

    # --- stats ---------------------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_prefill_tokens=self._last_num_prefill_tokens,
            num_decode_tokens=self._last_num_decode_tokens,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_disk_hits=0 if self.disk is None else self.disk.hits,
            num_preemptions=self.num_preemptions, kv_usage=kv.usage,
            num_used_blocks=kv.num_used_blocks, num_total_blocks=kv.num_blocks,
            used_blocks_by_kind=kv.used_blocks_by_kind(),
            spec=None if self.spec_stats is None else self.spec_stats.copy())

    def check_integrity(self) -> None:
        """Block pool and table invariants plus queue bookkeeping (AssertionError)."""
        self.kv_cache_manager.check_integrity()
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, f"{request.req_id} in running"
            tables = self.kv_cache_manager.req_to_blocks.get(request.req_id, [[]])
            blocks = tables[0]
            assert len(blocks) >= cdiv(request.num_computed_tokens, self.block_size), (
                f"{request.req_id}: {len(blocks)} blocks for "
                f"{request.num_computed_tokens} computed tokens")
        for request in self.waiting:
            assert request.is_waiting, f"{request.req_id} in waiting with {request.status!r}"
            assert request.req_id not in self.kv_cache_manager.req_to_blocks, (
                f"waiting request {request.req_id} holds blocks")
        num_loading = len(self.remote.loading) + len(self.remote.loaded)
        assert len(self.running) + len(self.waiting) + num_loading == len(self.requests), (
            f"running ({len(self.running)}) + waiting ({len(self.waiting)}) + loading "
            f"({num_loading}) != unfinished ({len(self.requests)})")

