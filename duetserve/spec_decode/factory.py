"""Build the Speculator for an engine: the proposer named by the SpeculativeConfig, and
for a draft model, its checkpoint loaded and checked against the target's vocabulary."""
from __future__ import annotations

import logging

import torch

from duetserve.config import ConfigError, ModelConfig, SpeculativeConfig
from duetserve.core.spec_policy import SpecPolicy
from duetserve.core.step_time import StepTime
from duetserve.errors import CheckpointError
from duetserve.loader import LoadedModel, load_model
from duetserve.spec_decode.draft_model import DraftModelProposer
from duetserve.spec_decode.speculator import Speculator

log = logging.getLogger("duetserve")


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise CheckpointError unless the draft's tokenizer maps every token string to the
    same id as the target's (drafts are token ids: any difference would be silent
    garbage)."""
    tv = target.tokenizer.tok.get_vocab(with_added_tokens=True)
    dv = draft.tokenizer.tok.get_vocab(with_added_tokens=True)
    if tv == dv:
        return
    diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])
    example = ", ".join(f"{k!r}->{v}" for k, v in diff[:3])
    raise CheckpointError(
        f"the draft model {draft.path} does not share the target's tokenizer "
        f"({target.path}): vocabularies of {len(dv)} and {len(tv)} tokens differ in "
        f"{len(diff)} entries (e.g. {example}); speculative decoding needs the same "
        "vocabulary")


def build_speculator(config: SpeculativeConfig, target: LoadedModel,
                     model_config: ModelConfig, num_blocks: int, block_size: int,
                     kv_dtype: torch.dtype, dtype: str, device: str = "cpu",
                     max_positions: int | None = None,
                     load_options: dict | None = None) -> Speculator:
    """The Speculator the ModelRunner calls. Loads the draft checkpoint (method "draft")
    with `dtype`, config.quantization and the engine's kernel switches (`load_options`,
    EngineConfig.load_options); its KV cache has num_blocks blocks."""
    draft = None
    if config.method == "draft":
        if len(model_config.kv_groups()) > 1:
            raise ConfigError("a draft model shares the target's KV block tables, which a "
                              "model with sliding-window layers splits per layer kind: use "
                              'method "ngram" with this model')
        loaded = load_model(config.model, dtype, device, max_positions=max_positions,
                            quantization=config.quantization, **(load_options or {}))
        check_same_vocabulary(target, loaded)
        log.info("draft model %s: %s", loaded.path, loaded.describe())
        draft = DraftModelProposer(loaded.model, loaded.config, num_blocks, block_size,
                                   kv_dtype, model_config.vocab_size,
                                   tuple(model_config.eos_token_ids), device,
                                   config.draft_vocab_size)
    return Speculator(config, model_config.vocab_size, tuple(model_config.eos_token_ids),
                      device, draft)


def spec_policy_for(config: SpeculativeConfig, needs_lookahead: bool,
                    step_time: StepTime | None, draft_seconds: float = 0.0) -> SpecPolicy:
    """The scheduler's SpecPolicy for this engine. Adaptive: priced by the engine's
    step-time model (the one the step budget uses; None: every row free) and a draft
    model's cost per proposed token (`draft_seconds`, measured by the engine)."""
    if config.adaptive:
        log.info("speculative decoding: adaptive, up to %d drafts%s",
                 config.num_speculative_tokens,
                 f"; a draft costs {draft_seconds * 1e3:.1f} ms" if draft_seconds else "")
    return SpecPolicy(config.num_speculative_tokens, needs_lookahead, config.adaptive,
                      step_time if config.adaptive else None, draft_seconds=draft_seconds,
                      condition_on_streak=config.method == "ngram")
