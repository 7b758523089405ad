"""SamplingParams validation: every bad value raises an error naming the field."""
from __future__ import annotations

import pytest

from duetserve.errors import RequestError
from duetserve.sampling_params import SamplingParams, SamplingParamsError

INVALID = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"slo_ttft_ms": 0}, "slo_ttft_ms"),
    ({"slo_tpot_ms": float("inf")}, "slo_tpot_ms"),
    ({"slo_tpot_ms": "fast"}, "slo_tpot_ms"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_value_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_error_is_value_error_and_request_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    assert issubclass(SamplingParamsError, RequestError)


def test_error_message_states_range() -> None:
    with pytest.raises(SamplingParamsError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_valid_edges_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.5, max_tokens=None,
                   min_tokens=3, logprobs=0, prompt_logprobs=20, seed=0)
    SamplingParams(top_k=-1, max_tokens=1, min_tokens=1, logit_bias={0: -100, 3: 100})
    SamplingParams(slo_ttft_ms=86_400_000.0, slo_tpot_ms=0.5)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[7, 8], logit_bias={"12": 1})
    assert p.stop == ("###",) and p.stop_token_ids == (7, 8)
    assert p.logit_bias == {12: 1.0}
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    d = SamplingParams()
    assert (d.n, d.temperature, d.top_p, d.top_k, d.max_tokens) == (1, 1.0, 1.0, -1, 16)
    assert not d.is_greedy and SamplingParams(temperature=0).is_greedy


def test_frozen_and_bias_copied() -> None:
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[1] = 50.0
    assert p.logit_bias == {1: 2.0}
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]
    hash(p)  # usable as a key despite the dict field


def test_validate_for_vocab_names_unknown_token() -> None:
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).validate_for_vocab(100)
    with pytest.raises(SamplingParamsError, match=r"logit_bias token id 100"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    with pytest.raises(SamplingParamsError, match=r"stop_token_ids token id 5000"):
        SamplingParams(stop_token_ids=[3, 5000]).validate_for_vocab(100)


def test_clone_for_sample() -> None:
    p = SamplingParams(n=3, seed=10, temperature=0.7)
    clones = [p.clone_for_sample(i) for i in range(3)]
    assert [c.seed for c in clones] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 for c in clones)
    assert SamplingParams(n=2).clone_for_sample(1).seed is None
    with pytest.raises(SamplingParamsError):
        p.clone_for_sample(3)
