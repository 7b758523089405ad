"""Draft-model proposer: a smaller checkpoint with the target's tokenizer proposes drafts.

The draft model has its own paged KV cache, indexed by the target's block tables (same
block ids, same block size, same slot arithmetic), so it needs no allocator of its own:
the scheduler allocates the slots of both, including `num_drafts_to_propose` lookahead
slots past the step's tokens, where the draft writes the KV of its own drafts.

Per request the proposer remembers `num_computed` (positions [0, num_computed) hold the
draft's KV of verified tokens) and the drafts it forwarded after them (their KV sits at
the following positions). A proposal for a request with N known tokens:

    valid = num_computed + the forwarded drafts the target kept (their KV is right)
    forward(tokens[valid:N])             catch up (after a step: at most the last kept
       -> d_0 from the last position's logits   draft and the target's token; a new
                                                request: its prompt)
    forward(d_0 at N), forward(d_1 at N+1), ...  -> d_1 ... d_{n-1}
    num_computed = N, forwarded = d_0 .. d_{n-2}   (rejected ones are overwritten later)

A short catch-up runs as decode rows (one per token, logits of the last only), so a
draft step is a decode-only step and takes the model's native decode stack (a prefill
chunk would run the module path at several times the cost at batch 1).

A prefix hit does not cover the draft's KV (a block may have been computed by a request
whose draft never ran), so a new request starts at num_computed = 0.
Greedy requests take the draft's argmax (q one-hot); sampled requests sample from the
draft's distribution after their temperature/top-k/top-p/min-p, and q is kept for the
verifier.

Reduced draft vocabulary (`draft_vocab_size` V'): the draft's LM head computes logits of
token ids [0, V') only (the first V' rows of its LM head; at batch 1 the full head is
about a fifth of a 0.5B draft's step). The draft then proposes only among those ids: q is
0 outside them (logits -inf), greedy drafts are the argmax over them. The verifier stays
exact for any q (rejection.py): a target token outside the subset is never drafted, and
is emitted by the residual max(p - q, 0) = p there or as the target's own token.
Byte-level BPE vocabularies (Qwen2's, Llama-3's) number tokens in merge order, so the
first ids are the earliest, most common merges.
"""
from __future__ import annotations

import torch

from duetserve.config import ModelConfig
from duetserve.worker.batch import SeqWork, build_step_batch
from duetserve.worker.kv_cache import allocate_kv_cache
from duetserve.worker.sampler import (apply_logit_edits, apply_temperature_and_truncation,
                                      argmax_rows)
from duetserve.worker.sampling import output_position
from duetserve.worker.sampling_metadata import SamplingMetadata
from duetserve.spec_decode.rejection import sample_at, sample_from

