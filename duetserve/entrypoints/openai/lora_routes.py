"""LoRA adapters by name: the server's registry (--lora-modules at start, then runtime
loads) and vLLM's endpoints, behind the API key like every /v1 route:

    POST /v1/load_lora_adapter    {"lora_name": str, "lora_path": str}  200 text; 400
    POST /v1/unload_lora_adapter  {"lora_name": str}                    200 text; 404

A request's `model` selects an adapter by name (ServerContext.check_model), GET /v1/models
lists each with the base as its `parent`. The engine holds at most --max-loras adapters'
weights at once (worker/lora_slots.py): a registered adapter is read (off the step loop)
for the first request that uses it. Unloading, as vLLM's, answers at once: new requests
naming it get 404, requests already admitted finish under it, and its weights are freed
after the last of them (EngineCore.release_lora).
"""
from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from duetserve.entrypoints.openai.context import APIError, ServerContext
from duetserve.errors import LoRAError
from duetserve.request import LoRARequest


class LoRARegistry:
    """Adapter name -> LoRARequest (ids from 1, never reused). `check(lora)` validates an
    adapter against the model (EngineCore's LoRASlots.check: thread-safe, reads files)."""

    def __init__(self, check: Callable[[LoRARequest], None], base_name: str,
                 modules: tuple[tuple[str, str], ...] = ()) -> None:
        self.check, self.base_name = check, base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for name, path in modules:         # at start-up: a bad one stops the server
            self.register(self.new(name, path), checked=False)

    def new(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest for a new name (not checked yet). Raises LoRAError for a name in
        use (the base's or an adapter's)."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LoRAError("expected a non-empty lora_name and lora_path")
        if name == self.base_name or name in self.by_name:
            raise LoRAError(f"the LoRA adapter '{name}' has already been loaded"
                            if name in self.by_name else
                            f"'{name}' is the base model's name; pick another lora_name")
        return LoRARequest(name, next(self._ids), os.path.abspath(path))

    def register(self, lora: LoRARequest, checked: bool = True) -> None:
        """Add it (checking it first unless `checked`). Raises LoRAError."""
        if not checked:
            self.check(lora)
        if lora.lora_name in self.by_name:
            raise LoRAError(f"the LoRA adapter '{lora.lora_name}' has already been loaded")
        self.by_name[lora.lora_name] = lora

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def names(self) -> list[str]:
        return list(self.by_name)


def add_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers);
    errors are OpenAI error objects (APIError)."""
    loras: LoRARegistry = ctx.loras

    async def _body(raw: Request, keys: tuple[str, ...]) -> list[str]:
        try:
            body = await raw.json()
            values = [body[k] for k in keys]
        except Exception:  # noqa: BLE001 - malformed body
            raise APIError(f"expected a JSON object with {', '.join(keys)}") from None
        bad = next((k for k, v in zip(keys, values) if not isinstance(v, str) or not v),
                   None)
        if bad is not None:
            raise APIError(f"{bad} must be a non-empty string", param=bad)
        return values

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        name, path = await _body(raw, ("lora_name", "lora_path"))
        try:
            lora = loras.new(name, path)
        except LoRAError as e:
            raise APIError(str(e), 400, "lora_name") from None
        try:
            await asyncio.to_thread(loras.check, lora)     # reads the files
        except LoRAError as e:
            raise APIError(str(e), 400, "lora_path") from None
        try:
            loras.register(lora)       # the name may have been taken meanwhile
        except LoRAError as e:
            raise APIError(str(e), 400, "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        (name,) = await _body(raw, ("lora_name",))
        lora = loras.by_name.pop(name, None)
        if lora is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name",
                           "NotFoundError")
        ctx.engine.release_lora(lora.lora_int_id)     # its weights, once no request runs it
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
