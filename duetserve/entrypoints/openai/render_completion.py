"""Response, for /v1/completions: the last stage of its request (serving.py). One JSON
body with every choice, or one SSE chunk per delta; with `echo` the prompt's text (and,
asked for logprobs, its scored tokens) comes first. A list of prompts gives n choices per
prompt: choice index = prompt index x n + sample index."""
from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

from duetserve.entrypoints.openai.context import ServerContext
from duetserve.entrypoints.openai.generation import Generation, chunk_json
from duetserve.entrypoints.openai.protocol import CompletionRequest, finite
from duetserve.outputs import Logprob, RequestOutput


def _top(ctx: ServerContext, entries: dict[int, Logprob]) -> dict[str, float]:
    return {ctx.token_text(t): finite(lp.logprob)
            for t, lp in sorted(entries.items(), key=lambda kv: kv[1].rank)}


def completion_logprobs(ctx: ServerContext, token_ids: list[int],
                        logprobs: list[dict[int, Logprob]] | None, offset: int) -> dict | None:
    """The logprobs object of `token_ids` (a delta's, or a whole output's), text offsets
    counted from `offset`."""
    if logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entries in zip(token_ids, logprobs):
        text = ctx.token_text(tid)
        tokens.append(text)
        chosen = entries.get(tid)
        token_lps.append(None if chosen is None else finite(chosen.logprob))
        tops.append(_top(ctx, entries))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def with_prompt(ctx: ServerContext, out: RequestOutput, token_ids: list[int],
                completion: dict | None) -> dict | None:
    """Prepend the prompt's tokens and logprobs (echo + logprobs); the first is None.
    `completion`'s text offsets must already count the echoed prompt."""
    prompt_lps = out.prompt_logprobs
    if prompt_lps is None and len(token_ids) == 1:
        prompt_lps = [None]       # a one-token prompt has nothing to score
    if prompt_lps is None or completion is None:
        return completion
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for tid, entries in zip(token_ids, prompt_lps):
        text = ctx.token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        lps.append(None if entries is None else finite(entries[tid].logprob))
        tops.append(None if entries is None else _top(ctx, entries))
    return {"tokens": tokens + completion["tokens"],
            "token_logprobs": lps + completion["token_logprobs"],
            "top_logprobs": tops + completion["top_logprobs"],
            "text_offset": offsets + completion["text_offset"]}


class CompletionRenderer:
    """Renders one /v1/completions request's outputs. Mutates only which choices have
    sent their first chunk (the echo goes into it)."""

    def __init__(self, ctx: ServerContext, body: CompletionRequest, gen: Generation) -> None:
        self.ctx, self.body, self.gen = ctx, body, gen
        self.n = gen.params.n
        self.echoes = [""] * len(gen.prompts)
        if body.echo:
            self.echoes = [text if text is not None else ctx.tokenizer.decode(ids)
                           for ids, text in gen.prompts]
        self.head = {"id": gen.req_id, "object": "text_completion", "created": gen.created,
                     "model": ctx.served_model_name}
        self._started: set[int] = set()

    async def response(self):
        """The JSON body (every choice, once all have finished) or the SSE stream."""
        if self.body.stream:
            usage = (lambda u: {**self.head, "choices": [], "usage": u}) \
                if self.body.include_usage else None
            return StreamingResponse(self.gen.sse(self.chunks, usage),
                                     media_type="text/event-stream")
        outs = await self.gen.final()
        choices = [self._choice(i, out, o) for i, out in enumerate(outs) for o in out.outputs]
        return JSONResponse({**self.head, "choices": choices, "usage": self.gen.usage(),
                             "server_timing": self.gen.timing(), **self.gen.kv_response()})

    def _choice(self, i: int, out: RequestOutput, o) -> dict:
        echo = self.echoes[i]
        lps = completion_logprobs(self.ctx, o.token_ids, o.logprobs, len(echo))
        return {"index": i * self.n + o.index, "text": echo + o.text,
                "logprobs": with_prompt(self.ctx, out, self.gen.prompts[i][0], lps),
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        """One SSE chunk per sample that changed in delta `out` of prompt `i`."""
        chunks = []
        for o in out.outputs:
            index = i * self.n + o.index
            text, offset = o.text, 0
            if self.echoes[i] and index not in self._started:
                text, offset = self.echoes[i] + text, len(self.echoes[i])
            lps = completion_logprobs(self.ctx, o.token_ids, o.logprobs, offset)
            if offset:
                lps = with_prompt(self.ctx, out, self.gen.prompts[i][0], lps)
            self._started.add(index)
            choice = {"index": index, "text": text, "logprobs": lps,
                      "finish_reason": o.finish_reason}
            chunks.append(chunk_json(self.head, choice, self.gen.usage()
                                     if self.body.continuous_usage else None))
        return chunks
