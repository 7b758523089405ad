"""Errors a user can cause. Each message names the limit or the bad value."""
from __future__ import annotations


class DuetError(Exception):
    """Base of duetserve's user-facing errors."""


class CheckpointError(DuetError):
    """A checkpoint cannot be read: not found, not GGUF, truncated, unsupported."""


class RequestError(DuetError, ValueError):
    """A request is invalid (prompt too long, bad parameter).

    `param` names the request field at fault (an OpenAI body field such as "seed",
    "prompt", "n"), or None when no single field is. The server answers it as HTTP 400
    with `param` in the error body; offline users catch it as a ValueError."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineOverloadedError(DuetError):
    """The engine's waiting queue is full: the request was refused, nothing was queued.
    The server answers it as HTTP 503 with `Retry-After`."""


class RequestFailedError(DuetError):
    """A request failed while the engine was running it (its own processing raised); the
    other requests of that step were not affected. `param`: the request field whose
    value made it fail (the server answers HTTP 400 naming it), or None (HTTP 500)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class LoRAError(DuetError, ValueError):
    """A LoRA adapter cannot be used: its files are missing or malformed, its rank is above
    max_lora_rank, it targets modules the model lacks, or it does not fit the base model."""
