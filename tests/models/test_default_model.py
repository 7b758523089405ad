"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers loading the
same GGUF file; and one mixed varlen batch against each sequence run alone."""
from __future__ import annotations

import os

import pytest
import torch

from duetserve.worker.batch import SeqWork
from model_helpers import PagedModel, rel_err

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Here is a short poem about the sea:\n", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def hf_gguf(default_model_path, hf_default_model):
    from transformers import AutoTokenizer
    folder, name = os.path.split(default_model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name), hf_default_model


def test_greedy_tokens_match_transformers(default_model, hf_gguf):
    _, hf = hf_gguf
    paged = PagedModel(default_model, num_blocks=64, block_size=16)
    for prompt in PROMPTS:
        ids = default_model.tokenizer.encode(prompt)
        with torch.no_grad():   # transformers stops early at eos; compare up to there
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32,
                              do_sample=False)[0, len(ids):].tolist()
        assert len(ref) == 32 or ref[-1] in default_model.config.eos_token_ids
        assert paged.greedy(ids, 32)[:len(ref)] == ref, prompt


def test_last_logits_close_to_transformers(default_model, hf_gguf):
    _, hf = hf_gguf
    ids = default_model.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(PagedModel(default_model, 16, 16).prompt_logits(ids), ref) < 1e-4


def test_tokenizer_matches_transformers(default_model, hf_gguf):
    tok, _ = hf_gguf
    # Digits are left out: transformers' GGUF conversion drops SmolLM2's per-digit split,
    # which llama.cpp's "smollm" pre-tokenizer (and ours) keep.
    for text in PROMPTS + ["Héllo wörld! Ça va? 世界 🙂", "  leading spaces\n\ttabs",
                           "<|im_start|>user\nhi<|im_end|>"]:
        assert default_model.tokenizer.encode(text) == tok.encode(text), text


def test_chat_template_string_matches_transformers(default_model, hf_gguf):
    tok, _ = hf_gguf
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}]
    ours = default_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ref = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == ref


def _run(paged: PagedModel, steps: list[list[SeqWork]]) -> dict[str, torch.Tensor]:
    out = {}
    for step in steps:
        out.update(paged.step(step))
    return out


def test_mixed_batch_equals_each_alone(default_model):
    """Two whole prompts, one prompt continued from a cached prefix, three single decode
    tokens: one flat batch gives the same logits per sequence as running each alone."""
    tok = default_model.tokenizer
    a = tok.encode("The quick brown fox jumps over the lazy dog.")
    b = tok.encode("In 1905, Albert Einstein published four papers that changed physics.")
    c = tok.encode("A long shared prefix about cooking pasta: boil salted water, add the pasta")
    contexts = [tok.encode(t) for t in ("Hello", "Once upon a time in a land far away",
                                        "import numpy as np\nimport torch\n")]
    bs = 16

    def plan(paged: PagedModel, together: bool) -> dict[str, torch.Tensor]:
        blocks = {name: paged.blocks(len(seq) + 1) for name, seq in
                  [("a", a), ("b", b), ("c", c)] + [(f"d{i}", s) for i, s in enumerate(contexts)]}
        # History: c's first 10 tokens and each decode context are computed beforehand.
        _run(paged, [[SeqWork("c", c[:10], 0, blocks["c"], False)]])
        for i, s in enumerate(contexts):
            _run(paged, [[SeqWork(f"d{i}", s, 0, blocks[f"d{i}"], True)]])
        final = [SeqWork("a", a, 0, blocks["a"], True), SeqWork("b", b, 0, blocks["b"], True),
                 SeqWork("c", c[10:], 10, blocks["c"], True)]
        final += [SeqWork(f"d{i}", [42 + i], len(s), blocks[f"d{i}"], True)
                  for i, s in enumerate(contexts)]
        return paged.step(final) if together else _run(paged, [[w] for w in final])

    mixed = plan(PagedModel(default_model, 64, bs), together=True)
    alone = plan(PagedModel(default_model, 64, bs), together=False)
    assert set(mixed) == {"a", "b", "c", "d0", "d1", "d2"}
    for name in mixed:
        assert rel_err(mixed[name], alone[name]) < 1e-4, name
