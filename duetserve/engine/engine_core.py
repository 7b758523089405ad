"""EngineCore: one engine step = schedule -> execute -> update -> outputs.

    add_request ──> validate_request (the one validation) ──> Scheduler.waiting
    step_deltas():
             SchedulerOutput = scheduler.schedule()           (the step's phase decided)
             ModelRunnerOutput = runner.execute_model(SchedulerOutput)
             updated = scheduler.update_from_output(...)      (append tokens, token stops)
             per updated sample: new ids, new text (detokenizer, stop strings ->
             scheduler.finish_requests), new logprobs
             -> list[RequestOutput]  (deltas: one per user request that changed)
             StepStats -> step observers                      (_record_step)
    step():  step_deltas() assembled into cumulative outputs (offline callers)

A user request with n > 1 becomes n child requests `{req_id}-{i}` that share the prompt's
KV blocks through the prefix cache; their outputs are gathered in one RequestOutput.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from duetserve.config import EngineConfig, SchedulerConfig
from duetserve.core.scheduler import Scheduler, SchedulerStats
from duetserve.core.slo import SloPolicy, slo_policy_for
from duetserve.core.step_budget import (FALLBACK_TOKEN_BUDGET, StepBudget,
                                        default_max_step_ms, derive_step_budget)
from duetserve.core.step_time import StepTime
from duetserve.engine.detokenizer import IncrementalDetokenizer
from duetserve.engine.disk_cache import open_disk_cache
from duetserve.engine.isolation import Failure, IsolatedExecutor
from duetserve.engine.kv_roles import KVRoles, make_shared_kv
from duetserve.engine.step_probe import (StepTimeSource, forward_seconds, read_step_time,
                                         startup_step_time)
from duetserve.errors import EngineOverloadedError, LoRAError, RequestError
from duetserve.kv_transfer import KVTransferConfig
from duetserve.loader import LoadedModel, load_model, release_free_memory
from duetserve.metrics.step_accounting import StepAccountant
from duetserve.metrics.trace import TraceWriter
from duetserve.models.kernels import compute_by_rows
from duetserve.outputs import (CompletionOutput, ModelRunnerOutput, OutputAccumulator,
                               RequestMetrics, RequestOutput, SchedulerOutput, StepStats)
from duetserve.request import LoRARequest, Request
from duetserve.sampling_params import SamplingParams
from duetserve.spec_decode.factory import build_speculator, spec_policy_for
from duetserve.structured import GrammarCompiler
from duetserve.worker.kv_cache import (kv_block_bytes, kv_bytes_per_token, kv_dtype_name,
                                       kv_storage_dtype, num_blocks_for_memory)
from duetserve.worker.lora_slots import LoRASlots
from duetserve.worker.model_runner import ModelRunner

log = logging.getLogger("duetserve")


@dataclass
class _Child:
    """Engine-side bookkeeping for one sample of a user request. Its tokens live in
    `request` (the one owner); the engine keeps only how many it has handed out."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    num_output_tokens: int = 0      # of request.output_token_ids already in a delta
    finished: bool = False
    # disaggregation, decode side: the prefill instance's first token (ids, text,
    # logprobs), put in front of the sample's first delta
    seed: CompletionOutput | None = None


@dataclass
class _UserRequest:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _Child]
    metrics: RequestMetrics
    num_unfinished: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None


StepObserver = Callable[[StepStats], None]
__all__ = ["EngineCore", "StepObserver", "StepStats"]   # StepStats: re-exported


