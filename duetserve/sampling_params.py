"""SamplingParams: how one request's tokens are chosen and when it stops.

Frozen and validated at construction; errors name the bad field and its allowed range.
Token ids are checked against the vocabulary separately, by `validate_for_vocab`, which
the engine calls when a request is added (the params object does not know the model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from duetserve.errors import RequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
MAX_SLO_MS = 86_400_000.0   # a day: per-request SLO targets (slo_ttft_ms, slo_tpot_ms)
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


# The seed range torch.Generator.manual_seed accepts, kept as the API's limit (seeded
# uniforms are a hash of the seed, worker/seeded.py).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class SamplingParamsError(RequestError):
    """A sampling parameter is outside its allowed range; the message and `param` name it.

    A ValueError (through RequestError), so user code may catch either."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on the output: only token sequences the grammar accepts are sampled.

    `spec` by kind: "json" a JSON schema (JSON text), "json_object" unused (any JSON
    object), "regex" a regular expression (Rust `regex` syntax), "choice" a JSON list of
    strings (the output is exactly one of them), "grammar" a Lark grammar (llguidance's
    dialect), "tool_calls" a JSON object {"tools": [{"name", "parameters"}], "parallel":
    bool} (one or more calls in the tool-call syntax, see structured/tool_syntax.py).
    `param` names the request field it came from, for error messages; it is not part of
    the grammar's identity (two requests with the same kind and spec share one compiled
    grammar). Compiled and checked by `duetserve.structured`, not here."""

    kind: str
    spec: str = ""
    param: str = field(default="guided", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise SamplingParamsError(f"guided decoding kind must be one of {GUIDED_KINDS}, "
                                      f"got {self.kind!r}", self.param)
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise SamplingParamsError(f"{self.param}: the {self.kind} constraint is empty",
                                      self.param)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0                  # (0, 1]; 1 = off
    top_k: int = -1                     # -1 or 0 = off, else >= 1
    min_p: float = 0.0                  # [0, 1]; 0 = off
    presence_penalty: float = 0.0       # [-2, 2], over output tokens
    frequency_penalty: float = 0.0      # [-2, 2], over output tokens
    repetition_penalty: float = 1.0     # > 0, over prompt + output tokens; 1 = off
    seed: int | None = None
    max_tokens: int | None = 16         # None = up to the context limit
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # top-N logprobs per generated token (0..20)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (0..20)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    guided: GuidedDecoding | None = None   # constrained decoding (structured output)
    # This request's SLO targets (core/slo.py) in ms; None: the server's
    # (--slo-ttft-ms / --slo-tpot-ms). The engine refuses values tighter than the server's.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        """Normalise containers (str/list -> tuple, logit_bias copied with int keys) and
        validate every field. Raises SamplingParamsError naming the first bad field."""
        self._normalise()
        self._validate_numbers()
        self._validate_stops()
        self._validate_guided()

    # -- construction helpers (only called from __post_init__) -------------------------

    def _normalise(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            set_(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            set_(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            # NOTE: copied so a caller mutating its dict cannot change a frozen params object.
            # Keys may be digit strings (OpenAI JSON sends {"1234": 5}).
            bias: dict[int, float] = {}
            for key, value in dict(self.logit_bias).items():
                try:
                    token_id = int(key)
                except (TypeError, ValueError):
                    raise SamplingParamsError(
                        f"logit_bias keys must be token ids (int), got {key!r}",
                        "logit_bias") from None
                if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise SamplingParamsError(
                        f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, "
                        f"{MAX_LOGIT_BIAS:g}], got {value!r}", "logit_bias")
                if token_id < 0:
                    raise SamplingParamsError(
                        f"logit_bias token id must be >= 0, got {token_id}", "logit_bias")
                bias[token_id] = float(value)
            set_(self, "logit_bias", bias)

    def _validate_numbers(self) -> None:
        def bad(name: str, allowed: str) -> SamplingParamsError:
            return SamplingParamsError(
                f"{name} must be {allowed}, got {getattr(self, name)!r}", name)

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not _is_real(self.temperature) or self.temperature < 0 \
                or math.isinf(self.temperature):
            raise bad("temperature", ">= 0 (0 = greedy)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "-1 or 0 (off) or an integer >= 1")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise bad(name, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0 \
                or math.isinf(self.repetition_penalty):
            raise bad("repetition_penalty", "> 0 (1 = off)")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not MIN_SEED <= self.seed <= MAX_SEED - (self.n - 1)):
            # NOTE: sample i of n uses seed + i (clone_for_sample), so the top shrinks by n-1.
            raise bad("seed", f"None or an integer in [{MIN_SEED}, {MAX_SEED}]"
                      + (f" minus n-1 = {self.n - 1} (sample i uses seed + i)"
                         if self.n > 1 else ""))
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and (not _is_real(value) or not 0 < value <= MAX_SLO_MS):
                raise bad(name, f"None or a number of ms in (0, {MAX_SLO_MS:g}]")

    def _validate_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError(
                    f"stop strings must be non-empty str, got {s!r} in stop={self.stop!r}",
                    "stop")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise SamplingParamsError(
                    f"stop_token_ids must be token ids (int >= 0), got {t!r}",
                    "stop_token_ids")

    def _validate_guided(self) -> None:
        if self.guided is None:
            return
        if not isinstance(self.guided, GuidedDecoding):
            raise SamplingParamsError(f"guided must be a GuidedDecoding, got "
                                      f"{type(self.guided).__name__}", "guided")
        # NOTE: the grammar decides where the output ends (it allows only EOS once
        # complete); a rule that forbids or ignores EOS would make the two disagree.
        if self.ignore_eos:
            raise SamplingParamsError(
                f"ignore_eos cannot be combined with {self.guided.param}: the grammar ends "
                "the output with EOS", "ignore_eos")
        if self.min_tokens > 0:
            raise SamplingParamsError(
                f"min_tokens cannot be combined with {self.guided.param}: the grammar "
                "decides where the output ends", "min_tokens")

    # -- queries -------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise SamplingParamsError naming the first token id in logit_bias or
        stop_token_ids that is not in [0, vocab_size). Mutates nothing."""
        for token_id in (self.logit_bias or {}):
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"logit_bias token id {token_id} is not in the vocabulary "
                    f"(valid ids: 0..{vocab_size - 1})", "logit_bias")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids token id {token_id} is not in the vocabulary "
                    f"(valid ids: 0..{vocab_size - 1})", "stop_token_ids")

    def clone_for_sample(self, index: int) -> "SamplingParams":
        """Params for sample `index` (0 <= index < n) of this request: n=1 and, when seeded,
        seed + index, so the n samples of a seeded request differ but stay reproducible.
        Returns a new object; self is unchanged."""
        if not 0 <= index < self.n:
            raise SamplingParamsError(f"sample index must be in [0, {self.n}), got {index}",
                                      "n")
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
