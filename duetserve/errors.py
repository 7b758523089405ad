"""Errors a user can cause. Each message names the limit or the bad value."""
from __future__ import annotations


class DuetError(Exception):
    """Base of duetserve's user-facing errors."""


class CheckpointError(DuetError):
    """A checkpoint cannot be read: not found, not GGUF, truncated, unsupported."""


class RequestError(DuetError, ValueError):
    """A request is invalid (prompt too long, bad parameter)."""