NEG_INF = float("-inf")
CATCH_UP_DECODE_ROWS = 8     # catch-ups of up to this many tokens run as decode rows


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype, target_vocab_size: int,
                 eos_token_ids: tuple[int, ...], device: str = "cpu",
                 draft_vocab_size: int | None = None) -> None:
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.device = device
        self.vocab_size = target_vocab_size
        self.eos_token_ids = eos_token_ids
        # logits of ids [0, num_ids) only; None: the draft's whole vocabulary
        self.num_ids = draft_vocab_size if draft_vocab_size is not None and \
            draft_vocab_size < min(model_config.vocab_size, target_vocab_size) else None
        self.kv_caches = allocate_kv_cache(model_config, num_blocks, block_size, kv_dtype,
                                           device)
        backend = getattr(model.layers[0].self_attn, "backend", None)
        self.paged_decode = getattr(backend, "paged_decode", None) is not None
        self.num_computed: dict[str, int] = {}
        self.forwarded: dict[str, list[int]] = {}   # drafts whose KV follows num_computed

    def forget(self, req_id: str) -> None:
        self.num_computed.pop(req_id, None)
        self.forwarded.pop(req_id, None)

    def _valid(self, req_id: str, token_ids: list[int]) -> int:
        """Positions whose draft KV is right for `token_ids`: the verified ones, then the
        forwarded drafts the target kept; at most len - 1 (the last token is forwarded to
        get the next draft)."""
        n = self.num_computed.get(req_id, 0)
        for d in self.forwarded.get(req_id, ()):
            if n >= len(token_ids) or token_ids[n] != d:
                break
            n += 1
        return min(n, len(token_ids) - 1)

    def _catch_up(self, req_id: str, st) -> list[SeqWork]:
        """The first forward of a proposal: the tokens without draft KV, logits of the last."""
        start = self._valid(req_id, st.token_ids)
        tokens = st.token_ids[start:]
        if len(tokens) > CATCH_UP_DECODE_ROWS:
            return [SeqWork(req_id, tokens, start, st.block_ids, True)]
        return [SeqWork(req_id, [t], start + i, st.block_ids, i == len(tokens) - 1)
                for i, t in enumerate(tokens)]

    @torch.inference_mode()
    def propose(self, states: dict, counts: dict[str, int]
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Up to counts[r] drafts for each request r (states[r]: RunnerRequestState,
        read). Returns (drafts, q rows [n, V] of unseeded sampled requests: rejection
        sampling's q). Mutates: the draft KV cache, self.num_computed."""
        req_ids = [r for r in counts if counts[r] > 0]
        if not req_ids:
            return {}, {}
        drafts: dict[str, list[int]] = {r: [] for r in req_ids}
        probs: dict[str, list[torch.Tensor]] = {r: [] for r in req_ids}
        work = [w for r in req_ids for w in self._catch_up(r, states[r])]
        for j in range(max(counts[r] for r in req_ids)):
            if j > 0:
                work = [SeqWork(r, [drafts[r][-1]], len(states[r].token_ids) + j - 1,
                                states[r].block_ids, True)
                        for r in req_ids if counts[r] > j]
            if not work:
                break
            batch = build_step_batch(work, self.block_size, self.device, self.paged_decode)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            logits = self.model.compute_logits(hidden[batch.logits_indices], self.num_ids)
            chosen = self._choose(logits, [states[r] for r in batch.logits_req_ids], j)
            for r, (token, q) in zip(batch.logits_req_ids, chosen):
                drafts[r].append(token)
                if q is not None:
                    probs[r].append(q)
        for r in req_ids:
            self.num_computed[r] = len(states[r].token_ids)
            self.forwarded[r] = drafts[r][:-1]
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

    def _choose(self, logits: torch.Tensor, states: list, j: int
                ) -> list[tuple[int, torch.Tensor | None]]:
        """logits [n, <= V]: the draft's (past its vocabulary or num_ids: -inf) for draft j
        of each request in `states`. Per row: (draft token, q row [V] or None: greedy and
        seeded rows, whose verifiers need no q). Greedy rows: argmax. Sampled rows: one
        draw from q = softmax(processed logits): a seeded request's at the seeded uniform
        of the output position the draft stands for (the verifier couples on it,
        rejection.py), others from the global RNG."""
        params = [st.sampling_params for st in states]
        if all(p.is_greedy for p in params):
            return [(t, None) for t in argmax_rows(logits[:, :self.vocab_size]).tolist()]
        logits = self._target_vocab(logits)
        empty = [[] for _ in params]
        meta = SamplingMetadata.build(params, empty, empty,
                                      [output_position(st) + j for st in states],
                                      self.eos_token_ids, self.vocab_size, self.device)
        edited = apply_logit_edits(logits, meta) if meta.needs_logit_edits else logits
        greedy_ids = argmax_rows(edited).tolist()
        q = apply_temperature_and_truncation(edited, meta).softmax(dim=-1)
        out = []
        for i, (st, p) in enumerate(zip(states, params)):
            if p.is_greedy:
                out.append((greedy_ids[i], None))
            elif meta.seeded_u[i] is not None:   # coupled verification needs no q
                out.append((sample_at(q[i], meta.seeded_u[i]), None))
            else:
                out.append((sample_from(q[i], None), q[i]))
        return out
