"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Nothing is silently ignored. Unknown fields are a 400 naming them (as OpenAI answers
"Unrecognized request argument"). OpenAI fields this server does not implement are
declared, so they parse, and `unsupported_field()` names the first one set to anything
but its no-op value (e.g. `functions`, `audio`): the server answers 400 with that
`param`. Range checks live in SamplingParams and the engine's validate_request, which
raise RequestError with `param`; the server turns that into a 400 with `param` set.
Output constraints (`response_format`, `guided_*`) map through guided.py, tools and
tool_choice through tools.py.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from duetserve.entrypoints.openai import guided as guided_fields
from duetserve.sampling_params import GuidedDecoding, SamplingParams


class _Strict(BaseModel):
    """A request object that rejects fields it does not know (an error naming the field), so a
    misspelt parameter is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _check_unicode(value: Any, where: str = "") -> Any:
    """`value` unchanged; ValueError naming the first string in it (keys included, at any
    depth) that holds a lone surrogate. JSON lets a body write \\ud800 alone; Python reads
    it into a str that cannot be encoded, which the tokenizer, llguidance and the chat
    template refuse with messages about their own types (one was a 500)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"{where or 'it'} holds a lone surrogate "
                    f"(U+{ord(value[e.start]):04X} at character {e.start}): not Unicode text "
                    "(a \\ud800-\\udfff escape in JSON must be half of a pair)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, f"{where}key {k!r}" if where else f"key {k!r}")
            _check_unicode(v, f"{where}[{k!r}]" if where else f"[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_unicode(v, f"{where}[{i}]")
    return value


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    @field_validator("*", mode="before")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        """Every string in the body must be Unicode text (no lone surrogates)."""
        return _check_unicode(value)

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
    # Output constraints (guided.py): OpenAI's response_format and vLLM's extras.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted when they ask for nothing (None / their no-op value); else a 400.
    service_tier: str | None = None
    # duetserve's extension: this request's SLO targets in ms (core/slo.py), which may
    # relax the server's --slo-ttft-ms / --slo-tpot-ms (a batch client: "no hurry").
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Prefill/decode disaggregation (kv_transfer/params.py): set by `duet router`.
    kv_transfer_params: dict[str, Any] | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, why) of the first OpenAI field set to something this server does not
        do, or None. Mutates nothing."""
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", "only the default service tier exists"
        return None

    def guided(self) -> GuidedDecoding | None:
        """The output constraint the body asks for; RequestError names a bad field."""
        return guided_fields.from_fields(self.response_format, self.guided_json,
                                         self.guided_regex, self.guided_choice,
                                         self.guided_grammar)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         constraint: GuidedDecoding | None) -> SamplingParams:
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
            logit_bias=self.logit_bias, guided=constraint, slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms)

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
        return self._sampling_params(self.max_tokens, self.logprobs, self.guided())


class TextPart(_Strict):
    type: Literal["text"] = "text"
    text: str


# OpenAI's roles; "developer" is rendered as "system" (what it means for chat models).
# "function" messages belong to the deprecated `functions` API, which is not implemented.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema; None: any object
    strict: bool | None = None                   # constrained output is always strict


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class ToolCallFunction(_Strict):
    name: str
    arguments: str                               # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None     # assistant turns that called tools
    tool_call_id: str | None = None              # tool turns: the call answered
    function_call: Any | None = None

    def unsupported_field(self) -> str | None:
        if self.role == "function":
            return "role"
        if self.function_call:
            return "function_call"
        return None

    @property
    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(p.text) for p in self.content)
        return len(self.content or "") + sum(len(c.function.arguments)
                                             for c in self.tool_calls or ())

    @property
    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields without an implementation here: only their no-op values pass.
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
        legacy = "is the deprecated functions API, which is not supported: use tools"
        if self.functions:
            return "functions", f"functions {legacy}"
        if self.function_call not in (None, "none"):
            return "function_call", f"function_call {legacy}"
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
                return "messages", f"messages[{i}].{field}: function messages {legacy}"
        return super().unsupported_field()

    @property
    def num_chars(self) -> int:
        return sum(m.num_chars for m in self.messages)

    def to_sampling_params(self, constraint: GuidedDecoding | None) -> SamplingParams:
        """`constraint`: the output constraint, from guided() or a forced tool choice."""
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, num_logprobs, constraint)


def error_body(message: str, type_: str = "BadRequestError", param: str | None = None,
               code: int | str | None = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def finite(logprob: float) -> float:
    """A logprob as JSON can carry it (JSON has no -inf)."""
    return max(logprob, -9999.0)
