"""Sampling params and constraint: the second stage of a generation request (serving.py).
The body's fields become one SamplingParams (validated once, when it is built) whose
grammar, if any, is compiled here on a worker thread, so the engine's admission check
finds it cached and the event loop keeps serving."""
from __future__ import annotations

import asyncio
import dataclasses

from duetserve.entrypoints.openai import tools as tool_plans
from duetserve.entrypoints.openai.context import APIError, ServerContext
from duetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from duetserve.errors import RequestError
from duetserve.sampling_params import GuidedDecoding, SamplingParams


async def compile_constraint(ctx: ServerContext, guided: GuidedDecoding | None) -> None:
    """Compile `guided`'s grammar (nothing for None). An invalid one is a 400 naming its
    field."""
    if guided is None:
        return
    try:
        await asyncio.to_thread(ctx.core.grammars.compile, guided)
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None


async def completion_params(ctx: ServerContext, body: CompletionRequest) -> SamplingParams:
    """A /v1/completions body's SamplingParams (echo with logprobs scores the prompt
    too), its constraint compiled. APIError (400) naming a bad field."""
    try:
        params = body.to_sampling_params()
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None
    await compile_constraint(ctx, params.guided)
    if body.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    return params


def tool_plan(body: ChatCompletionRequest) -> tool_plans.ToolPlan:
    """What a chat body's tools make of the request: the tools the prompt shows, the
    grammar tool_choice forces, whether the output is parsed for calls. APIError (400)
    when tool_choice and another constraint both constrain the output."""
    try:
        plan = tool_plans.plan_tools(body)
        constraint = body.guided()
        if plan.forced is not None and constraint is not None:
            raise RequestError(f"tool_choice {body.tool_choice!r} constrains the output "
                               f"already; it cannot be combined with {constraint.param}",
                               constraint.param)
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None
    return plan


async def chat_params(ctx: ServerContext, body: ChatCompletionRequest,
                      plan: tool_plans.ToolPlan) -> SamplingParams:
    """A chat body's SamplingParams under the tool plan's forced grammar or the body's own
    constraint, both compiled (and the plan's check grammar). APIError (400)."""
    try:
        params = body.to_sampling_params(plan.forced or body.guided())
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None
    await compile_constraint(ctx, plan.check)
    await compile_constraint(ctx, params.guided)
    return params
