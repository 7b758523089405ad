"""Draft-model proposer: a smaller checkpoint with the target's tokenizer proposes drafts.

The draft model has its own paged KV cache, indexed by the target's block tables (same
block ids, same block size, same slot arithmetic), so it needs no allocator of its own:
the scheduler allocates the slots of both, including `num_drafts_to_propose` lookahead
slots past the step's tokens, where the draft writes the KV of its own drafts.

Per request the proposer remembers `num_computed`: positions [0, num_computed) hold the
draft's KV of verified tokens. A proposal for a request with N known tokens:

    forward(tokens[num_computed:N])      catch up (after a step: the accepted drafts and
                                         the target's token; a new request: its prompt)
       -> d_0 from the last position's logits
    forward(d_0 at N), forward(d_1 at N+1), ...  -> d_1 ... d_{n-1}
    num_computed = N                     (the drafts' KV is overwritten next time)

A prefix hit does not cover the draft's KV (a block may have been computed by a request
whose draft never ran), so a new request starts at num_computed = 0.
Greedy requests take the draft's argmax (q one-hot); sampled requests sample from the
draft's distribution after their temperature/top-k/top-p/min-p, and q is kept for the
verifier.
"""
from __future__ import annotations

import torch

from duetserve.config import ModelConfig
from duetserve.worker.batch import SeqWork, build_step_batch
from duetserve.worker.kv_cache import allocate_kv_cache
from duetserve.worker.sampler import apply_logit_edits, apply_temperature_and_truncation
from duetserve.worker.sampling_metadata import SamplingMetadata
from duetserve.spec_decode.rejection import sample_from

NEG_INF = float("-inf")


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype, target_vocab_size: int,
                 eos_token_ids: tuple[int, ...], device: str = "cpu") -> None:
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.device = device
        self.vocab_size = target_vocab_size
        self.eos_token_ids = eos_token_ids
        self.kv_caches = allocate_kv_cache(model_config, num_blocks, block_size, kv_dtype,
                                           device)
        backend = getattr(model.layers[0].self_attn, "backend", None)
        self.paged_decode = getattr(backend, "paged_decode", None) is not None
        self.num_computed: dict[str, int] = {}

    def forget(self, req_id: str) -> None:
        self.num_computed.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, states: dict, counts: dict[str, int]
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Up to counts[r] drafts for each request r (states[r]: RunnerRequestState, read;
        sampled requests' generators advance). Returns (drafts, q rows [n, V] of sampled
        requests). Mutates: the draft KV cache, self.num_computed."""
        req_ids = [r for r in counts if counts[r] > 0]
        if not req_ids:
            return {}, {}
        drafts: dict[str, list[int]] = {r: [] for r in req_ids}
        probs: dict[str, list[torch.Tensor]] = {r: [] for r in req_ids}
        work = []
        for r in req_ids:
            st = states[r]
            start = min(self.num_computed.get(r, 0), len(st.token_ids) - 1)
            work.append(SeqWork(r, st.token_ids[start:], start, st.block_ids, True))
        for j in range(max(counts[r] for r in req_ids)):
            if j > 0:
                work = [SeqWork(r, [drafts[r][-1]], len(states[r].token_ids) + j - 1,
                                states[r].block_ids, True)
                        for r in req_ids if counts[r] > j]
            if not work:
                break
            batch = build_step_batch(work, self.block_size, self.device, self.paged_decode)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            logits = self._target_vocab(self.model.compute_logits(
                hidden[batch.logits_indices]))
            chosen = self._choose(logits, [states[r] for r in batch.logits_req_ids])
            for r, (token, q) in zip(batch.logits_req_ids, chosen):
                drafts[r].append(token)
                if q is not None:
                    probs[r].append(q)
        for r in req_ids:
            self.num_computed[r] = len(states[r].token_ids)
        return drafts, {r: torch.stack(p) for r, p in probs.items() if p}

    def _target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (padding rows cut or filled -inf)."""
        v = logits.shape[1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[:, :self.vocab_size]
        pad = torch.full((logits.shape[0], self.vocab_size - v), NEG_INF)
        return torch.cat([logits, pad], dim=1)

    def _choose(self, logits: torch.Tensor, states: list
                ) -> list[tuple[int, torch.Tensor | None]]:
        """Per row: (draft token, q row or None). Greedy rows: argmax. Sampled rows: one
        draw from q = softmax(processed logits), with the request's generator."""
        params = [st.sampling_params for st in states]
        if all(p.is_greedy for p in params):
            return [(t, None) for t in logits.argmax(dim=-1).tolist()]
        empty = [[] for _ in params]
        meta = SamplingMetadata.build(params, empty, empty, [None] * len(params),
                                      self.eos_token_ids, self.vocab_size, self.device)
        edited = apply_logit_edits(logits, meta) if meta.needs_logit_edits else logits
        greedy_ids = edited.argmax(dim=-1).tolist()
        q = apply_temperature_and_truncation(edited, meta).softmax(dim=-1)
        out = []
        for i, (st, p) in enumerate(zip(states, params)):
            if p.is_greedy:
                out.append((greedy_ids[i], None))
            else:
                out.append((sample_from(q[i], st.generator), q[i]))
        return out
