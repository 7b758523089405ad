"""Data passed between the layers of one engine step.

    Scheduler --SchedulerOutput--> ModelRunner --ModelRunnerOutput--> Scheduler/Engine
    Engine --RequestOutput (a delta)--> user;  Engine --StepStats--> metrics observers

`SchedulerOutput` sends a request's full data once (`NewRequestData`: when it is first
scheduled, and again when it resumes after preemption) and only diffs afterwards
(`CachedRequestData`). The runner keeps its own copy of each running request's tokens and
block table; it appends the tokens it samples itself. The runner never sees a Request.

The phase of a step is decided once, by the scheduler: `SchedulerOutput.num_prefill_tokens`
/ `num_decode_tokens` / `decode_req_ids`; `StepStats` carries them to metrics, traces and
benchmarks, which never re-derive it.

Outputs travel as deltas: a `RequestOutput` from `EngineCore.step_deltas()` holds, per
sample that changed, only this step's new token ids, text and logprobs. The cumulative
view is built at the edge that needs it by `OutputAccumulator` (LLM.generate, the
server's non-streaming responses).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from duetserve.request import LoRARequest
from duetserve.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """Full data of a request the runner has not seen (or must forget and re-learn)."""

    req_id: str
    token_ids: list[int]          # every known token: prompt + outputs so far (after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]          # the whole block table
    num_computed_tokens: int      # tokens whose KV is already in the cache (prefix hits)
    lora_request: LoRARequest | None = None   # the adapter its rows run under (None: base)


@dataclass(slots=True)
class CachedRequestData:
    """Diff for a request the runner already holds."""

    req_id: str
    new_block_ids: list[int]      # appended to the runner's block table
    num_computed_tokens: int      # as seen by the scheduler before this step


@dataclass
class SchedulerOutput:
    """One step's work. Tokens scheduled for request r cover positions
    [num_computed_tokens, num_computed_tokens + num_scheduled_tokens[r])."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests finished, aborted or preempted since the last step: the runner drops its state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # The phase of this step, decided once (core/step_plan.StepPlan.to_output): a slice is a
    # decode when it is 1 token, past the prompt, and that token is the last known one.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    decode_req_ids: set[str] = field(default_factory=set)
    # Slices that reach the end of their request's known tokens, so the runner samples
    # them: one row, or k+1 for a verify slice (decided with the phase, in to_output).
    sampled_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding. Drafts to verify: request r's slice ends with these tokens, which
    # sit after its known tokens (num_scheduled_tokens[r] counts them):
    #     [ num_computed .. num_tokens-1 | d_0 .. d_{k-1} ]   k+1 positions with logits
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # How many drafts the runner proposes for r after this step (KV slots for them are
    # allocated when the proposer writes KV, i.e. a draft model).
    num_drafts_to_propose: dict[str, int] = field(default_factory=dict)

    @property
    def phase(self) -> str:
        return step_phase(self.num_prefill_tokens, self.num_decode_tokens)

    def slices(self) -> list[ScheduledSlice]:
        """One ScheduledSlice per scheduled request, in schedule order (running first)."""
        spec = self.scheduled_spec_token_ids
        return [ScheduledSlice(req_id=d.req_id,
                               num_new_tokens=self.num_scheduled_tokens[d.req_id],
                               num_computed_before=d.num_computed_tokens,
                               is_decode=d.req_id in self.decode_req_ids,
                               num_logits=1 + len(spec.get(d.req_id, ()))
                               if d.req_id in self.sampled_req_ids else 0)
                for d in (*self.scheduled_cached_reqs, *self.scheduled_new_reqs)]


PHASES = ("prefill", "decode", "mixed")


