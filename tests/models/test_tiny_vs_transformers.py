"""Tiny random-weight checkpoints (built here, saved as HF folders) against transformers."""
from __future__ import annotations

import pytest
import torch

from tiny_models import TINY_VARIANTS
from duetserve.loader import load_model
from model_helpers import PagedModel, rel_err

PROMPT = [5, 17, 99, 3, 250, 42, 42, 7, 128, 64, 1, 200, 33, 12, 90, 91, 92, 150, 11]


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints):
    from transformers import AutoModelForCausalLM
    return {v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for v, p in tiny_checkpoints.items()}


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_logits_match(variant, tiny_checkpoints, hf_models):
    loaded = load_model(tiny_checkpoints[variant])
    with torch.no_grad():
        ref = hf_models[variant](torch.tensor([PROMPT])).logits[0, -1]
    ours = PagedModel(loaded).prompt_logits(PROMPT)
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_greedy_32_tokens_match(variant, tiny_checkpoints, hf_models):
    loaded = load_model(tiny_checkpoints[variant])
    with torch.no_grad():
        ref = hf_models[variant].generate(torch.tensor([PROMPT]), max_new_tokens=32,
                                          do_sample=False, min_new_tokens=32)[0, len(PROMPT):]
    ours = PagedModel(loaded).greedy(PROMPT, 32)
    assert ours == ref.tolist()


def test_config_flags(tiny_checkpoints):
    from duetserve.loader import load_model_config
    q = load_model_config(tiny_checkpoints["qwen2-qkv-bias"])
    assert q.architecture == "qwen2" and q.has_qkv_bias
    l3 = load_model_config(tiny_checkpoints["llama3-rope-scaling"])
    assert dict(l3.rope_scaling)["rope_type"] == "llama3" and l3.rope_theta == 500000.0
    assert load_model_config(tiny_checkpoints["llama-gqa-tied"]).tie_word_embeddings
    assert load_model_config(tiny_checkpoints["llama-gqa-untied"]).num_key_value_heads == 2


def test_many_decodes_in_groups_equal_each_alone(tiny_checkpoints):
    """40 decodes (more than one decode group, contexts of varied length) in one step."""
    from duetserve.worker.batch import DECODE_GROUP_SIZE, SeqWork
    loaded = load_model(tiny_checkpoints["qwen2-qkv-bias"])
    lengths = [(7 * i) % 61 + 1 for i in range(40)]
    assert len(lengths) > DECODE_GROUP_SIZE

    def run(together: bool) -> dict:
        paged = PagedModel(loaded, num_blocks=1024, block_size=4)
        works = []
        for i, n in enumerate(lengths):
            ctx = [(3 + 5 * i + j) % 290 + 3 for j in range(n)]
            blocks = paged.blocks(n + 1)
            paged.step([SeqWork(f"s{i}", ctx, 0, blocks, True)])
            works.append(SeqWork(f"s{i}", [42 + i], n, blocks, True))
        if together:
            return paged.step(works)
        return {w.req_id: paged.step([w])[w.req_id] for w in works}

    together, alone = run(True), run(False)
    for name, logits in alone.items():
        assert rel_err(together[name], logits) < 1e-4, name
