"""A minimal driver around the ModelRunner for tests: hands out blocks contiguously and
builds SchedulerOutputs by hand (no scheduler involved)."""
from __future__ import annotations

import torch

from duetserve.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from duetserve.sampling_params import SamplingParams
from duetserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def make_runner(loaded, num_blocks: int = 256, block_size: int = 16) -> ModelRunner:
    return ModelRunner(loaded.model, loaded.config, num_blocks, block_size, torch.float32)


class ManualDriver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 0
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.n = 0

    def _blocks_for(self, req_id: str, num_tokens: int) -> list[int]:
        bs = self.runner.block_size
        have = self.blocks.setdefault(req_id, [])
        new = []
        while len(have) * bs < num_tokens:
            have.append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def step(self, new: dict[str, tuple[list[int], int]], cont: dict[str, int]):
        """new: req_id -> (token_ids, num_tokens_to_run); cont: req_id -> num tokens."""
        so = SchedulerOutput()
        for rid, (toks, n) in new.items():
            self._blocks_for(rid, n)
            so.scheduled_new_reqs.append(NewRequestData(rid, list(toks), len(toks), GREEDY,
                                                        list(self.blocks[rid]), 0))
            so.num_scheduled_tokens[rid] = n
            self.computed[rid] = n
        for rid, n in cont.items():
            nb = self._blocks_for(rid, self.computed[rid] + n)
            so.scheduled_cached_reqs.append(CachedRequestData(rid, nb, self.computed[rid]))
            so.num_scheduled_tokens[rid] = n
            self.computed[rid] += n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        return self.runner.execute_model(so)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one step, then decode them together."""
        ids = [f"r{self.n + i}" for i in range(len(prompts))]
        self.n += len(prompts)
        out = self.step({r: (p, len(p)) for r, p in zip(ids, prompts)}, {})
        gen = {r: list(out.sampled_token_ids[r]) for r in ids}
        for _ in range(max_tokens - 1):
            out = self.step({}, {r: 1 for r in ids})
            for r in ids:
                gen[r].extend(out.sampled_token_ids[r])
        return [gen[r] for r in ids]
