"""What every stage of a request reads: the server's context (engine, names, limits, the
drain state) and the error a stage raises to answer with an OpenAI error object."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from duetserve.engine.async_engine import AsyncEngine
from duetserve.entrypoints.openai.protocol import error_body
from duetserve.request import LoRARequest

TOKEN_TEXT_CACHE = 200_000     # token id -> text entries kept for logprobs


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "BadRequestError", headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.status),
                            status_code=self.status, headers=self.headers)


def overloaded(message: str) -> APIError:
    return APIError(message, 503, None, "ServiceUnavailableError", {"Retry-After": "1"})


class InFlight:
    """Generation requests between arrival and their last byte (for the drain)."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.count += 1
        self.idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


def _max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """A prompt longer than this many characters cannot fit the context whatever its
    text: no token is longer than the longest vocabulary entry."""
    vocab = getattr(getattr(tokenizer, "tok", None), "get_vocab", None)
    longest = max((len(t) for t in vocab()), default=1) if vocab else 64
    return max_model_len * max(longest, 1)


@dataclass
class ServerContext:
    """The server's state shared by its routes. Mutated only through `draining` (the
    drain sets it), `in_flight` (RequestGuard counts) and the token-text cache."""

    engine: AsyncEngine
    served_model_name: str
    vocab_size: int
    max_model_len: int
    # fn(seconds from arrival) when a streamed request's first chunk goes to the HTTP
    # server (the metrics' time-to-first-chunk histogram); None: not observed.
    on_first_chunk: Callable[[float], None] | None = None
    # the LoRA adapters served by name (lora_routes.LoRARegistry); None: none
    loras: object | None = None
    draining: bool = False
    in_flight: InFlight = field(default_factory=InFlight)
    tokenizer: object = field(init=False)
    core: object = field(init=False)                  # the EngineCore
    max_n: int = field(init=False)
    max_prompt_chars: int = field(init=False)         # checked before tokenizing
    _token_text: dict[int, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer
        self.core = self.engine.engine
        self.max_n = self.core.config.max_n
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, self.max_model_len)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model). APIError 404 naming the
        model when it is neither the base nor a registered adapter."""
        if model is None or model == self.served_model_name:
            return None
        lora = None if self.loras is None else self.loras.get(model)
        if lora is None:
            names = [] if self.loras is None else self.loras.names()
            also = f" and the LoRA adapter(s) {', '.join(f'`{n}`' for n in names)}" \
                if names else ""
            raise APIError(f"the model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`{also}", 404, "model", "NotFoundError")
        return lora

    def check_admitting(self) -> None:
        if self.draining:
            raise overloaded("the server is shutting down and admits no new requests")

    def check_chars(self, num_chars: int, field_name: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(f"the {field_name} has {num_chars} characters; it cannot fit "
                           f"the context of {self.max_model_len} tokens (max_model_len): "
                           f"at most {self.max_prompt_chars} characters", param=field_name)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < TOKEN_TEXT_CACHE:
                self._token_text[token_id] = text
        return text
