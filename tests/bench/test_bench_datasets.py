"""Datasets and the arrival process of `duet bench serve` (no timing assertions)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from duetserve.bench.datasets import (
    VOCAB,
    DatasetError,
    arrival_intervals,
    make_dataset,
    parse_len_range,
)


def test_poisson_intervals_mean_and_cv() -> None:
    # rate 4 req/s, burstiness 1 -> exponential gaps: mean 0.25 s, std 0.25 s (CV 1)
    gaps = arrival_intervals(20000, rate=4.0, burstiness=1.0, seed=0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    # same seed -> same schedule
    assert np.array_equal(gaps, arrival_intervals(20000, 4.0, 1.0, seed=0))


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_mean_changes_variance(burstiness: float) -> None:
    # gamma(shape=b, scale=1/(rate*b)): mean 1/rate, variance 1/(rate^2 * b)
    rate = 2.0
    gaps = arrival_intervals(20000, rate=rate, burstiness=burstiness, seed=1)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.1)


def test_infinite_rate_and_bad_rate() -> None:
    assert arrival_intervals(5, math.inf).tolist() == [0.0] * 5
    with pytest.raises(DatasetError):
        arrival_intervals(5, 0.0)


def test_parse_len_range() -> None:
    assert parse_len_range("128") == (128, 128)
    assert parse_len_range("32:512") == (32, 512)
    for bad in ("0", "9:3", "abc", "1:x"):
        with pytest.raises(DatasetError):
            parse_len_range(bad)


def test_random_dataset_lengths_and_seed() -> None:
    convs = make_dataset("random", num_prompts=50, input_len="4:9", output_len="2:3", seed=7)
    assert len(convs) == 50 and all(len(c) == 1 for c in convs)
    for (t,) in convs:
        words = t.prompt.split()
        assert len(words) == t.input_len and 4 <= t.input_len <= 9 and 2 <= t.output_len <= 3
        assert set(words) <= set(VOCAB)
    again = make_dataset("random", num_prompts=50, input_len="4:9", output_len="2:3", seed=7)
    assert [c[0].prompt for c in convs] == [c[0].prompt for c in again]


def test_prefix_dataset_shares_prefix() -> None:
    convs = make_dataset("prefix", num_prompts=5, prefix_len=16, input_len="4", output_len="8", seed=0)
    prefixes = {" ".join(c[0].prompt.split()[:16]) for c in convs}
    assert len(prefixes) == 1
    assert all(c[0].input_len == 20 and len(c[0].prompt.split()) == 20 for c in convs)


def test_chat_and_jsonl(tmp_path) -> None:
    convs = make_dataset("chat", num_prompts=3, num_turns=4, input_len="5", output_len="6", seed=0)
    assert len(convs) == 3 and all(len(c) == 4 for c in convs)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a b c", "output_len": 5}) + "\n\n" + json.dumps({"prompt": "x"}) + "\n")
    convs = make_dataset("jsonl", num_prompts=10, output_len="9", path=str(path))
    assert [(c[0].prompt, c[0].output_len) for c in convs] == [("a b c", 5), ("x", 9)]
    path.write_text("{not json}\n")
    with pytest.raises(DatasetError):
        make_dataset("jsonl", num_prompts=1, path=str(path))
