"""Speculator: the runner's side of speculative decoding (verify, then propose).

The engine builds one (`build_speculator`) and hands it to the ModelRunner, which calls:

    verify(logits, rows, states, drafts)   after the forward pass of a step whose slices
                                           carry drafts: the tokens each request keeps
    propose(states, counts)                after the step: drafts for the next step
    forget(req_ids)                        requests finished, preempted or re-sent

The scheduler decides how many drafts are verified and proposed (core/spec_policy.py);
this object only computes. It reads the runner's per-request state (token ids, params,
block table) and never mutates it.
"""
from __future__ import annotations

import logging

import torch

from duetserve.config import SpeculativeConfig
from duetserve.spec_decode.draft_model import DraftModelProposer
from duetserve.spec_decode.ngram import NgramProposer
from duetserve.spec_decode.rejection import verify_coupled, verify_greedy, verify_sampled
from duetserve.worker.sampler import (apply_logit_edits, apply_temperature_and_truncation,
                                      argmax_rows)
from duetserve.worker.sampling import needs_history, output_position
from duetserve.worker.sampling_metadata import SamplingMetadata

log = logging.getLogger("duetserve")


class Speculator:
    def __init__(self, config: SpeculativeConfig, vocab_size: int,
                 eos_token_ids: tuple[int, ...], device: str = "cpu",
                 draft: DraftModelProposer | None = None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        self.draft = draft
        # Draft distributions q_0..q_{k-1} [k, V] of the pending drafts of sampled requests
        # (draft model only; n-gram and greedy drafts are one-hot: None).
        self._draft_probs: dict[str, torch.Tensor] = {}

    @property
    def needs_lookahead(self) -> bool:
        """The proposer writes KV for its drafts (slots past the step's tokens)."""
        return self.draft is not None

    def forget(self, req_ids) -> None:
        """Drop per-request state. Mutates: pending draft distributions, the draft
        model's computed counters."""
        for req_id in req_ids:
            self._draft_probs.pop(req_id, None)
            if self.draft is not None:
                self.draft.forget(req_id)

    # -- verify ------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, rows: dict[str, list[int]], states: dict,
               drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """logits [N, V]: the step's logits rows; rows[r]: request r's k+1 rows in
        position order; states[r]: its RunnerRequestState (read). Returns {r: accepted
        drafts + one target token}. Unseeded sampled requests draw from the global RNG.
        See rejection.py for the math."""
        params, prompts, outputs, positions, index = [], [], [], [], []
        for req_id, req_rows in rows.items():
            st, d = states[req_id], drafts[req_id]
            assert len(req_rows) == len(d) + 1, (req_id, len(req_rows), len(d))
            sp = st.sampling_params
            history = needs_history(sp)
            prompt = st.token_ids[:st.num_prompt_tokens] if history else []
            done = st.token_ids[st.num_prompt_tokens:] if history else []
            for j in range(len(d) + 1):          # row j has seen drafts d_0 .. d_{j-1}
                params.append(sp)
                prompts.append(prompt)
                outputs.append(done + d[:j] if history else [])
                positions.append(output_position(st) + j)
            index.extend(req_rows)
        meta = SamplingMetadata.build(params, prompts, outputs, positions,
                                      self.eos_token_ids, self.vocab_size, self.device)
        penalised = logits[torch.tensor(index, dtype=torch.long)].float()
        if meta.needs_logit_edits:
            penalised = apply_logit_edits(penalised, meta)
        target_ids = argmax_rows(penalised).tolist()
        probs = None
        if not meta.all_greedy:
            probs = apply_temperature_and_truncation(penalised, meta).softmax(dim=-1)
        out: dict[str, list[int]] = {}
        offset = 0
        for req_id in rows:
            st, d = states[req_id], drafts[req_id]
            n = len(d) + 1
            if st.sampling_params.is_greedy:
                out[req_id] = verify_greedy(target_ids[offset:offset + n], d)
            elif st.sampling_params.seed is not None:
                out[req_id] = verify_coupled(probs[offset:offset + n], d,
                                             meta.seeded_u[offset:offset + n])
            else:
                q = self._draft_probs.get(req_id)
                if q is not None and q.shape[0] < len(d):
                    q = None   # not the drafts q was recorded for: cannot happen, be safe
                out[req_id] = verify_sampled(probs[offset:offset + n], d,
                                             None if q is None else q[:len(d)], None)
            self._draft_probs.pop(req_id, None)
            offset += n
        return out

    # -- propose -----------------------------------------------------------------------
    def propose(self, states: dict, counts: dict[str, int]) -> dict[str, list[int]]:
        """Drafts for the next step: counts[r] at most, for each r in `states`. Records
        the draft distributions of sampled requests (draft model)."""
        if not counts:
            return {}
        if self.ngram is not None:
            out = {}
            for req_id, n in counts.items():
                drafts = self.ngram.propose(states[req_id].token_ids, n)
                if drafts:
                    out[req_id] = drafts
            return out
        assert self.draft is not None
        drafts, probs = self.draft.propose(states, counts)
        self._draft_probs.update(probs)
        return drafts
