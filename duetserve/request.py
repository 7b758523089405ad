"""Request: one sequence the engine is generating, as the scheduler sees it.

Token positions of a request (block_size 4 in the picture):

    all_token_ids:  | p0 p1 p2 p3 | p4 p5 o0 o1 | o2 .
                    |<- prompt (num_prompt_tokens) ->|<- outputs ->|
                    [0, num_computed_tokens)  KV already in the cache
                    [num_computed_tokens, num_tokens)  still to compute (scheduled in chunks)

Who mutates what (NOTE: the worker never touches a Request):
  - Scheduler.schedule():            status, num_computed_tokens (prefix hit at admission,
                                     0 on preemption), num_preemptions
  - Scheduler.update_from_output():  num_computed_tokens (minus rejected drafts),
                                     output_token_ids/all_token_ids (via
                                     append_output_token_ids), block_hashes,
                                     spec_token_ids and the acceptance counts,
                                     slo_anchor_time/slo_anchor_tokens (first output),
                                     status/finish_reason/stop_reason on finish
  - Scheduler.abort_requests()/finish_requests(): status, finish_reason, stop_reason
  - the engine: eos_token_ids before add_request; for prefill/decode disaggregation (kv_transfer/) also, before
    add_request, kv_hold and max_tokens (a prefill instance stops after the first token
    and holds the blocks) or num_external_tokens and the first output token (a decode
    instance loads the prompt's KV instead of computing it).
  - Scheduler.finish_load(): num_external_tokens back to 0 once the KV is loaded.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from duetserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter a request runs under, as vLLM's: a name (what a server's `model`
    field selects), an integer id unique per adapter (> 0), and the folder of its PEFT
    files (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


class RequestStatus(enum.IntEnum):
    """Lifecycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING)* -> FINISHED_*.

    PREEMPTED is a waiting state: the request sits in the waiting queue with its KV freed.
    """

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6      # its own processing raised inside a step (engine isolation)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASON_TO_STATUS: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0                      # larger = scheduled later (like vLLM)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base)

    # --- state the scheduler owns -------------------------------------------------------
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)   # prompt + outputs, one list
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # chain hash per FULL block
    num_preemptions: int = 0
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None   # stop token id or stop string
    max_tokens: int | None = None          # resolved from sampling_params; None = to max len
    # --- prefill/decode disaggregation (set by the engine before add_request) ------------
    kv_hold: bool = False                  # on finish by length: keep the blocks (producer)
    num_external_tokens: int = 0           # prompt KV to load from a prefill instance
    # Speculative decoding: drafts proposed by the runner for the next step (never part of
    # all_token_ids: they become tokens only once verified), and the request's measured
    # acceptance (drafts accepted; verify steps that rejected one). spec_streak: its last
    # step verified drafts and kept them all; spec_streak_*: the part of the two counts
    # measured on verify steps that came right after such a step (core/spec_schedule.py).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_accepted: int = 0
    spec_num_rejections: int = 0
    spec_streak: bool = False
    spec_streak_accepted: int = 0
    spec_streak_rejections: int = 0
    # Goodput-first scheduling (core/slo.py): the request's TPOT clock, started when its
    # first output token is appended (the time update_from_output was given, and the
    # output count then); None until then.
    slo_anchor_time: float | None = None
    slo_anchor_tokens: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if self.output_token_ids:
            raise ValueError("a new Request must not carry output tokens")
        self.all_token_ids = list(self.prompt_token_ids)
        self.max_tokens = self.sampling_params.max_tokens
        self.eos_token_ids = tuple(self.eos_token_ids)

    # --- derived ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_waiting(self) -> bool:
        return self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled token(s) to output_token_ids and all_token_ids.

        Mutates: output_token_ids, all_token_ids. Block hashes are NOT updated here; the
        scheduler does it (it knows the block size and whether caching is on).
        """
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def set_finished(self, finish_reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished. Mutates: status, finish_reason, stop_reason."""
        try:
            self.status = FINISH_REASON_TO_STATUS[finish_reason]
        except KeyError:
            raise ValueError(f"finish_reason must be one of {sorted(FINISH_REASON_TO_STATUS)}, "
                             f"got {finish_reason!r}") from None
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
