"""Build the Speculator for an engine: the proposer named by the SpeculativeConfig, and
for a draft model, its checkpoint loaded and checked against the target's vocabulary."""
from __future__ import annotations

import logging

import torch

from duetserve.config import ModelConfig, SpeculativeConfig
from duetserve.core.spec_policy import RooflineStep, SpecPolicy
from duetserve.errors import CheckpointError
from duetserve.loader import LoadedModel, load_model
from duetserve.metrics.cost_model import step_cost
from duetserve.metrics.hardware import HardwareProfile, local_profile
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
                     max_positions: int | None = None) -> Speculator:
    """The Speculator the ModelRunner calls. Loads the draft checkpoint (method "draft")
    with `dtype` and config.draft_quantization; its KV cache has num_blocks blocks."""
    draft = None
    if config.method == "draft":
        loaded = load_model(config.model, dtype, device, max_positions=max_positions,
                            quantization=config.draft_quantization)
        check_same_vocabulary(target, loaded)
        log.info("draft model %s: %s", loaded.path, loaded.describe())
        draft = DraftModelProposer(loaded.model, loaded.config, num_blocks, block_size,
                                   kv_dtype, model_config.vocab_size,
                                   tuple(model_config.eos_token_ids), device)
    return Speculator(config, model_config.vocab_size, tuple(model_config.eos_token_ids),
                      device, draft)


def roofline_step(target: LoadedModel, hardware: HardwareProfile | None = None
                  ) -> RooflineStep:
    """The target's step time on this machine's roofline: the weights read once at the
    memory bandwidth, and each row's FLOPs (linears, LM head) at the fp32 peak (the
    activations are float32; the measured fp32 GEMM is the fastest dense figure)."""
    hw = hardware or local_profile()
    one_row = step_cost(target.config, [(1, 0)], weight_bytes=target.weight_bytes)
    return RooflineStep(mem_seconds=one_row.weight_bytes / hw.mem_bandwidth,
                        row_seconds=one_row.flops / hw.peak("fp32"))


def spec_policy_for(config: SpeculativeConfig, target: LoadedModel, speculator: Speculator,
                    step_cost_measured=None) -> SpecPolicy:
    """The scheduler's SpecPolicy for this engine (adaptive: with the roofline)."""
    roofline = roofline_step(target) if config.adaptive else None
    if roofline is not None:
        log.info("speculative decoding: adaptive, up to %d drafts; roofline ridge at %.1f "
                 "rows (weights %.1f ms, %.2f ms per row)", config.num_speculative_tokens,
                 roofline.ridge_rows, roofline.mem_seconds * 1e3, roofline.row_seconds * 1e3)
    return SpecPolicy(config.num_speculative_tokens, speculator.needs_lookahead,
                      config.adaptive, roofline)