def step_phase(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    """"prefill" (no decode tokens), "decode" (no prefill tokens) or "mixed"."""
    if num_decode_tokens == 0:
        return "prefill"
    if num_prefill_tokens == 0:
        return "decode"
    return "mixed"


@dataclass(frozen=True, slots=True)
class ScheduledSlice:
    """One request's part of a step: its new tokens attend to num_computed_before +
    num_new_tokens positions. `is_decode` and `num_logits` are the scheduler's decisions
    (see SchedulerOutput)."""

    req_id: str
    num_new_tokens: int
    num_computed_before: int
    is_decode: bool = False
    num_logits: int = 0            # rows sampled (SchedulerOutput.sampled_req_ids)


@dataclass
class StepStats:
    """What one step did (for metrics, traces and `duet bench throughput`), or, with no
    tokens, a snapshot of queue and KV state (`EngineCore.make_stats`). Build it by
    keyword."""

    start_time: float = 0.0          # time.time() when the step began
    step_seconds: float = 0.0
    num_prefill_tokens: int = 0      # from SchedulerOutput (the scheduler's decision)
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    num_preemptions: int = 0         # cumulative
    prefix_cache_queries: int = 0    # tokens, cumulative
    prefix_cache_hits: int = 0       # tokens found in memory, cumulative
    prefix_cache_disk_hits: int = 0  # tokens loaded from the disk tier, cumulative
    items: list[ScheduledSlice] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # FLOPs, bytes, MFU, MBU of this step: a metrics.step_accounting.StepAccount, set by
    # the engine's accountant (typed loosely: outputs.py sits below metrics/).
    account: object | None = None
    spec: SpecDecodeStats | None = None  # cumulative speculative-decoding counters
    # blocks in use per attention kind ("full", "sliding"): models with sliding-window
    # layers keep their KV in groups of their own (core/kv_cache_manager.py)
    used_blocks_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def phase(self) -> str:
        return step_phase(self.num_prefill_tokens, self.num_decode_tokens)


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class ModelRunnerOutput:
    """What one step produced. `sampled_token_ids[r]` is empty when request r ran a prefill
    chunk that did not reach the end of its known tokens (nothing to sample yet)."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request, per sampled token: {token_id: Logprob} holding the chosen token and top-N.
    logprobs: dict[str, list[dict[int, Logprob]]] | None = None
    # Per request, per prompt position (first position has None): as above.
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] | None = None
    # Drafts proposed for the next step, per request (speculative decoding).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SpecDecodeStats:
    """Cumulative speculative-decoding counters (the scheduler counts; metrics read).

    num_drafts: verify slices (request-steps with >= 1 draft); num_draft_tokens: drafts
    verified; num_accepted_tokens: drafts accepted; accepted_per_pos[j]: how often the
    draft at position j was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify slice: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class CompletionOutput:
    """One of the `n` samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock stamps (time.time()) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    lora_name: str | None = None     # the LoRA adapter it runs under (None: the base)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        end = self.finished_time or self.last_token_time
        return None if end is None else end - self.arrival_time


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt and what the async engine streams."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set (with finished=True, finish_reason "error") when this request's own processing
    # raised inside a step; the other requests of that step were not affected.
    error: str | None = None
    # With `error`: the request field whose value made it fail (a constraint no token of
    # the model can continue; HTTP 400), or None (the engine's own failure; HTTP 500).
    error_param: str | None = None


class OutputAccumulator:
    """The cumulative view of a stream of delta RequestOutputs, assembled once, at the
    edge that needs it (LLM.generate, EngineCore.step, non-streaming responses).

    `add(delta)` returns the request's cumulative RequestOutput: a new RequestOutput each
    call (its `finished` is that step's), sharing one CompletionOutput per sample that
    later adds extend in place (token and logprob lists extended, never copied). Text is
    joined from its pieces when a sample finishes, or on every add with
    `eager_text=True` (callers that read the text of unfinished outputs). Not
    thread-safe. Mutates only its own state and the outputs it returned."""

    def __init__(self, eager_text: bool = False) -> None:
        self.eager_text = eager_text
        self._outs: dict[str, RequestOutput] = {}
        self._pieces: dict[tuple[str, int], list[str]] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        acc = self._outs.get(delta.request_id)
        if acc is None:
            acc = self._outs[delta.request_id] = RequestOutput(
                delta.request_id, delta.prompt, delta.prompt_token_ids, [], False,
                delta.metrics, delta.num_cached_tokens)
        acc.finished, acc.metrics, acc.error = delta.finished, delta.metrics, delta.error
        acc.error_param = delta.error_param
        acc.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            acc.prompt_logprobs = delta.prompt_logprobs
        for d in delta.outputs:
            key = (delta.request_id, d.index)
            pieces = self._pieces.get(key)
            if pieces is None:
                pieces = self._pieces[key] = []
                acc.outputs.append(CompletionOutput(d.index, "", []))
                acc.outputs.sort(key=lambda o: o.index)
            out = next(o for o in acc.outputs if o.index == d.index)
            out.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.extend(d.logprobs)
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
            if d.text:
                pieces.append(d.text)
            if self.eager_text or d.finished:
                if len(pieces) > 1:
                    pieces[:] = ["".join(pieces)]
                out.text = pieces[0] if pieces else ""
        if acc.finished:
            self.forget(delta.request_id)
        return RequestOutput(acc.request_id, acc.prompt, acc.prompt_token_ids,
                             list(acc.outputs), acc.finished, acc.metrics,
                             acc.num_cached_tokens, acc.prompt_logprobs, acc.error,
                             acc.error_param)

    def forget(self, request_id: str) -> None:
        """Drop the state of a request (done automatically when it finishes)."""
        out = self._outs.pop(request_id, None)
        if out is not None:
            for o in out.outputs:
                self._pieces.pop((request_id, o.index), None)
