"""The verifier's math on bare tensors: greedy acceptance, and the rejection sampler's
output distribution equals the target's (chi-square), for one-hot (n-gram) drafts and
for draft distributions that differ from the target's."""
from __future__ import annotations

import math

import pytest
import torch

from duetserve.spec_decode.ngram import NgramProposer
from duetserve.spec_decode.rejection import verify_greedy, verify_sampled


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value of chi-square at p = 0.001 (z of the normal), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_goodness(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells with expected < 5 are pooled."""
    n = sum(counts)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c, p in zip(counts, probs):
        if n * p < 5:
            pool_o, pool_e = pool_o + c, pool_e + n * p
        else:
            obs.append(c)
            exp.append(n * p)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(obs) - 1


def test_greedy_accepts_while_drafts_match_then_emits_target() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]      # bonus token
    assert verify_greedy([4, 6], [5]) == [4]


@pytest.mark.parametrize("one_hot", [True, False])
def test_rejection_sampling_preserves_the_target_distribution(one_hot: bool) -> None:
    g = torch.Generator().manual_seed(0)
    vocab, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)   # differs from p
    gen = torch.Generator().manual_seed(1)
    first, second = [0] * vocab, [0] * vocab
    n = 12000
    for _ in range(n):
        if one_hot:
            drafts = [2, 3]          # e.g. an n-gram's: deterministic, q one-hot
            out = verify_sampled(p, drafts, None, gen)
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            out = verify_sampled(p, drafts, q, gen)
        first[out[0]] += 1
        if len(out) > 1:             # the first draft was accepted: out[1] ~ p_1
            assert out[0] == drafts[0]
    # token 1 is exactly p_0; condition token 2 on the first draft being kept
    stat, df = chi2_goodness(first, p[0].tolist())
    assert stat < chi2_critical(df), (stat, df)


def test_second_position_follows_target_given_first_accepted() -> None:
    g = torch.Generator().manual_seed(3)
    vocab = 5
    p = torch.softmax(torch.randn(3, vocab, generator=g), dim=-1)
    gen = torch.Generator().manual_seed(4)
    counts = [0] * vocab
    for _ in range(8000):
        out = verify_sampled(p, [1, 2], None, gen)
        if out[0] == 1:
            counts[out[1]] += 1
    stat, df = chi2_goodness(counts, p[1].tolist())
    assert stat < chi2_critical(df), (stat, df)


def test_seeded_verification_is_reproducible() -> None:
    p = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(0)), dim=-1)
    runs = [[verify_sampled(p, [1, 2], None, gen) for _ in range(50)]
            for gen in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))]
    assert runs[0] == runs[1]


def test_ngram_longest_match_most_recent_occurrence() -> None:
    prop = NgramProposer(1, 3)
    assert prop.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert prop.propose([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 2) == [7, 2]   # most recent [2, 3]
    assert prop.propose([7, 2, 3, 1, 8, 3], 2) == [1, 8]               # only 1-gram [3]
    assert NgramProposer(2, 3).propose([7, 2, 3, 1, 8, 3], 2) == []    # below prompt_lookup_min
    assert prop.propose([4, 5, 6], 2) == []
    assert prop.propose([1, 2, 1], 4) == [2, 1]                         # up to the end
