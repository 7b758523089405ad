"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Nothing is silently ignored. Unknown fields are a 400 naming them (as OpenAI answers
"Unrecognized request argument"). OpenAI fields this server does not implement are
declared, so they parse, and `unsupported_field()` names the first one set to anything
but its no-op value (e.g. `response_format` other than text, `tools`): the server answers
400 with that `param`. Range checks live in SamplingParams and the engine's
validate_request, which raise RequestError with `param`; the server turns that into a
400 with `param` set.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from duetserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None                 # an end-user id: accepted, not used
    # Accepted when they ask for nothing (None / their no-op value); else a 400.
    service_tier: str | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, why) of the first OpenAI field set to something this server does not
        do, or None. Mutates nothing."""
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", "only the default service tier exists"
        return None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises SamplingParamsError naming the bad field."""
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=() if self.stop is None else self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16             # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string or token-id list each)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", (f"best_of must equal n ({self.n}) or be omitted: ranking "
                               "extra samples is not implemented")
        return super().unsupported_field()

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"
    text: str


# OpenAI's roles; "developer" is rendered as "system" (what it means for chat models).
# "tool" / "function" messages need tool calls, which are not implemented: 400.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None

    def unsupported_field(self) -> str | None:
        if self.role in ("tool", "function"):
            return "role"
        for name in ("tool_calls", "tool_call_id", "function_call"):
            if getattr(self, name):
                return name
        return None

    @property
    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(p.text) for p in self.content)
        return len(self.content or "")

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # OpenAI fields without an implementation here: only their no-op values pass.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        later = "is not supported yet (structured output and tool calls are their own issue)"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", f"response_format {self.response_format.get('type')!r} {later}"
        if self.tools:
            return "tools", f"tools {later}"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", f"tool_choice {later}"
        if self.functions:
            return "functions", f"functions {later}"
        if self.function_call not in (None, "none"):
            return "function_call", f"function_call {later}"
        if self.audio is not None or (self.modalities and self.modalities != ["text"]):
            return ("audio" if self.audio is not None else "modalities",
                    "only text output is supported")
        for name, why in (("prediction", "predicted outputs are not supported"),
                          ("web_search_options", "web search is not supported"),
                          ("reasoning_effort", "this model has no reasoning effort setting"),
                          ("verbosity", "verbosity is not supported")):
            if getattr(self, name) is not None:
                return name, why
        if self.store:
            return "store", "stored completions are not supported"
        if self.metadata:
            return "metadata", "metadata is only kept with store, which is not supported"
        for i, m in enumerate(self.messages):
            field = m.unsupported_field()
            if field is not None:
                return "messages", (f"messages[{i}].{field}: tool and function messages "
                                    f"{later}")
        return super().unsupported_field()

    @property
    def num_chars(self) -> int:
        return sum(m.num_chars for m in self.messages)

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, num_logprobs)


def error_body(message: str, type_: str = "BadRequestError", param: str | None = None,
               code: int | str | None = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
