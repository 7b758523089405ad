"""Step-level sampling glue: per-request state -> the vectorised sampler.

Temporary minimal version (greedy + temperature); replaced by worker/sampler.py's
full sampler (penalties, top-k/p, min-p, seeds, logprobs)."""
from __future__ import annotations

import torch


class StepSampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device

    def sample(self, logits: torch.Tensor, states: list) -> tuple[list[int], dict | None]:
        """logits [N, V] for the requests in `states` -> one token id each."""
        if not states:
            return [], None
        out = logits.argmax(dim=-1).tolist()
        for i, st in enumerate(states):
            sp = st.sampling_params
            if sp.temperature > 0:
                probs = torch.softmax(logits[i] / sp.temperature, dim=-1)
                out[i] = int(torch.multinomial(probs, 1, generator=st.generator))
        return out, None
