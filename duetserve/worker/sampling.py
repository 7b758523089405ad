"""Step-level sampling glue: the runner's per-request state -> the vectorised Sampler.

Rows with a grammar (RunnerRequestState.grammar) first get their disallowed logits set
to -inf (GrammarMasker); everything after (bias, penalties, greedy or random choice,
logprobs) then only ever sees allowed tokens.
"""
from __future__ import annotations

import torch

from duetserve.outputs import Logprob
from duetserve.worker.grammar_mask import GrammarMasker
from duetserve.worker.sampler import Sampler, argmax_rows
from duetserve.worker.sampling_metadata import SamplingMetadata


def needs_history(sp) -> bool:
    """Whether sampling for these params reads the prompt and output tokens."""
    return (sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
            or sp.frequency_penalty != 0.0 or sp.min_tokens > 0)


_needs_history = needs_history


def output_position(st) -> int:
    """The output index of the token a RunnerRequestState samples next (what a seeded
    request's uniform is keyed by)."""
    return len(st.token_ids) - st.num_prompt_tokens


class StepSampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device,
                 masker: GrammarMasker | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        self.masker = masker

    def prefetch_masks(self, states: list) -> None:
        """Before the forward pass of a step that will sample `states`: start computing
        the grammar masks of its constrained rows off the critical path (no-op when none
        is constrained)."""
        grammars = [st.grammar for st in states if st.grammar is not None]
        if grammars and self.masker is not None:
            self.masker.prefetch(grammars)

    def sample(self, logits: torch.Tensor, states: list
               ) -> tuple[list[int], list[dict[int, Logprob] | None] | None]:
        """logits [N, V] for the requests in `states` (RunnerRequestState) -> one token id
        each, plus logprob dicts when any row asked. Masks
        the rows of constrained requests in `logits` in place (their grammar states are
        read, not advanced: the runner advances them with the tokens it keeps)."""
        if not states:
            return [], None
        constrained = [i for i, st in enumerate(states) if st.grammar is not None]
        if constrained:
            if self.masker is None:
                raise RuntimeError("a constrained request reached a runner without a "
                                   "grammar compiler")
            self.masker.apply(logits, constrained, [states[i].grammar for i in constrained])
        params = [st.sampling_params for st in states]
        if all(p.is_greedy and p.logprobs is None and not _needs_history(p) and
               not p.logit_bias for p in params):
            return argmax_rows(logits).tolist(), None   # fast path
        prompts, outputs = [], []
        for st, p in zip(states, params):
            if _needs_history(p):
                prompts.append(st.token_ids[:st.num_prompt_tokens])
                outputs.append(st.token_ids[st.num_prompt_tokens:])
            else:
                prompts.append([])
                outputs.append([])
        meta = SamplingMetadata.build(params, prompts, outputs, [output_position(st) for st in states],
                                      self.eos_token_ids, self.vocab_size, self.device)
        out = self.sampler(logits, meta)
        lps = out.logprob_dicts() if meta.needs_logprobs else None
        return out.sampled_token_ids.tolist(), lps
