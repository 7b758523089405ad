"""The offline API, shaped like vLLM's:

    from duetserve import LLM, SamplingParams
    llm = LLM()                                   # the default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

A prompt is a string, a list of token ids, or vLLM's prompt dicts: {"prompt": text}
(TextPrompt) or {"prompt_token_ids": [...]} (TokensPrompt); a list may mix them.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.outputs import OutputAccumulator, RequestOutput
from duetserve.request import LoRARequest
from duetserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _is_one_prompt(prompts: object) -> bool:
    """A single prompt (rather than a list of them): a string, a dict, or a list of token
    ids (a non-empty list whose first item is an int)."""
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int))


def parse_prompt(prompt: object, index: int = 0) -> tuple[list[int] | None, str | None]:
    """(token ids, text) of one prompt: a string -> (None, text) (the caller tokenizes),
    token ids or {"prompt_token_ids": ids} -> (ids, None), {"prompt": text} -> (None,
    text). Raises TypeError / ValueError naming the prompt's index and what is wrong."""
    where = f"prompt {index}"
    if isinstance(prompt, dict):
        keys = [k for k in PROMPT_KEYS if k in prompt]
        other = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if other:
            raise ValueError(f"{where}: unsupported key(s) {other} (a prompt dict has "
                             "'prompt' or 'prompt_token_ids')")
        if len(keys) != 1:
            raise ValueError(f"{where}: a prompt dict has exactly one of 'prompt' "
                             f"(text) or 'prompt_token_ids', got {sorted(prompt)}")
        prompt, where = prompt[keys[0]], f"{where} ({keys[0]})"
        if keys[0] == "prompt" and not isinstance(prompt, str):
            raise TypeError(f"{where}: must be a string, got {type(prompt).__name__}")
        if keys[0] == "prompt_token_ids" and not isinstance(prompt, (list, tuple)):
            raise TypeError(f"{where}: must be a list of token ids, got "
                            f"{type(prompt).__name__}")
    if isinstance(prompt, str):
        return None, prompt
    if isinstance(prompt, (list, tuple)):
        bad = next((t for t in prompt if type(t) is not int), None)
        if bad is not None:
            raise TypeError(f"{where}: token ids must be ints, got {bad!r}")
        if not prompt:
            raise ValueError(f"{where}: the token id list is empty")
        return list(prompt), None
    raise TypeError(f"{where}: expected a string, a list of token ids, or a dict with "
                    f"'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")


def _per_prompt(lora: object, n: int) -> list[LoRARequest | None]:
    """generate()'s lora_request as one per prompt. Raises TypeError / ValueError."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if not isinstance(lora, (list, tuple)) or any(
            x is not None and not isinstance(x, LoRARequest) for x in lora):
        raise TypeError("lora_request must be a LoRARequest, None, or a list of them")
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora requests for {n} prompts")
    return list(lora)


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
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.
        A prompt is a string, a list of token ids, or a vLLM prompt dict ({"prompt":
        text} or {"prompt_token_ids": ids}); one prompt or a list of them, mixed. Raises
        TypeError / ValueError for a malformed prompt and RequestError for one the engine
        refuses, before anything runs (nothing is left queued). `lora_request`: the LoRA
        adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a prompt or a list of prompts, got "
                            f"{type(prompts).__name__}")
        params = sampling_params or SamplingParams()
        params_list = ([params] * len(prompts) if isinstance(params, SamplingParams)
                       else list(params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        parsed = [parse_prompt(p, i) for i, p in enumerate(prompts)]
        ids: list[str] = []
        try:
            for i, ((token_ids, text), sp) in enumerate(zip(parsed, params_list)):
                req_id = str(next(self._ids))
                if token_ids is None:
                    token_ids = self.tokenizer.encode(text)
                self.engine.add_request(req_id, token_ids, sp, prompt=text,
                                        priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
                ids.append(req_id)
        except BaseException:
            self.engine.abort_request(ids)       # frees what was queued at once
            raise
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
