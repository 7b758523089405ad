"""The engine's greedy outputs on the new families are identical however it batches,
chunks, caches or preempts, and identical to transformers (tests/engine/test_equivalence.py's
modes), on tiny random checkpoints: Gemma 3 (sliding window 8 over prompts up to 130
tokens: sliding blocks are released mid-request, prefix hits supply the window) and
Qwen3-MoE (experts routed per row)."""
from __future__ import annotations

import pytest
import torch

from test_equivalence import GREEDY, _check_all_modes, _engine, _prompts
from tiny_families import make_family_checkpoint
from duetserve.loader import load_model


@pytest.mark.parametrize("variant", ["gemma3", "qwen3_moe"])
def test_family_all_modes(variant, tmp_path):
    from transformers import AutoModelForCausalLM
    path = make_family_checkpoint(str(tmp_path / variant), variant)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = load_model(path)
    # the preemption run's pool: tests/engine/test_equivalence.py's 40 blocks, or 20 a KV
    # group with sliding groups (theirs hold only a window: more would never preempt)
    groups = len(loaded.config.kv_groups())
    _check_all_modes(loaded, _prompts(loaded.config.vocab_size, seed=2), hf,
                     small_blocks=40 if groups == 1 else 20 * groups)


def test_sliding_blocks_are_released_and_shown_per_kind(tmp_path):
    """A long Gemma 3 request holds a window's worth of blocks in its sliding groups, the
    whole context in the full group; the engine's stats report both kinds; every block
    is free again once it ends."""
    path = make_family_checkpoint(str(tmp_path / "g"), "gemma3")
    llm = _engine(load_model(path), block_size=4, max_num_batched_tokens=16)
    eng = llm.engine
    seen = []
    eng.add_step_observer(seen.append)
    llm.generate([list(range(3, 120))], GREEDY)
    groups = eng.model_config.kv_groups()
    full = sum(1 for g in groups if g.window is None)
    sliding = len(groups) - full
    longest = max(seen, key=lambda s: s.used_blocks_by_kind.get("full", 0))
    by_kind = longest.used_blocks_by_kind
    assert by_kind["full"] == full * -(-(117 + 19) // 4)        # every position's block
    # each sliding group: the window (8 positions: 3 blocks of 4 at most) and the blocks
    # the step being scheduled writes
    assert by_kind["sliding"] <= sliding * (8 // 4 + 1 + 1)
    assert eng.scheduler.kv_cache_manager.num_used_blocks == 0
    assert eng.scheduler.make_stats().used_blocks_by_kind == {"full": 0, "sliding": 0}
