"""Request -> prompt: the first stage of a generation request (serving.py). Checks what
concerns the request as a whole, then turns its prompt or messages into token ids (text
is bounded in characters first, then tokenized on a worker thread, so the event loop
keeps serving)."""
from __future__ import annotations

import asyncio

from duetserve.entrypoints.openai import tools as tool_plans
from duetserve.entrypoints.openai.context import APIError, ServerContext
from duetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from duetserve.errors import RequestError
from duetserve.request import LoRARequest

Prompt = tuple[list[int], "str | None"]       # (token ids, the text when given as text)


def check_request(ctx: ServerContext, body: CompletionRequest | ChatCompletionRequest
                  ) -> LoRARequest | None:
    """The server admits requests, serves the model named, and implements every field the
    body sets (else an APIError naming the first one). Returns the LoRA adapter the model
    names (None: the base model)."""
    ctx.check_admitting()
    lora = ctx.check_model(body.model)
    bad = body.unsupported_field()
    if bad is not None:
        raise APIError(bad[1], param=bad[0])
    return lora


async def completion_prompts(ctx: ServerContext, body: CompletionRequest) -> list[Prompt]:
    """Each prompt of a /v1/completions body as (token ids, text or None). APIError on
    an empty list or prompt, too many choices, or text past the character bound."""
    prompts = body.prompts()
    if not prompts:
        raise APIError("the prompt list is empty", param="prompt")
    if len(prompts) > 1 and len(prompts) * body.n > ctx.max_n:   # n alone: the engine
        raise APIError(f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} "
                       f"choices; at most {ctx.max_n} (max_n) per request", param="prompt")
    ctx.check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise APIError("the prompt is empty", param="prompt")
            out.append((await asyncio.to_thread(ctx.tokenizer.encode, p), p))
        else:
            out.append((list(p), None))
    return out


async def chat_prompt(ctx: ServerContext, body: ChatCompletionRequest,
                      plan: tool_plans.ToolPlan) -> Prompt:
    """The chat template applied to the body's messages (and the tools `plan` shows).
    APIError when a tool turn is out of place, the template rejects the conversation or
    the text is too long."""
    try:
        messages, template_vars = tool_plans.template_messages(
            body.messages, plan, ctx.tokenizer.supports_tools)
    except RequestError as e:
        raise APIError(e.message, param=e.param) from None
    ctx.check_chars(body.num_chars, "messages")
    try:
        token_ids = await asyncio.to_thread(ctx.tokenizer.encode_chat, messages,
                                            body.add_generation_prompt, **template_vars)
    except Exception as e:  # noqa: BLE001 - a template rejecting the conversation
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
    return token_ids, None
