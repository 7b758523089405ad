"""A tiny fake OpenAI-compatible streaming server for the bench tests.

FastAPI + uvicorn in a background thread on a free loopback port. It "generates" words
`t0 t1 ...`: max_tokens of them when ignore_eos is set, else min(max_tokens,
NATURAL_LEN) (as if EOS came). A prompt token is one whitespace-separated word. With
`tokens_per_chunk = k` and continuous usage requested, chunks carry k words each and a
running usage; without continuous usage every chunk is one word. A prompt containing the
word FAIL gets HTTP 500. Everything it served is counted in `stats` for the tests.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

NATURAL_LEN = 7
MODEL = "fake-model"


@dataclass
class FakeStats:
    """What the fake server counted (successful streams only)."""

    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)


def build_app(stats: FakeStats, tokens_per_chunk: int = 1, delay_s: float = 0.001) -> FastAPI:
    """The FastAPI app; `stats` is mutated as requests are served."""
    app = FastAPI()
    lock = threading.Lock()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def handle(req: Request, chat: bool) -> Any:
        body = await req.json()
        if chat:
            prompt_words = sum(len(m["content"].split()) for m in body["messages"])
            text_in = " ".join(m["content"] for m in body["messages"])
        else:
            text_in = body["prompt"]
            prompt_words = len(text_in.split())
        if "FAIL" in text_in.split():
            return JSONResponse({"error": {"message": "fake failure"}}, status_code=500)
        n = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], NATURAL_LEN)
        continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
        k = tokens_per_chunk if continuous else 1
        words = [f"t{i}" for i in range(n)]
        with lock:
            stats.num_requests += 1
            stats.prompt_tokens += prompt_words
            stats.completion_tokens += n
            stats.bodies.append(body)
            stats.replies.append(" ".join(words))

        def chunk(text: str, done: int) -> str:
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            obj: dict[str, Any] = {"id": "x", "model": MODEL, "choices": [choice]}
            if continuous:
                obj["usage"] = {"prompt_tokens": prompt_words, "completion_tokens": done,
                                "total_tokens": prompt_words + done}
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            if chat:  # a role-only first chunk, like OpenAI's
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
            for start in range(0, n, k):
                await asyncio.sleep(delay_s)
                piece = words[start:start + k]
                yield chunk(("" if start == 0 else " ") + " ".join(piece), start + len(piece))
            usage = {"prompt_tokens": prompt_words, "completion_tokens": n, "total_tokens": prompt_words + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request) -> Any:
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request) -> Any:
        return await handle(req, chat=True)

    return app


class FakeServer:
    """Context manager: `with FakeServer() as srv: srv.base_url, srv.stats`."""

    def __init__(self, tokens_per_chunk: int = 1) -> None:
        self.stats = FakeStats()
        config = uvicorn.Config(build_app(self.stats, tokens_per_chunk), host="127.0.0.1", port=0,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.base_url = ""

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
