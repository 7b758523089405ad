"""Workloads of `duet bench serve`: what to send (datasets) and when (arrival process).

Every dataset is a list of *conversations*; a conversation is a list of turns that are
sent one after another (each turn waits for the previous reply). Single-request datasets
(random, prefix, jsonl) are conversations of one turn, so the load generator has one
code path.

Prompt lengths are in *approximate* tokens: random text is made of words from a fixed
vocabulary of common short English words, which most BPE tokenizers encode as about one
token each (with the leading space). The server's `usage` counts are the truth that the
benchmark reports.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Common English words; each is usually one token (with its leading space).
VOCAB: tuple[str, ...] = tuple(
    """the of and to in is you that it he was for on are as with his they at be this
    have from or one had by word but not what all were we when your can said there use
    an each which she do how their if will up other about out many then them these so
    some her would make like him into time has look two more write go see number no way
    could people my than first water been call who oil its now find long down day did
    get come made may part over new sound take only little work know place year live me
    back give most very after thing our just name good sentence man think say great where
    help through much before line right too mean old any same tell boy follow came want
    show also around form three small set put end does another well large must big even
    such because turn here why ask went men read need land different home us move try
    kind hand picture again change off play spell air away animal house point page letter
    mother answer found study still learn should world high every near add food between
    own below country plant last school father keep tree never start city earth eye light
    thought head under story saw left few while along might close something seem next hard
    open example begin life always those both paper together got group often run""".split()
)


class DatasetError(ValueError):
    """A dataset option the user can fix (bad range, missing file, bad JSONL line)."""


@dataclass(slots=True)
class BenchTurn:
    """One request to send. `prompt` is the completions prompt, or this turn's user
    message for the chat endpoint. `input_len` is approximate (words)."""

    prompt: str
    input_len: int
    output_len: int


Conversation = list[BenchTurn]


def parse_len_range(spec: str | int) -> tuple[int, int]:
    """'128' -> (128, 128); '32:512' -> (32, 512), both ends inclusive."""
    text = str(spec).strip()
    try:
        lo, _, hi = text.partition(":")
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise DatasetError(f"length {spec!r}: expected N or MIN:MAX (integers)") from None
    if lo_i < 1 or hi_i < lo_i:
        raise DatasetError(f"length {spec!r}: need 1 <= MIN <= MAX")
    return lo_i, hi_i


def sample_lengths(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> list[int]:
    """n integers uniform in [lo, hi] (inclusive)."""
    lo, hi = bounds
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_text(rng: np.random.Generator, num_words: int) -> str:
    """`num_words` words drawn uniformly from VOCAB, joined by spaces."""
    idx = rng.integers(0, len(VOCAB), size=num_words)
    return " ".join(VOCAB[i] for i in idx)


def random_dataset(n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[Conversation]:
    """n independent one-turn requests with random lengths in the given ranges."""
    rng = np.random.default_rng(seed)
    ins, outs = sample_lengths(rng, input_len, n), sample_lengths(rng, output_len, n)
    return [[BenchTurn(random_text(rng, i), i, o)] for i, o in zip(ins, outs)]


def prefix_dataset(
    n: int, prefix_len: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[Conversation]:
    """n requests sharing one random prefix of `prefix_len` words, each followed by its
    own random suffix of `input_len` words (exercises prefix caching)."""
    rng = np.random.default_rng(seed)
    prefix = random_text(rng, prefix_len) if prefix_len > 0 else ""
    ins, outs = sample_lengths(rng, input_len, n), sample_lengths(rng, output_len, n)
    convs = []
    for i, o in zip(ins, outs):
        text = f"{prefix} {random_text(rng, i)}" if prefix else random_text(rng, i)
        convs.append([BenchTurn(text, prefix_len + i, o)])
    return convs


def jsonl_dataset(path: str | Path, n: int | None, default_output_len: int) -> list[Conversation]:
    """Requests from a JSONL file of {"prompt": str, "output_len": int}; the first n lines
    (all when n is None). A line without output_len uses `default_output_len`."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    convs: list[Conversation] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt = str(obj["prompt"])
                out = int(obj.get("output_len", default_output_len))
            except (ValueError, KeyError, TypeError) as e:
                raise DatasetError(f"{p}:{lineno}: expected {{\"prompt\", \"output_len\"}} ({e})") from None
            convs.append([BenchTurn(prompt, len(prompt.split()), out)])
            if n is not None and len(convs) >= n:
                break
    if not convs:
        raise DatasetError(f"{p}: no requests")
    return convs


def chat_dataset(
    n: int, num_turns: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[Conversation]:
    """n conversations of `num_turns` turns; each turn is a fresh random user message.
    The load generator resends the earlier user messages and the actual replies."""
    rng = np.random.default_rng(seed)
    convs = []
    for _ in range(n):
        ins, outs = sample_lengths(rng, input_len, num_turns), sample_lengths(rng, output_len, num_turns)
        convs.append([BenchTurn(random_text(rng, i), i, o) for i, o in zip(ins, outs)])
    return convs


def make_dataset(
    name: str,
    *,
    num_prompts: int,
    input_len: str = "256",
    output_len: str = "64",
    prefix_len: int = 256,
    num_turns: int = 3,
    path: str | None = None,
    seed: int = 0,
) -> list[Conversation]:
    """Build the named dataset ('random', 'prefix', 'jsonl', 'chat')."""
    in_r, out_r = parse_len_range(input_len), parse_len_range(output_len)
    if name == "random":
        return random_dataset(num_prompts, in_r, out_r, seed)
    if name == "prefix":
        return prefix_dataset(num_prompts, prefix_len, in_r, out_r, seed)
    if name == "chat":
        return chat_dataset(num_prompts, num_turns, in_r, out_r, seed)
    if name == "jsonl":
        if not path:
            raise DatasetError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_dataset(path, num_prompts, out_r[1])
    raise DatasetError(f"unknown dataset {name!r}")


def arrival_intervals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds between consecutive arrivals, n values (the first is the wait before the
    first request).

    Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate for any burstiness,
    variance 1/(rate^2 * burstiness). burstiness = 1 is a Poisson process (exponential
    gaps); < 1 is burstier, > 1 more regular. rate = inf sends everything at once.
    """
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise DatasetError("request rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
