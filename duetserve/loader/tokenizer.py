"""Tokenizer and chat template taken from the checkpoint.

From GGUF metadata (`tokenizer.ggml.*`: byte-level BPE vocabulary, merges, pre-tokenizer
type, token types, special ids, add-bos flag) we build a `tokenizers.Tokenizer`; from a
HF folder we load `tokenizer.json` as is.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from duetserve.config import ModelConfig
from duetserve.errors import CheckpointError
from duetserve.loader.chat_template import render_chat_template
from duetserve.loader.gguf_reader import GGUFFile
from duetserve.models import families

log = logging.getLogger(__name__)

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GGUF token types (llama.cpp's enum).
_CONTROL, _USER_DEFINED = 3, 4


def _byte_level():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {
    "gpt2": _byte_level,
    "default": _byte_level,
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
}


class Tokenizer:
    """Encode/decode plus the checkpoint's chat template and special tokens."""

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], add_bos: bool, chat_template: str | None,
                 special_tokens: dict[str, str]) -> None:
        self.tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_tokens = special_tokens   # bos_token, eos_token, ... as strings

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch releases the GIL (encode does not), so a long prompt encoded
        # on a worker thread does not stall the server's event loop. Same ids.
        ids = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None \
                and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def to_json(self) -> str:
        """The `tokenizers` JSON of the vocabulary, merges and added tokens (what
        llguidance builds its token trie from)."""
        return self.tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: object) -> str:
        if not self.chat_template:
            raise CheckpointError("this checkpoint has no chat template")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    self.special_tokens, **kwargs)

    @property
    def supports_tools(self) -> bool:
        """True when the chat template renders a `tools` variable (e.g. Qwen2.5's)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_vars: object) -> list[int]:
        """Token ids of the rendered conversation; `template_vars` (e.g. tools=[...]) are
        passed to the template."""
        # The template already writes any BOS it wants: no second one.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                    **template_vars),
                           add_special_tokens=False)

    @classmethod
    def from_gguf(cls, reader: GGUFFile, cfg: ModelConfig) -> "Tokenizer":
        """Build the tokenizer from the file's `tokenizer.ggml.*` metadata. The vocabulary
        and merges are decoded here (one list of str each) and live only while the
        `tokenizers` model is built: nothing per token outlives this call on the Python
        side (its strings would pin Python's small-object arenas for good)."""
        field = reader.get
        kind = field("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_spm(reader, cfg)
        if kind != "gpt2":
            raise CheckpointError(f"unsupported GGUF tokenizer model {kind!r}; supported: "
                                  "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            log.warning("GGUF pre-tokenizer %r unknown; using GPT-2's (known: %s)", pre,
                        ", ".join(PRE_TOKENIZERS))
            pre = "gpt2"
        tok, special = _gguf_bpe(reader, ignore_merges=pre in ("llama-bpe", "llama3"))
        tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        return cls(tok, bos_token_id=field("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=cfg.eos_token_ids,
                   add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
                   chat_template=field("tokenizer.chat_template"), special_tokens=special)

    @classmethod
    def _from_gguf_spm(cls, reader: GGUFFile, cfg: ModelConfig) -> "Tokenizer":
        """A SentencePiece vocabulary (GGUF tokenizer model "llama": Llama-2, Gemma) as a
        `tokenizers` BPE over "\u2581"-for-space text with byte fallback (<0xNN> tokens),
        its merges rebuilt from the vocabulary (`_spm_merges`)."""
        field = reader.get
        family = families.by_name(cfg.architecture)
        tok, special = _gguf_spm(reader, by_index=family.spm_merges_by_index)
        steps = [normalizers.Replace(" ", "\u2581")]
        if field("tokenizer.ggml.add_space_prefix", not family.spm_merges_by_index):
            steps.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(steps)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                         decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if len(steps) > 1
                                           else []))
        return cls(tok, bos_token_id=field("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=cfg.eos_token_ids,
                   add_bos=bool(field("tokenizer.ggml.add_bos_token", True)),
                   chat_template=field("tokenizer.chat_template"), special_tokens=special)

    @classmethod
    def from_hf_folder(cls, folder: str, cfg: ModelConfig) -> "Tokenizer":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"no tokenizer.json in {folder}")
        tok = HFTokenizer.from_file(path)
        tcfg: dict = {}
        tcfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(tcfg_path):
            with open(tcfg_path, encoding="utf-8") as f:
                tcfg = json.load(f)
        template = tcfg.get("chat_template")
        if isinstance(template, list):   # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = tcfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                special[key] = v
        bos_id = tok.token_to_id(special["bos_token"]) if "bos_token" in special else \
            cfg.bos_token_id
        eos_ids = cfg.eos_token_ids
        if not eos_ids and "eos_token" in special:
            eos_ids = (tok.token_to_id(special["eos_token"]),)
        # tokenizer.json's post-processor adds BOS when the model wants it.
        return cls(tok, bos_token_id=bos_id, eos_token_ids=tuple(eos_ids), add_bos=False,
                   chat_template=template, special_tokens=special)


def _spm_merges(tokens: list[str], scores, by_index: bool) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, best first: by the token's score (higher first), or by its index (lower first)
    where `by_index`; then by the longer left piece (transformers' generate_merges order)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        rank = i if by_index else -float(scores[i])
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                found.append((rank, -cut, left, right))
    found.sort(key=lambda m: (m[0], m[1]))
    return [(m[2], m[3]) for m in found]


def _gguf_spm(reader: GGUFFile, by_index: bool) -> tuple[HFTokenizer, dict[str, str]]:
    """The SentencePiece BPE of a GGUF file's vocabulary, scores and token types (tokens
    of spaces only are spelled with "\u2581", as the text is), control tokens special,
    user-defined ones added; and the special tokens' strings by role."""
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t
              for t in reader.get("tokenizer.ggml.tokens")]
    types = reader.get("tokenizer.ggml.token_type")
    if types is None:
        types = np.ones(len(tokens), dtype=np.int32)
    scores = reader.get("tokenizer.ggml.scores")
    if scores is None:
        scores = np.zeros(len(tokens), dtype=np.float32)
    unk = reader.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                 merges=_spm_merges(tokens, scores, by_index),
                                 byte_fallback=True, fuse_unk=True,
                                 unk_token=tokens[unk] if unk is not None else None))
    _add_typed_tokens(tok, tokens, types)
    return tok, _special_strings(reader, tokens)


