"""Tiny random-weight checkpoints built with transformers and saved as HF folders.

A plain module (not conftest.py) so tests can import it by name."""
from __future__ import annotations

import os

import torch


def byte_tokenizer(vocab_size: int = 300):
    """A byte-level BPE `tokenizers.Tokenizer` whose vocabulary is the 256 byte symbols
    plus filler, then <s> and </s> (the last two ids): one token per byte of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(len(vocab), vocab_size - 2):
        vocab[f"<x{i}>"] = i
    vocab["<s>"] = vocab_size - 2
    vocab["</s>"] = vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def _byte_tokenizer_json(path: str, vocab_size: int) -> None:
    byte_tokenizer(vocab_size).save(os.path.join(path, "tokenizer.json"))


TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=298, eos_token_id=299)

TINY_VARIANTS = {
    "llama-gqa-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3-rope-scaling": ("llama", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=500000.0)),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=None)),
}


def make_tiny_checkpoint(path: str, variant: str, seed: int = 0, **sizes) -> str:
    """Save a random-weight transformers model of `variant` as a HF folder at `path`
    (`sizes` override TINY's, e.g. hidden_size)."""
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig,
                              Qwen2Config)
    arch, extra = TINY_VARIANTS[variant]
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    cfg = cls(**{**TINY, **sizes}, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():   # random init is tiny; make logits spread so greedy is stable
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif p.dim() == 1 and p.shape[0] != cfg.hidden_size:
                p.normal_(0, 0.2)   # biases
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    _byte_tokenizer_json(path, cfg.vocab_size)
    return path
