"""Speculative decoding in the scheduler's step: which drafts a decode verifies, how many
the runner proposes afterwards, the KV slots those need, and the acceptance counts.

The policy (core/spec_policy.py) answers "how many"; these functions apply it to the
requests and the StepPlan of one schedule() call, and clamp it to the budget, the context
limit (`max_len`) and max_tokens. The Scheduler calls them; each says what it mutates.
"""
from __future__ import annotations

from duetserve.core.spec_policy import SpecPolicy, acceptance_estimate, is_spec_eligible
from duetserve.core.step_plan import StepPlan
from duetserve.outputs import SpecDecodeStats
from duetserve.request import Request

PROBE_EVERY = 8


def acceptance_of(policy: SpecPolicy, request: Request, streak: bool | None = None) -> float:
    """The request's per-draft acceptance estimate for its next verify. With
    policy.condition_on_streak (n-gram), measured separately on verify steps that follow a
    step which kept all its drafts (streak: the lookup's copy goes on from the same
    occurrence, and in an edited file that continues for whole lines) and on the others
    (a fresh match, often in new text); `streak` picks the state, default the request's.
    Otherwise one estimate from all its verify steps. Mutates nothing."""
    if not policy.condition_on_streak:
        return acceptance_estimate(request.spec_num_accepted, request.spec_num_rejections)
    if request.spec_streak if streak is None else streak:
        return acceptance_estimate(request.spec_streak_accepted,
                                   request.spec_streak_rejections)
    return acceptance_estimate(request.spec_num_accepted - request.spec_streak_accepted,
                               request.spec_num_rejections - request.spec_streak_rejections)


def plan_spec(policy: SpecPolicy, running: list[Request], step: StepPlan) -> None:
    """Drafts per running decode for this step (step.spec_plan), whether the step
    leaves room to propose more (step.spec_open) and the rows the next step is expected to
    have without drafts (step.spec_next_rows: the running requests' decodes). Mutates
    only `step`."""
    base_rows, left, candidates = 0, step.budget, []
    for r in running:
        behind = r.num_tokens - r.num_computed_tokens
        base_rows += min(behind, max(left, 0))
        left -= behind
        if behind == 1 and r.spec_token_ids:
            candidates.append((r.req_id, len(r.spec_token_ids), acceptance_of(policy, r)))
    step.spec_plan = policy.plan(candidates, base_rows, max(1, len(running)))
    step.spec_open = policy.has_room(base_rows)
    step.spec_next_rows = max(1, len(running))


def drafts_for(request: Request, num_new: int, step: StepPlan, max_len: int) -> list[int]:
    """The drafts this step verifies for `request` (a decode: num_new == 1), clamped
    to the budget, the context limit and max_tokens. Mutates nothing."""
    k = step.spec_plan.get(request.req_id, 0)
    if not k or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
        return []
    # positions computed: num_computed .. num_computed + k, all < max_len
    k = min(k, step.budget - 1, max_len - 1 - request.num_computed_tokens)
    if request.max_tokens is not None:
        k = min(k, request.max_tokens - request.num_output_tokens - 1)
    return request.spec_token_ids[:max(k, 0)]


def num_to_propose(policy: SpecPolicy | None, request: Request, num_computed: int,
                   num_new: int, num_drafts: int, step: StepPlan, max_len: int) -> int:
    """Drafts the runner proposes after this step: only for eligible requests whose
    slice [num_computed, num_computed + num_new) reaches the end of their known
    tokens. Mutates nothing."""
    if (policy is None or not step.spec_open
            or num_computed + num_new != request.num_tokens
            or not is_spec_eligible(request.sampling_params)):
        return 0
    # every PROBE_EVERY-th output token a draft model proposes at least one draft: the
    # request's acceptance keeps being measured even where the policy chose none
    probe = (num_computed + num_new - request.num_prompt_tokens) % PROBE_EVERY == 0
    alpha = acceptance_of(policy, request)
    if policy.condition_on_streak:
        # proposals follow this step's verify, whose outcome (streak or not) is not known
        # yet; the next step's plan uses that state's estimate and takes fewer drafts
        # when it should, so propose what the better state would use
        alpha = max(acceptance_of(policy, request, True), acceptance_of(policy, request, False))
    n = policy.num_to_propose(alpha, step.spec_next_rows, probe)
    # a draft model writes KV up to position num_tokens_after + n - 2 < max_len
    room = max_len - (num_computed + num_new + num_drafts)
    return max(0, min(n, room))


def lookahead(policy: SpecPolicy | None, num_propose: int) -> int:
    """KV slots allocated beyond this step's tokens for the proposer's own drafts."""
    return num_propose if policy is not None and policy.needs_lookahead else 0


def count_spec(stats: SpecDecodeStats, request: Request, num_drafts: int,
               num_accepted: int) -> None:
    """After a step of `request` that verified num_drafts drafts (0: a step without
    drafts, which only ends a streak). Mutates the request's acceptance counts and
    streak, and `stats`."""
    if num_drafts == 0:
        request.spec_streak = False
        return
    rejected = num_accepted < num_drafts
    request.spec_num_accepted += num_accepted
    request.spec_num_rejections += rejected
    if request.spec_streak:
        request.spec_streak_accepted += num_accepted
        request.spec_streak_rejections += rejected
    request.spec_streak = not rejected
    stats.num_drafts += 1
    stats.num_draft_tokens += num_drafts
    stats.num_accepted_tokens += num_accepted
    if len(stats.accepted_per_pos) < num_drafts:
        stats.accepted_per_pos.extend([0] * (num_drafts - len(stats.accepted_per_pos)))
    for j in range(num_accepted):
        stats.accepted_per_pos[j] += 1
