"""The two generation endpoints, each one walk through the OpenAI layer's stages:

    request ──prompt.py──> token ids ──params.py──> SamplingParams (constraint compiled)
            ──generation.py──> engine streams (abort on disconnect)
            ──render_completion.py / render_chat.py──> JSON body or SSE chunks

Every stage raises context.APIError for what the client got wrong (a 4xx naming the
field); nothing is added to the engine before the prompt and the params are valid.
"""
from __future__ import annotations

from fastapi import Request

from duetserve.entrypoints.openai.context import ServerContext
from duetserve.entrypoints.openai.generation import Generation
from duetserve.entrypoints.openai.params import chat_params, completion_params, tool_plan
from duetserve.entrypoints.openai.prompt import chat_prompt, check_request, completion_prompts
from duetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from duetserve.entrypoints.openai.render_chat import ChatRenderer
from duetserve.entrypoints.openai.render_completion import CompletionRenderer


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw: Request):
    """POST /v1/completions."""
    lora = check_request(ctx, body)
    params = await completion_params(ctx, body)
    prompts = await completion_prompts(ctx, body)
    gen = Generation(ctx, raw, "cmpl", body.kv_transfer_params)
    await gen.start(prompts, params, "prompt", lora)
    return await CompletionRenderer(ctx, body, gen).response()


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest,
                                 raw: Request):
    """POST /v1/chat/completions."""
    lora = check_request(ctx, body)
    plan = tool_plan(body)
    prompt = await chat_prompt(ctx, body, plan)
    params = await chat_params(ctx, body, plan)
    gen = Generation(ctx, raw, "chatcmpl", body.kv_transfer_params)
    await gen.start([prompt], params, "messages", lora)
    return await ChatRenderer(ctx, body, plan, gen).response()
