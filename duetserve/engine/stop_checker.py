"""Token-level stop conditions of one sequence (stop strings live in the detokenizer).

Checked after each appended token, in this order: eos (unless ignore_eos), a stop token
id, max_tokens, the context limit. eos and stop ids count only once min_tokens is reached
(the sampler already masks them before that; this keeps the rule in one place for
tokens that did not come from the sampler, e.g. accepted drafts).
"""
from __future__ import annotations

from dataclasses import dataclass

from duetserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopDecision:
    finish_reason: str                 # "stop" | "length"
    stop_reason: int | None = None     # the stop token id that matched (None for eos/length)


def check_token_stop(params: SamplingParams, token_id: int, num_output_tokens: int,
                     eos_token_ids: tuple[int, ...], num_total_tokens: int | None = None,
                     max_model_len: int | None = None) -> StopDecision | None:
    """Whether the sequence ends with `token_id`, its latest output token
    (`num_output_tokens` counts it; `num_total_tokens` = prompt + output). Pure function.
    Returns the decision, or None to keep going."""
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return StopDecision("stop")
        if token_id in params.stop_token_ids:
            return StopDecision("stop", token_id)
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return StopDecision("length")
    if max_model_len is not None and num_total_tokens is not None \
            and num_total_tokens >= max_model_len:
        return StopDecision("length")
    return None