def _step_stats(st: SchedulerStats, **step: object) -> StepStats:
    """StepStats with the scheduler's queue, KV and cache counters plus `step`'s fields
    (none: a snapshot that is not a step)."""
    return StepStats(num_running=st.num_running, num_waiting=st.num_waiting,
                     kv_usage=st.kv_usage, num_used_blocks=st.num_used_blocks,
                     used_blocks_by_kind=st.used_blocks_by_kind,
                     num_preemptions=st.num_preemptions,
                     prefix_cache_queries=st.prefix_cache_queries,
                     prefix_cache_hits=st.prefix_cache_hits,
                     prefix_cache_disk_hits=st.prefix_cache_disk_hits, spec=st.spec, **step)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 kv_transfer: KVTransferConfig | None = None) -> None:
        """`loaded`: reuse weights already in memory (tests build several engines on one
        model); it must have been loaded with config.model, config.dtype and the same
        kernel switches. `kv_transfer`: this instance's role in prefill/decode
        disaggregation (None: both). Start-up in order: threads and seed, weights, KV
        cache size, runner (with the speculator), the step time (measured or read) and
        from it the step budget and speculation policy, scheduler, request state."""
        self.config = config
        self.num_threads = config.num_threads or min(os.cpu_count() or 1, 16)
        torch.set_num_threads(self.num_threads)
        torch.manual_seed(config.seed)
        self.loaded = loaded or load_model(config.model, config.dtype, config.device,
                                           max_positions=config.max_model_len,
                                           quantization=config.quantization,
                                           **config.load_options())
        log.info("model %s: %s", self.loaded.path, self.loaded.describe())
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)   # resolved by the loader
        self._size_kv_cache()
        # Constrained decoding: grammars compiled once per spec (the llguidance tokenizer
        # is built on the first guided request, so unconstrained serving never pays it).
        self.grammars = GrammarCompiler(self.tokenizer.to_json, self.model_config.vocab_size,
                                        self.eos_token_ids, self.num_threads)
        kv_transfer = kv_transfer or KVTransferConfig()
        shared = self._build_runner(kv_transfer)
        self._build_scheduler()
        self.scheduler.lora_ready = self.runner.lora.ready   # adapters read off the loop
        self._lora_unloaded: set[int] = set()   # freed once no request uses them
        self.disk_cache = open_disk_cache(config, self.loaded, self.model_config,
                                          self.kv_dtype, self.runner.kv_caches)
        if self.disk_cache is not None:
            self.scheduler.disk = self.disk_cache.tier
        self.executor = IsolatedExecutor(self.runner.execute_model, self.scheduler)
        self.kv_roles = None if shared is None else KVRoles(
            kv_transfer, shared[0], shared[1], self.scheduler, self.max_model_len)
        self.requests: dict[str, _UserRequest] = {}
        self._child_to_user: dict[str, str] = {}
        self._cumulative = OutputAccumulator(eager_text=True)    # for step() only
        self.last_step = StepStats()
        self._ran_since_idle = False     # steps ran since the engine was last idle
        self._init_observers()

    def _size_kv_cache(self) -> None:
        """Sets kv_dtype, max_model_len and num_blocks from the config and the model."""
        config, mcfg = self.config, self.model_config
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.loaded.dtype)
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings if config.max_model_len is None
                                 else config.max_model_len)
        self.num_blocks = config.num_gpu_blocks_override or num_blocks_for_memory(
            mcfg, self.kv_dtype, config.block_size, config.kv_cache_memory)
        groups = mcfg.kv_groups()
        # tokens of KV that fit (each position takes a block in every group: a bound)
        self.kv_capacity_tokens = self.num_blocks * config.block_size // len(groups)
        self.kv_bytes_per_token = kv_bytes_per_token(mcfg, self.kv_dtype)
        log.info("KV cache: %d blocks x %d tokens (%.2f GiB of %s, %d B/token of full "
                 "attention; %s); max_model_len %d; model loaded in %.1f s",
                 self.num_blocks, config.block_size,
                 self.num_blocks * kv_block_bytes(mcfg, self.kv_dtype, config.block_size)
                 / 2**30, kv_dtype_name(self.kv_dtype), self.kv_bytes_per_token,
                 f"{self.kv_capacity_tokens} tokens fit" if len(groups) == 1 else
                 f"{len(groups)} groups of {mcfg.kv_layers_per_block} layers, sliding "
                 f"window {mcfg.sliding_window}: at least {self.kv_capacity_tokens} "
                 "tokens fit", self.max_model_len,
                 self.loaded.load_seconds)

    def _build_runner(self, kv_transfer: KVTransferConfig):
        """Sets speculator and runner (its KV cache in shareable memory when the instance
        is disaggregated). Returns make_shared_kv's (memory, layout), or None."""
        config, mcfg = self.config, self.model_config
        shared = None
        if kv_transfer.is_disaggregated:      # the cache in shared memory
            shared = make_shared_kv(kv_transfer, mcfg.kv_layers_per_block,
                                    mcfg.num_key_value_heads, self.num_blocks,
                                    config.block_size, mcfg.head_dim, self.kv_dtype)
        spec = config.speculative_config
        self.speculator = None if spec is None else build_speculator(
            spec, self.loaded, mcfg, self.num_blocks, config.block_size, self.kv_dtype,
            config.dtype, config.device, config.max_model_len, config.load_options())
        self.runner = ModelRunner(self.loaded.model, mcfg, self.num_blocks,
                                  config.block_size, self.kv_dtype, config.device,
                                  self.grammars,
                                  kv_buffer=shared[1].tensor if shared else None,
                                  speculator=self.speculator,
                                  kv_prefault=config.kv_prefault,
                                  deterministic=config.deterministic,
                                  lora_slots=LoRASlots(mcfg, config.max_loras,
                                                       config.max_lora_rank,
                                                       self._lora_weight_dtype(),
                                                       huge_pages=config.huge_pages))
        return shared

    def _lora_weight_dtype(self) -> torch.dtype:
        """--lora-dtype resolved against the loaded base; logged. auto: int8 on a base whose
        linears are low-bit (a step streams every adapter of its rows, and int8's rounding
        is far below the base's own error: docs/results.md), else the base's dtype."""
        if self.config.lora_dtype != "auto":
            dtype = getattr(torch, self.config.lora_dtype)
        else:
            dtype = torch.int8 if self.loaded.kernel_policy is not None else self.loaded.dtype
        log.info("LoRA weights: %s (--lora-dtype %s)", str(dtype).split(".")[-1],
                 self.config.lora_dtype)
        return dtype

    def _build_scheduler(self) -> None:
        """Sets step_time (the one model of step cost, core/step_time.py) and where it came
        from, the token budget (max_num_batched_tokens, step_budget, max_step_ms), the
        speculation policy and the scheduler."""
        config = self.config
        self.step_time, self.step_time_source = self._resolve_step_time()
        self.max_step_ms: float | None = None
        self.step_budget: StepBudget | None = None
        self.max_num_batched_tokens = self._resolve_token_budget()
        self.slo_policy = self._resolve_slo_policy()
        spec = config.speculative_config
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            step_budget=self.step_budget, slo=self.slo_policy,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            block_size=config.block_size, num_blocks=self.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_waiting=config.max_waiting_requests, max_loras=config.max_loras,
            spec_policy=None if spec is None else spec_policy_for(
                spec, self.speculator.needs_lookahead, self.step_time,
                self._draft_seconds()),
            kv_windows=tuple(g.window for g in self.model_config.kv_groups())))

    def _resolve_step_time(self) -> tuple[StepTime | None, StepTimeSource]:
        """The step-time model: read from config.step_time, else measured at start-up (or
        cached) when something prices steps (a derived budget, adaptive speculation),
        else none. Logged with where it came from."""
        config = self.config
        spec = config.speculative_config
        if config.step_time is not None:
            model = read_step_time(config.step_time)
            source = StepTimeSource("file", config.step_time)
        elif config.max_num_batched_tokens is None or (spec is not None and spec.adaptive):
            model, source = startup_step_time(
                self.runner, self.loaded.path, config.kernel_switches(), self.num_threads,
                self.model_config.vocab_size, self.model_config.num_attention_heads,
                config.block_size,
                # a probe's blocks are taken in every KV group (none released)
                min(self.max_model_len - 1, self.num_blocks // len(self.runner.kv_windows)
                    * config.block_size))
            release_free_memory()        # the measurement's activations, back to the OS
        else:
            return None, StepTimeSource("none", "fixed budget, no adaptive speculation")
        if model is None:
            log.info("step time: none (%s)", source.detail)
        else:
            log.info("step time %s (%s): %s", source.how, source.detail, model.describe())
        return model, source

    def _resolve_token_budget(self) -> int:
        """The largest step token budget: the explicit max_num_batched_tokens, else the
        idle budget of a StepBudget derived from the step-time model (core/step_budget.py),
        which re-derives each step's budget from its decodes; FALLBACK_TOKEN_BUDGET when
        there is no plausible model. Sets max_step_ms and step_budget when derived."""
        config = self.config
        if config.max_num_batched_tokens is not None:
            log.info("step budget: fixed, %d tokens (--max-num-batched-tokens)",
                     config.max_num_batched_tokens)
            return config.max_num_batched_tokens
        if self.step_time is None:
            log.info("step budget: fixed, %d tokens (no step-time model)",
                     FALLBACK_TOKEN_BUDGET)
            return FALLBACK_TOKEN_BUDGET
        budget, self.step_budget = derive_step_budget(self.step_time, config.max_step_ms,
                                                      config.max_num_seqs)
        if self.step_budget is None:
            log.warning("step budget: fixed, %d tokens (implausible step-time model)",
                        budget)
            return budget
        self.max_step_ms = config.max_step_ms or default_max_step_ms(self.step_time)
        log.info("step budget: %s", self.step_budget.describe())
        return budget

    def _resolve_slo_policy(self) -> SloPolicy | None:
        """The goodput-first policy (core/slo.py) for --scheduling-policy slo over a
        derived budget; None (logged) otherwise."""
        config = self.config
        if config.scheduling_policy != "slo":
            log.info("scheduling: fcfs (--scheduling-policy fcfs)")
            return None
        if self.step_budget is None:
            log.info("scheduling: fcfs (goodput-first scheduling needs the derived step "
                     "budget, not a fixed one)")
            return None
        policy = slo_policy_for(self.step_budget, config.scheduling_policy,
                                config.slo_ttft_ms, config.slo_tpot_ms)
        log.info("scheduling: %s", policy.describe())
        return policy

    def _draft_seconds(self) -> float:
        """A draft model's cost per proposed token (its 1-row forward, measured now);
        0 without a draft model or adaptive speculation."""
        spec, draft = self.config.speculative_config, self.speculator.draft
        if spec is None or not spec.adaptive or draft is None:
            return 0.0
        return forward_seconds(draft.model, draft.kv_caches, draft.block_size,
                               draft.vocab_size, 1, draft.paged_decode, num_ids=draft.num_ids)

    def _init_observers(self) -> None:
        """Sets step_observers, the accountant (FLOPs, bytes, MFU/MBU of every step) and
        the trace writer (when config.trace_file)."""
        self.step_observers: list[StepObserver] = []
        self.accountant = StepAccountant(self.model_config, self.loaded.weight_bytes,
                                         kv_dtype_name(self.kv_dtype),
                                         compute_of=compute_by_rows(self.loaded.model))
        self.trace: TraceWriter | None = None
        if self.config.trace_file:
            self.trace = TraceWriter(self.config.trace_file, self.accountant,
                                     flush_every_s=5.0)
            self.step_observers.append(self.trace.observe)

    def resolved_config(self) -> dict:
        """What this engine runs with, for `duet serve --print-config` and the logs: the
        EngineConfig's fields, the values resolved at start-up (threads, context, KV
        blocks, budget, kernels) and the step-time model with where it came from (the
        file `--step-time` takes to schedule the same way elsewhere)."""
        return {"engine": self.config.to_json(),
                "resolved": {"model": self.loaded.path, "num_threads": self.num_threads,
                             "max_model_len": self.max_model_len,
                             "num_blocks": self.num_blocks,
                             "kv_capacity_tokens": self.kv_capacity_tokens,
                             "kv_cache_dtype": kv_dtype_name(self.kv_dtype),
                             "max_num_batched_tokens": self.max_num_batched_tokens,
                             "max_step_ms": self.max_step_ms,
                             "step_budget": self.step_budget.describe()
                             if self.step_budget is not None else None,
                             "scheduling": self.slo_policy.describe()
                             if self.slo_policy is not None else "fcfs",
                             "kernels": self.loaded.describe()},
                "step_time": None if self.step_time is None else self.step_time.to_json(),
                "step_time_source": {"how": self.step_time_source.how,
                                     "detail": self.step_time_source.detail}}

    # -- requests ----------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams,
                         lora_request: LoRARequest | None = None) -> None:
        """Everything about a request that could make it fail inside a step is checked
        here, at admission: prompt length and token ids, n, the sampling params against
        the vocabulary (seeds, ranges and stop lists are checked when the SamplingParams
        is built), the grammar of a guided request (compiled and cached), the LoRA adapter
        (its files against the model and max_lora_rank; param "model"). Raises
        RequestError whose `param` names the field. Reads only immutable state and the
        thread-safe grammar cache, so any thread may call it."""
        num = len(prompt_token_ids)
        self.scheduler.check_prompt_len(num)
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids
                    if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is not in the vocabulary "
                               f"(valid ids: 0..{vocab - 1})", "prompt")
        if params.n > self.config.max_n:
            raise RequestError(f"n must be at most {self.config.max_n} (max_n), got "
                               f"{params.n}", "n")
        if params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({num} tokens) exceeds "
                f"the context of {self.max_model_len} tokens (max_model_len); ask for at "
                f"most {self.max_model_len - num}", "max_tokens")
        params.validate_for_vocab(vocab)
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            own, server = getattr(params, name), getattr(self.config, name)
            if own is not None and own < server:
                raise RequestError(f"{name} may relax the server's target, not tighten it: "
                                   f"at least {server:g} ms, got {own:g}", name)
        if lora_request is not None:
            try:
                self.runner.lora.check(lora_request)
            except LoRAError as e:
                raise RequestError(str(e), "model") from None
        if params.guided is not None:
            # Compiled here once (the server does it first on a worker thread, so this
            # is a cache hit there): an invalid grammar never reaches a step.
            self.grammars.compile(params.guided)

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue. Raises RequestError (nothing queued) naming the limit, or
        EngineOverloadedError when the waiting queue has no room for its n samples.
        `arrival_time` (time.time()) is when the request reached the system (the server
        stamps the HTTP arrival); queue time and TTFT are measured from it.
        `lora_request`: the LoRA adapter it runs under (None: the base model)."""
        if req_id in self.requests:
            raise RequestError(f"request id {req_id!r} is already in use")
        self.validate_request(prompt_token_ids, params, lora_request)
        kvp = None if self.kv_roles is None else self.kv_roles.check(
            req_id, len(prompt_token_ids), params.n, params.max_tokens)
        if not self.scheduler.has_room(params.n):
            raise EngineOverloadedError(
                f"the server is overloaded: {self.scheduler.num_waiting} requests are "
                f"waiting (max_waiting_requests {self.config.max_waiting_requests}); retry "
                "later")
        arrival = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone_for_sample(i)
            child_id = req_id if params.n == 1 else f"{req_id}-{i}"
            # NOTE: the Request copies the prompt once; the user request shares that copy.
            req = Request(child_id, prompt_token_ids, child_params, self.eos_token_ids,
                          arrival, priority, lora_request=lora_request)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           child_params.skip_special_tokens, child_params.stop,
                                           child_params.include_stop_str_in_output)
            children.append(_Child(i, req, detok))
            if kvp is not None:
                self._prepare_remote(children[-1], kvp)
        user = _UserRequest(req_id, prompt, children[0].request.prompt_token_ids,
                            {c.request.req_id: c for c in children},
                            RequestMetrics(arrival, num_prompt_tokens=len(prompt_token_ids),
                                           lora_name=lora_request and lora_request.lora_name))
        children = [c.request for c in children]
        for req in children:   # all validated before any is queued
            self.scheduler.add_request(req)
            self._child_to_user[req.req_id] = req_id
            if self.trace is not None:
                self.trace.request_arrived(req.req_id, arrival, len(prompt_token_ids))
        user.num_unfinished = len(children)
        self.requests[req_id] = user

    def _prepare_remote(self, child: _Child, kvp) -> None:
        """Disaggregation: a producer holds its KV after the first token; a consumer
        starts from the prefill's first token, detokenized here on its own as the
        colocated engine would have, and handed out with the sample's first delta.
        Mutates child (seed, count, detokenizer) and, via kv_roles, its Request."""
        first = self.kv_roles.prepare(child.request, kvp)
        if first is None:
            return
        lps = self.kv_roles.first_logprobs(child.request.req_id)
        wants = child.request.sampling_params.logprobs is not None and lps is not None
        child.seed = CompletionOutput(child.index, child.detok.add_tokens([first]) or "",
                                      [first], [lps] if wants else None)
        child.num_output_tokens = 1

    def has_work_now(self) -> bool:
        """Whether step() has something to do now (requests loading KV do not count);
        the async engine sleeps otherwise, at most seconds_to_next_deadline()."""
        if self.scheduler.has_schedulable_requests():
            return True
        if self.disk_cache is not None and self.disk_cache.has_results:
            return True
        if self.runner.lora.reads_done.is_set():       # an adapter's weights were read
            return True
        return self.kv_roles is not None and self.kv_roles.has_work_now()

    def seconds_to_next_deadline(self) -> float | None:
        return None if self.kv_roles is None else self.kv_roles.seconds_to_next_deadline()

    def abort_request(self, req_ids: str | list[str]) -> None:
        """Abort user requests (unknown ids ignored); frees their KV blocks at once and
        replaces last_step with a snapshot that shows it (/load reads last_step)."""
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            user = self.requests.pop(req_id, None)
            if user is None:
                continue
            self.scheduler.abort_requests(list(user.children))
            self._cumulative.forget(req_id)
            for child_id in user.children:
                self._child_to_user.pop(child_id, None)
                if self.kv_roles is not None:
                    self.kv_roles.forget(child_id)
        self._free_unloaded_loras()             # and reads no request waits for now
        self.last_step = self.make_stats()
        if not self.requests:
            self._on_idle()

    def release_lora(self, lora_int_id: int) -> bool:
        """An adapter was unloaded (no new request names it): free its weights (and
        reads ahead) now, or, while requests admitted under it are unfinished (running
        or waiting), once the last of them ends (as vLLM, they finish under it).
        Returns whether its weights were freed now. A later request for the same
        LoRARequest reads it again."""
        self._lora_unloaded.add(lora_int_id)
        return lora_int_id in self._free_unloaded_loras()

    def _free_unloaded_loras(self) -> set[int]:
        """Free the weights and reads of unloaded adapters no unfinished request uses.
        Returns the ids whose resident weights were freed."""
        used = {r.lora_request.lora_int_id for r in self.scheduler.requests.values()
                if r.lora_request is not None}
        idle = self._lora_unloaded - used
        self._lora_unloaded -= idle
        self.runner.lora.drop_reads(used)
        return {i for i in idle if self.runner.lora.evict(i) is not None}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------
    def add_step_observer(self, fn: StepObserver) -> None:
        """`fn(stats)` is called after every step that ran tokens (metrics, traces)."""
        self.step_observers.append(fn)

    def step_deltas(self) -> list[RequestOutput]:
        """One step: schedule -> execute -> update -> outputs. Returns one RequestOutput per
        user request that changed, holding only this step's part of each sample that
        changed (new token ids, new text, new logprobs, finish state): see
        _make_outputs. Observers get the step's StepStats."""
        t0, start = time.perf_counter(), time.time()
        if self.disk_cache is not None:
            if self.kv_roles is None:        # (transfers need polling: never wait then)
                self.disk_cache.wait_if_idle(self.scheduler)
            self.disk_cache.poll(self.scheduler)
        load_failures = {} if self.kv_roles is None else {
            r.req_id: error for r, error in self.kv_roles.poll()}
        if self.kv_roles is None and not self.has_work_now():
            self.runner.lora.wait_for_read()     # offline callers step in a loop
        self.runner.lora.reads_done.clear()
        so = self.scheduler.schedule(start)
        if self.kv_roles is not None:
            self.kv_roles.start_loads()
        if self.disk_cache is not None:
            self.disk_cache.start_loads()
        self._stamp_scheduled(so)
        ro, failed = self.executor.execute(so)
        failed_users = self._fail_children({**load_failures, **failed})
        updated = self.scheduler.update_from_output(so, ro, time.time())
        if self.disk_cache is not None:
            self.disk_cache.write()
        outputs = self._make_outputs(updated, ro, failed_users)
        if self._lora_unloaded:
            self._free_unloaded_loras()
        self._record_step(so, outputs, start, time.perf_counter() - t0)
        return outputs

    def step(self) -> list[RequestOutput]:
        """step_deltas() assembled into cumulative RequestOutputs (each sample's
        CompletionOutput is shared and extended in place by later steps), for offline
        callers that look at every step.
        Use either step() or step_deltas() on one engine, not both."""
        return [self._cumulative.add(delta) for delta in self.step_deltas()]

    def _stamp_scheduled(self, so: SchedulerOutput) -> None:
        """First-scheduled time and prefix-cache hits of requests scheduled for the first
        time. Mutates the user requests' metrics."""
        now = time.time()
        for new in so.scheduled_new_reqs:
            user = self.requests.get(self._child_to_user.get(new.req_id, ""))
            if user is not None and user.metrics.first_scheduled_time is None:
                user.metrics.first_scheduled_time = now
                user.num_cached_tokens = new.num_computed_tokens
                user.metrics.num_cached_tokens = new.num_computed_tokens

    def _make_outputs(self, updated: list[Request], ro: ModelRunnerOutput,
                      failed_users: dict[str, tuple[_UserRequest, Failure]]
                      ) -> list[RequestOutput]:
        """The engine's output assembly: one delta RequestOutput per user request with an
        updated sample, plus one error output per failed user request. Mutates: the
        children's detokenizers and counts, the users' metrics and prompt logprobs,
        `failed_users` (a sample whose output processing raises fails its user request),
        and the scheduler (a stop string finishes its request). Finished user requests
        are forgotten. Nothing it returns is mutated later."""
        now = time.time()
        changed: dict[str, tuple[_UserRequest, list[CompletionOutput]]] = {}
        for req in updated:
            user_id = self._child_to_user.get(req.req_id)
            user = self.requests.get(user_id) if user_id else None
            if user is None:
                continue
            child = user.children[req.req_id]
            try:
                if (ro.prompt_logprobs and req.req_id in ro.prompt_logprobs
                        and child.index == 0):
                    user.prompt_logprobs = ro.prompt_logprobs[req.req_id]
                delta = self._sample_delta(user, child, ro.logprobs, now)
            except Exception as e:  # noqa: BLE001 - this request's output failed, not the step
                log.exception("processing the output of %s failed", req.req_id)
                failed_users.update(self._fail_children(
                    {req.req_id: f"{type(e).__name__}: {e}"}))
                continue
            changed.setdefault(user.req_id, (user, []))[1].append(delta)
        outputs = [self._user_output(user, deltas) for user_id, (user, deltas)
                   in changed.items() if user_id not in failed_users]
        outputs += [self._error_output(u, error) for u, error in failed_users.values()]
        return outputs

    def _record_step(self, so: SchedulerOutput, outputs: list[RequestOutput],
                     start: float, seconds: float) -> None:
        """The step's StepStats (phase from the SchedulerOutput) -> last_step, the
        accountant and every observer (only when tokens ran); the idle check."""
        stats = _step_stats(self.scheduler.make_stats(), start_time=start,
                            step_seconds=seconds, num_prefill_tokens=so.num_prefill_tokens,
                            num_decode_tokens=so.num_decode_tokens, items=so.slices(),
                            finished_req_ids=[o.request_id for o in outputs if o.finished])
        self.last_step = stats
        if stats.items:
            self._ran_since_idle = True
            stats.account = self.accountant.observe(stats)
            for fn in self.step_observers:
                fn(stats)
        if not self.requests:
            self._on_idle()

    def _on_idle(self) -> None:
        """The engine has no requests: the first time after steps ran, hand the memory the
        steps freed (prefill transients, in glibc's arenas) back to the OS; with the debug
        flag, check the scheduler's queues, block tables and block pool (AssertionError on
        a broken invariant). Mutates self._ran_since_idle."""
        if self._ran_since_idle:
            self._ran_since_idle = False
            release_free_memory()
        if self.config.check_integrity_when_idle:
            self.scheduler.check_integrity()
            remote = self.scheduler.remote      # held or orphaned blocks may remain
            assert self.scheduler.kv_cache_manager.num_used_blocks == 0 or remote.held \
                or remote.orphaned, (
                f"idle engine holds {self.scheduler.kv_cache_manager.num_used_blocks} blocks")

    def _fail_children(self, failed: dict[str, Failure]
                       ) -> dict[str, tuple[_UserRequest, Failure]]:
        """Fail the user requests owning the failed children (with all their siblings):
        finish reason "error", blocks freed (the ones this step was filling uncached).
        Returns {user req_id: (user, error text or RequestError)}; forgets them."""
        users: dict[str, tuple[_UserRequest, str]] = {}
        for child_id, error in failed.items():
            user_id = self._child_to_user.get(child_id)
            if user_id is not None and user_id not in users:
                users[user_id] = (self.requests[user_id], error)
        for user_id, (user, _) in users.items():
            self.scheduler.fail_requests(list(user.children))
            self.requests.pop(user_id, None)
            for child_id in user.children:
                self._child_to_user.pop(child_id, None)
        return users

    def _error_output(self, user: _UserRequest, error: Failure) -> RequestOutput:
        """The failed user request's last delta: every sample not yet finished ends with
        finish_reason "error"; a RequestError names its field (error_param)."""
        user.metrics.finished_time = time.time()
        outs = [CompletionOutput(c.index, "", [], finish_reason="error")
                for c in user.children.values() if not c.finished]
        return RequestOutput(user.req_id, user.prompt, user.prompt_token_ids, outs, True,
                             user.metrics, user.num_cached_tokens, user.prompt_logprobs,
                             error=f"request {user.req_id} failed: {error}",
                             error_param=error.param if isinstance(error, RequestError)
                             else None)

    def make_stats(self) -> StepStats:
        """A snapshot of queue and KV state; no tokens (also used outside a step, e.g.
        after aborts, where observers must not count it as a step)."""
        return _step_stats(self.scheduler.make_stats())

    def shutdown(self) -> None:
        """Flush and close the trace file (if any); finish the disk tier's loads and
        queued writes. Idempotent."""
        if self.trace is not None:
            self.trace.close()
        if self.disk_cache is not None:
            self.disk_cache.close()

    def _sample_delta(self, user: _UserRequest, child: _Child, logprobs: dict | None,
                      now: float) -> CompletionOutput:
        """This step's part of one sample: the token ids past those already handed out
        (the tail of its Request's list: O(new), never a copy of the whole), their
        logprobs, the text they complete, the finish state. Mutates child (detokenizer,
        count, finished), user.metrics and user.num_unfinished; may finish the request
        on a stop string."""
        req = child.request
        new_ids = req.output_token_ids[child.num_output_tokens:]
        child.num_output_tokens = req.num_output_tokens
        text, new_logprobs = "", None
        seed, child.seed = child.seed, None
        if seed is not None:
            user.metrics.num_generation_tokens += 1
        if new_ids:
            m = user.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            elif child.index == 0:
                m.inter_token_latencies.append(now - (m.last_token_time or now))
            if child.index == 0:
                m.last_token_time = now
            m.num_generation_tokens += len(new_ids)
            if logprobs and req.req_id in logprobs:
                new_logprobs = logprobs[req.req_id][:len(new_ids)]
            text = child.detok.add_tokens(new_ids) or ""
            if child.detok.finished and not req.is_finished:   # a stop string matched
                self.scheduler.finish_requests([req.req_id], "stop", child.detok.stop_reason)
        finish_reason = stop_reason = None
        if req.is_finished:
            remote = req.kv_hold and self.kv_roles is not None and \
                self.kv_roles.producer_finished(req, child.detok.finished,
                                                (new_logprobs or [None])[0])
            if not child.detok.finished and not remote:   # remote: a decode continues it
                text += child.detok.flush() or ""
            finish_reason, stop_reason = req.finish_reason, req.stop_reason
            if req.kv_hold and child.detok.finished:      # stop string on the first token
                finish_reason, stop_reason = "stop", child.detok.stop_reason
            child.finished = True
            user.num_unfinished -= 1
        if seed is not None:      # the first token, from the prefill instance
            text, new_ids = seed.text + text, seed.token_ids + new_ids
            if seed.logprobs is not None:
                new_logprobs = seed.logprobs + (new_logprobs or [])
        return CompletionOutput(child.index, text, new_ids, new_logprobs, finish_reason,
                                stop_reason)

    def _user_output(self, user: _UserRequest, deltas: list[CompletionOutput]
                     ) -> RequestOutput:
        """One user request's delta (its changed samples by index); forgets it when every
        sample has finished."""
        finished = user.num_unfinished == 0
        if finished:
            user.metrics.finished_time = time.time()
            self.requests.pop(user.req_id, None)
            for child_id in user.children:
                self._child_to_user.pop(child_id, None)
        deltas.sort(key=lambda o: o.index)
        return RequestOutput(user.req_id, user.prompt, user.prompt_token_ids, deltas,
                             finished, user.metrics, user.num_cached_tokens,
                             user.prompt_logprobs)
