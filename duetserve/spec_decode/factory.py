"""Build the Speculator for an engine: the proposer named by the SpeculativeConfig, and
for a draft model, its checkpoint loaded and checked against the target's vocabulary."""
from __future__ import annotations

import logging
import statistics
import time

import torch

from duetserve.config import ConfigError, ModelConfig, SpeculativeConfig
from duetserve.core.spec_policy import RooflineStep, SpecPolicy
from duetserve.errors import CheckpointError
from duetserve.loader import LoadedModel, load_model
from duetserve.metrics.cost_model import step_cost
from duetserve.metrics.hardware import HardwareProfile, local_profile
from duetserve.spec_decode.draft_model import DraftModelProposer
from duetserve.spec_decode.speculator import Speculator
from duetserve.worker.batch import SeqWork, build_step_batch

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
    with `dtype` and config.quantization; its KV cache has num_blocks blocks."""
    draft = None
    if config.method == "draft":
        if len(model_config.kv_groups()) > 1:
            raise ConfigError("a draft model shares the target's KV block tables, which a "
                              "model with sliding-window layers splits per layer kind: use "
                              'method "ngram" with this model')
        loaded = load_model(config.model, dtype, device, max_positions=max_positions,
                            quantization=config.quantization)
        check_same_vocabulary(target, loaded)
        log.info("draft model %s: %s", loaded.path, loaded.describe())
        draft = DraftModelProposer(loaded.model, loaded.config, num_blocks, block_size,
                                   kv_dtype, model_config.vocab_size,
                                   tuple(model_config.eos_token_ids), device,
                                   config.draft_vocab_size)
    return Speculator(config, model_config.vocab_size, tuple(model_config.eos_token_ids),
                      device, draft)


PROBE_ROWS = 4      # the shortest measured table (a step of 1..4 rows)
MAX_PROBE_ROWS = 9  # the measured table's longest step (k + 1 rows, k <= 8)
# past the table, steps of 2, 3 and 4 times its rows are measured too: that many requests
# verifying k drafts each (or more requests fewer), the steps where whether drafts pay is
# decided by how much an extra row costs there, not by the table's average row
BEYOND_MULTIPLES = (2, 3, 4)


def theoretical_roofline(target: LoadedModel, hardware: HardwareProfile | None = None
                         ) -> RooflineStep:
    """The cost model's roofline: the weights read once at the memory bandwidth, each
    row's FLOPs (linears, LM head) at the fp32 peak."""
    hw = hardware or local_profile()
    one_row = step_cost(target.config, [(1, 0)], weight_bytes=target.weight_bytes)
    return RooflineStep(mem_seconds=one_row.weight_bytes / hw.mem_bandwidth,
                        row_seconds=one_row.flops / hw.peak("fp32"))


@torch.inference_mode()
def step_seconds(model: torch.nn.Module, kv_caches: list, block_size: int, vocab_size: int,
                 rows: int, paged_decode: bool = True, repeats: int = 3,
                 num_ids: int | None = None) -> float:
    """Median time of a verify-shaped step of `rows` decode rows (one request's
    consecutive positions from block_size on, logits of every row, of ids [0, num_ids)
    when given) on the model's own kernels. Runs 1 + repeats steps into KV blocks
    0 .. (block_size + rows - 1) // block_size (call it before any request exists)."""
    windows = tuple(g.window for g in model.config.kv_groups())
    blocks = list(range(((block_size + rows - 1) // block_size + 1) * len(windows)))
    work = [SeqWork("probe", [(7919 * j) % vocab_size], block_size + j, blocks, True)
            for j in range(rows)]
    batch = build_step_batch(work, block_size, "cpu", paged_decode, windows)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        hidden = model(batch.input_ids, batch.positions, kv_caches, batch.meta)
        model.compute_logits(hidden[batch.logits_indices], num_ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measured_roofline(model: torch.nn.Module, kv_caches: list, block_size: int,
                      vocab_size: int, paged_decode: bool = True, max_rows: int = PROBE_ROWS,
                      repeats: int = 3, beyond: tuple[int, ...] = BEYOND_MULTIPLES
                      ) -> RooflineStep:
    """The step time as this machine runs the model's own decode kernels, for 1 ..
    n = max(max_rows, PROBE_ROWS) verify-shaped rows (n at most MAX_PROBE_ROWS) and for
    m * n rows, m in `beyond`; linear between, the roofline through the last point past
    it. Call it before any request exists."""
    n = min(max(max_rows, PROBE_ROWS), MAX_PROBE_ROWS)

    def t(rows: int) -> float:
        return step_seconds(model, kv_caches, block_size, vocab_size, rows, paged_decode,
                            repeats)
    return RooflineStep.from_measured([t(r) for r in range(1, n + 1)],
                                      [(m * n, t(m * n)) for m in sorted(beyond) if m > 1])


def spec_policy_for(config: SpeculativeConfig, target: LoadedModel, speculator: Speculator,
                    runner) -> SpecPolicy:
    """The scheduler's SpecPolicy for this engine. Adaptive: on the step times measured
    with the runner's model and KV cache for 1 .. k+1 rows and 2, 3, 4 times that, and a
    draft model's 1-row step (the cost of one draft) measured on its own cache (before
    any request exists)."""
    roofline, draft_seconds = None, 0.0
    if config.adaptive:
        roofline = measured_roofline(runner.model, runner.kv_caches, runner.block_size,
                                     target.config.vocab_size, runner.paged_decode,
                                     config.num_speculative_tokens + 1)
        draft = speculator.draft
        if draft is not None:
            draft_seconds = step_seconds(draft.model, draft.kv_caches, draft.block_size,
                                         draft.vocab_size, 1, draft.paged_decode,
                                         num_ids=draft.num_ids)
        theory = theoretical_roofline(target)
        log.info("speculative decoding: adaptive, up to %d drafts; target step of 1..%d "
                 "rows %s (ridge at %.1f rows; the cost model's roofline puts it at "
                 "%.1f)%s", config.num_speculative_tokens, len(roofline.measured),
                 roofline.describe(), roofline.ridge_rows, theory.ridge_rows,
                 f"; a draft costs {draft_seconds * 1e3:.1f} ms" if draft is not None else "")
    return SpecPolicy(config.num_speculative_tokens, speculator.needs_lookahead,
                      config.adaptive, roofline, draft_seconds=draft_seconds,
                      condition_on_streak=config.method == "ngram")
