"""ModelRunner: SchedulerOutput -> tensors -> forward -> sample -> ModelRunnerOutput.

The runner keeps its own copy of each running request (tokens, block table, sampling
parameters); it learns a request once (NewRequestData) and applies diffs afterwards
(CachedRequestData). It never sees or mutates a Request.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from duetserve.config import UNBOUNDED_ROWS, ModelConfig
from duetserve.outputs import ModelRunnerOutput, SchedulerOutput
from duetserve.sampling_params import SamplingParams
from duetserve.structured import GrammarCompiler, GrammarState
from duetserve.worker.batch import SeqWork, build_step_batch, chunk_rows
from duetserve.worker.grammar_mask import GrammarMasker
from duetserve.worker.kv_cache import allocate_kv_cache, maps_lazily
from duetserve.worker.lora_slots import LoRASlots
from duetserve.worker.sampler import compute_prompt_logprobs
from duetserve.worker.sampling import StepSampler


@dataclass(slots=True)
class RunnerRequestState:
    req_id: str
    token_ids: list[int]            # prompt + every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: list | None = None    # accumulated over prefill chunks
    grammar: GrammarState | None = None    # constrained decoding: advanced per kept token
    lora_id: int = 0                       # its LoRA adapter's lora_int_id (0: none)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: str = "cpu",
                 grammars: GrammarCompiler | None = None,
                 kv_buffer: torch.Tensor | None = None, speculator=None,
                 kv_prefault: bool = False, deterministic: bool = False,
                 lora_slots: LoRASlots | None = None) -> None:
        """`grammars` compiles the constraints of guided requests (None: the runner
        refuses them). `kv_buffer`: uint8 memory to hold the KV cache (shareable memory
        of a disaggregated instance); None allocates it. `speculator`: a
        spec_decode.Speculator (verifies the drafts the scheduler sends, proposes the next
        ones); None: no speculative decoding. `kv_prefault`: map every page of the KV
        cache now (worker/kv_cache.py allocate_kv_cache). `deterministic`: every prompt
        token runs as a decode row (the paged attention's per-row order; the model's own
        kernels were made row-invariant at load, models/kernels.py). `lora_slots`: the
        resident LoRA adapters (worker/lora_slots.py); None: one slot of rank up to 16."""
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.kv_caches = allocate_kv_cache(model_config, num_blocks, block_size, dtype, device,
                                           kv_buffer, prefault=kv_prefault)
        # mapped on first touch (kv_cache.release_pages may hand its pages back)
        self.kv_lazy = maps_lazily(device, kv_buffer, kv_prefault)
        self.requests: dict[str, RunnerRequestState] = {}
        self.grammars = grammars
        masker = None if grammars is None else GrammarMasker(grammars, model_config.vocab_size)
        self.sampler = StepSampler(model_config.vocab_size, model_config.eos_token_ids, device,
                                   masker)
        backend = getattr(model.layers[0].self_attn, "backend", None)
        self.paged_decode = getattr(backend, "paged_decode", None) is not None
        # prompt chunks of up to this many tokens run as decode rows (worker/batch.py)
        self.chunk_rows = UNBOUNDED_ROWS if deterministic and self.paged_decode else \
            chunk_rows(self.paged_decode)
        # each KV group's sliding window (block ids of a request interleave the groups')
        self.kv_windows = tuple(g.window for g in model_config.kv_groups())
        self.speculator = speculator
        self.lora = lora_slots or LoRASlots(model_config, 1, 16)

    # -- state -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Mutates self.requests: drop finished/preempted, learn new ones, apply diffs."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        if self.speculator is not None:
            self.speculator.forget(so.finished_req_ids | so.preempted_req_ids
                                   | {new.req_id for new in so.scheduled_new_reqs})
        # adapters this step's requests use: never the one evicted for another
        in_use = {st.lora_id for st in self.requests.values()} | {
            new.lora_request.lora_int_id for new in so.scheduled_new_reqs if new.lora_request}
        for new in so.scheduled_new_reqs:
            # NOTE: a request resumed after preemption needs nothing carried over: seeded
            # randomness is keyed by output position (worker/seeded.py).
            lora = new.lora_request
            if lora is not None:       # resident before the step runs (evicting an idle one)
                self.lora.activate(lora, in_use)
            self.requests[new.req_id] = RunnerRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens,
                grammar=self._grammar_state(new), lora_id=lora.lora_int_id if lora else 0)
        for diff in so.scheduled_cached_reqs:
            st = self.requests[diff.req_id]
            st.block_ids.extend(diff.new_block_ids)
            st.num_computed_tokens = diff.num_computed_tokens

    def _grammar_state(self, new) -> GrammarState | None:
        """A grammar state for a guided request, advanced past the outputs it already has
        (a request resumed after preemption, or re-sent by the engine's isolation)."""
        guided = new.sampling_params.guided
        if guided is None:
            return None
        if self.grammars is None:
            raise RuntimeError(f"request {new.req_id} is guided but this runner has no "
                               "grammar compiler")
        state = self.grammars.new_state(guided)
        state.accept_all(new.token_ids[new.num_prompt_tokens:])
        return state

    # -- step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward the scheduled slices, sample where a slice reaches the end
        of its request's known tokens, score prompt positions that asked for it.

        Mutates (the runner's own state only; never a Request nor `so`):
          - self.requests: drops finished/preempted ones, learns new ones, applies diffs
            (block ids, num_computed_tokens), appends each sampled token to token_ids,
            advances num_computed_tokens by the slice, advances grammar states,
            accumulates prompt logprobs;
          - self.kv_caches: the K/V of every scheduled position is written (drafts too).
        Speculative decoding: slices carrying drafts (so.scheduled_spec_token_ids) are
        verified by the speculator and keep 1..k+1 tokens (num_computed_tokens advances by
        the kept ones); drafts for so.num_drafts_to_propose go to out.spec_token_ids.
        Returns a fresh ModelRunnerOutput (sampled ids per request, logprobs when asked);
        the caller may keep it."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        spec = so.scheduled_spec_token_ids
        batch = build_step_batch(self._work(so), self.block_size, self.device,
                                 self.paged_decode, self.kv_windows, self.chunk_rows)
        rows: dict[str, list[int]] = {}          # logits rows of each request
        for i, req_id in enumerate(batch.logits_req_ids):
            rows.setdefault(req_id, []).append(i)
        plain = [r for r in rows if r not in spec]
        states = [self.requests[r] for r in plain]
        self.sampler.prefetch_masks(states)      # grammar masks overlap the forward pass
        lora = self.lora.step_batch(batch.lora_slots)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                            lora)
        prompt_lps = self._prompt_logprobs(so, batch.order, hidden)
        # logits rows are increasing: as many as the rows means every row, in order (a
        # decode-only step), and the gather is skipped
        wanted = hidden if len(batch.logits_indices) == hidden.shape[0] \
            else hidden[batch.logits_indices]
        logits = self.model.compute_logits(wanted)
        kept: dict[str, list[int]] = {}
        if spec:
            kept = self.speculator.verify(logits, {r: rows[r] for r in rows if r in spec},
                                          self.requests, spec)
            logits = logits[[rows[r][0] for r in plain]]
        sampled, logprobs = self.sampler.sample(logits, states)
        kept.update((st.req_id, [tok]) for st, tok in zip(states, sampled))
        out = self._advance(so, batch.order, kept)
        if logprobs is not None:
            out.logprobs = {st.req_id: [lp] for st, lp in zip(states, logprobs)
                            if lp is not None}
        if prompt_lps:
            out.prompt_logprobs = prompt_lps
        if so.num_drafts_to_propose and self.speculator is not None:
            out.spec_token_ids = self.speculator.propose(
                {r: self.requests[r] for r in so.num_drafts_to_propose if r in kept},
                {r: n for r, n in so.num_drafts_to_propose.items() if r in kept})
        return out

    def _work(self, so: SchedulerOutput) -> list[SeqWork]:
        """Each scheduled slice as the batch builder's SeqWork (its known tokens, then
        the drafts it verifies). Reads the runner's request states."""
        spec = so.scheduled_spec_token_ids
        work = []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.requests[req_id]
            drafts = spec.get(req_id, [])
            start = st.num_computed_tokens
            end = start + n - len(drafts)       # known tokens; drafts follow them
            assert end <= len(st.token_ids), (req_id, start, n, len(st.token_ids))
            work.append(SeqWork(req_id, st.token_ids[start:end] + drafts, start,
                                st.block_ids, end == len(st.token_ids), len(drafts),
                                self.lora.slot_of(st.lora_id)))
        return work

    def _advance(self, so: SchedulerOutput, order: list[str], kept: dict[str, list[int]]
                 ) -> ModelRunnerOutput:
        """Append each request's kept tokens (and advance its grammar), advance its
        counter by the slice less the rejected drafts. Returns the step's output with
        the sampled ids. Mutates the runner's request states."""
        spec = so.scheduled_spec_token_ids
        out = ModelRunnerOutput(req_ids=order, sampled_token_ids={r: [] for r in order})
        for req_id, toks in kept.items():
            st = self.requests[req_id]
            out.sampled_token_ids[req_id] = toks
            st.token_ids.extend(toks)
            if st.grammar is not None:
                st.grammar.accept_all(toks)
        for req_id, n in so.num_scheduled_tokens.items():
            # rejected drafts are not computed after all (the scheduler does the same)
            rejected = len(spec[req_id]) + 1 - len(kept[req_id]) if req_id in spec else 0
            self.requests[req_id].num_computed_tokens += n - rejected
        return out

    def _prompt_logprobs(self, so: SchedulerOutput, order: list[str],
                         hidden: torch.Tensor) -> dict[str, list]:
        """Logprobs of prompt tokens for requests that asked (`prompt_logprobs`). Position
        p's logits score token p + 1. Accumulates over chunks in the request's state and
        returns {req_id: [None, lp_1, ..., lp_{P-1}]} once a prompt is complete."""
        done: dict[str, list] = {}
        offset = 0
        for req_id in order:
            n = so.num_scheduled_tokens[req_id]
            st = self.requests[req_id]
            num = st.sampling_params.prompt_logprobs
            start, last = st.num_computed_tokens, st.num_prompt_tokens - 1
            if num is not None and start < last:
                stop = min(start + n, last)
                rows = torch.arange(offset, offset + stop - start)
                targets = torch.tensor(st.token_ids[start + 1:stop + 1])
                logits = self.model.compute_logits(hidden[rows])
                if st.prompt_logprobs is None:
                    st.prompt_logprobs = [None]
                st.prompt_logprobs += compute_prompt_logprobs(logits, targets, num)
                if stop == last:
                    done[req_id] = st.prompt_logprobs
            offset += n
        return done
