"""The offline API, shaped like vLLM's:

    from duetserve import LLM, SamplingParams
    llm = LLM()                                   # the default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.outputs import OutputAccumulator, RequestOutput
from duetserve.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        """`engine_options` are the CLI flags as keyword arguments, e.g.
        max_num_batched_tokens=512, kv_cache_memory=1.0, enable_prefix_caching=False."""
        self.engine = EngineCore(EngineConfig.from_kwargs(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: EngineCore) -> "LLM":
        """Wrap an already built engine (the CLI builds it from flags)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer, llm._ids = engine, engine.tokenizer, itertools.count()
        return llm

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.
        A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = ([params] * len(prompts) if isinstance(params, SamplingParams)
                       else list(params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
            req_id = str(next(self._ids))
            if isinstance(prompt, str):
                token_ids, text = self.tokenizer.encode(prompt), prompt
            else:
                token_ids, text = list(prompt), None
            self.engine.add_request(req_id, token_ids, sp, prompt=text,
                                    priority=priority[i] if priority else 0)
            ids.append(req_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False
             ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            acc = OutputAccumulator()      # the cumulative view, built here once
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step_deltas():
                    out = acc.add(delta)
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