def _add_typed_tokens(tok: HFTokenizer, tokens: list[str], types) -> None:
    """Register user-defined tokens as added tokens and control tokens as special ones,
    so text containing them maps to them whole. Mutates tok."""
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in np.flatnonzero(types == _USER_DEFINED)])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in np.flatnonzero(types == _CONTROL)])


def _special_strings(reader: GGUFFile, tokens: list[str]) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token strings, copied out of the vocabulary
    list so that list can be freed whole."""
    special = {}
    for name in ("bos", "eos", "unknown", "padding"):
        i = reader.get(f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            special[f"{key}_token"] = "".join(list(tokens[i]))   # a copy, not the list's
    return special


def _gguf_bpe(reader: GGUFFile, ignore_merges: bool) -> tuple[HFTokenizer, dict[str, str]]:
    """The byte-level BPE of a GGUF file's vocabulary, merges and token types, its added
    (user-defined) and special (control) tokens registered, and the special tokens'
    strings by role (bos_token, eos_token, unk_token, pad_token), copied out of the
    vocabulary list so that list can be freed whole."""
    tokens: list[str] = reader.get("tokenizer.ggml.tokens")
    types = reader.get("tokenizer.ggml.token_type")
    if types is None:
        types = np.ones(len(tokens), dtype=np.int32)
    if len(types) != len(tokens):
        raise CheckpointError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries "
                              f"for {len(tokens)} tokens")
    merges = [tuple(m.split(" ", 1)) for m in reader.get("tokenizer.ggml.merges") or ()]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                 ignore_merges=ignore_merges))
    del merges
    _add_typed_tokens(tok, tokens, types)
    return tok, _special_strings(reader, tokens)
