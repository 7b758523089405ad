"""Sampler: distributions, penalties, seeds, logprobs and min_tokens, checked against
hand-computed expectations."""
from __future__ import annotations

import math

import pytest
import torch

from duetserve.sampling_params import SamplingParams
from duetserve.worker.sampler import (Sampler, apply_logit_edits,
                                      apply_temperature_and_truncation,
                                      compute_prompt_logprobs)
from duetserve.worker.sampling_metadata import SamplingMetadata

torch.set_num_threads(1)

# Probabilities at temperature 1, placed at shuffled token ids so that the sort/scatter
# inside the sampler is exercised: token PERM[i] has probability BASE[i].
BASE = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]
PERM = [5, 2, 7, 0, 3, 6, 1, 4]
V = len(BASE)
EOS = (0,)


def base_logits() -> torch.Tensor:
    logits = torch.empty(V)
    for p, tok in zip(BASE, PERM):
        logits[tok] = math.log(p)
    return logits


def expected(kept: list[float]) -> torch.Tensor:
    """Distribution over token ids given BASE-order weights (renormalised)."""
    out = torch.zeros(V, dtype=torch.float64)
    total = sum(kept)
    for w, tok in zip(kept, PERM):
        out[tok] = w / total
    return out


def build(params: list[SamplingParams], outputs: list[list[int]] | None = None,
          prompts: list[list[int]] | None = None, vocab_size: int = V) -> SamplingMetadata:
    num = len(params)
    outputs = outputs or [[] for _ in range(num)]
    return SamplingMetadata.build(
        params, prompts or [[] for _ in range(num)], outputs, [len(o) for o in outputs],
        EOS, vocab_size, "cpu")


def chi2_critical(df: int, p_upper: float = 1e-3) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.0902 for 1e-3)."""
    assert p_upper == 1e-3
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_matches(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit at p >= 1e-3; zero-probability tokens never drawn."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=V).double()
    assert counts[probs == 0].sum() == 0, (counts, probs)
    nz = probs > 0
    exp = probs[nz] * n
    stat = float(((counts[nz] - exp) ** 2 / exp).sum())
    df = int(nz.sum()) - 1
    if df > 0:
        assert stat < chi2_critical(df), (stat, df, counts / n, probs)


# T, top_k, top_p, min_p -> expected distribution in BASE order (hand computed).
CASES = {
    "plain": (1.0, -1, 1.0, 0.0, BASE),
    "temperature_0.5": (0.5, -1, 1.0, 0.0, [p * p for p in BASE]),
    "temperature_2": (2.0, -1, 1.0, 0.0, [math.sqrt(p) for p in BASE]),
    "top_k_3": (1.0, 3, 1.0, 0.0, BASE[:3]),
    # 0.4 + 0.25 = 0.65 < 0.7, + 0.15 = 0.8 >= 0.7: three tokens kept.
    "top_p_0.7": (1.0, -1, 0.7, 0.0, BASE[:3]),
    # after top-k=4: 0.4/0.9 + 0.25/0.9 = 0.722 >= 0.7: two tokens kept.
    "top_k_4_then_top_p_0.7": (1.0, 4, 0.7, 0.0, BASE[:2]),
    # threshold 0.2 * 0.4 = 0.08: keeps 0.4, 0.25, 0.15, 0.1.
    "min_p_0.2": (1.0, -1, 1.0, 0.2, BASE[:4]),
    # T=0.5: weights p^2 = .16 .0625 .0225 .01 ...; threshold .1 * .16 = .016: three kept.
    "temperature_0.5_min_p_0.1": (0.5, -1, 1.0, 0.1, [p * p for p in BASE[:3]]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_frequencies_match_processed_distribution(name: str) -> None:
    temperature, top_k, top_p, min_p, kept = CASES[name]
    num = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(1)
    out = Sampler()(base_logits().expand(num, V).contiguous(), build([params] * num))
    assert_matches(out.sampled_token_ids, expected(kept))


def test_seeded_rows_match_distribution() -> None:
    num = 4000
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=1000 + i) for i in range(num)]
    out = Sampler()(base_logits().expand(num, V).contiguous(), build(params))
    assert_matches(out.sampled_token_ids, expected(BASE[:3]))


def test_processed_logits_exact() -> None:
    logits = base_logits()[None, :]
    meta = build([SamplingParams(temperature=1.0, top_k=4, top_p=0.7)])
    processed = apply_temperature_and_truncation(logits, meta)
    kept = {PERM[0], PERM[1]}
    for tok in range(V):
        if tok in kept:
            assert processed[0, tok] == logits[0, tok]
        else:
            assert processed[0, tok] == float("-inf")


def test_penalties_and_bias_exact() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]] * 3)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),                                      # neutral: unchanged
        SamplingParams(logit_bias={4: 3.0, 5: -1.5}),
    ]
    # Row 0's prompt repeats tokens and shares token 2 with the output: penalised once.
    prompts, outputs = [[0, 1, 0, 2], [0, 1], [0]], [[2, 2, 3], [2, 2, 3], [4]]
    meta = build(params, outputs, prompts, vocab_size=6)
    got = apply_logit_edits(logits, meta)
    # Row 0. repetition (seen 0,1,2,3): 2/2=1, -1*2=-2, .5/2=.25, -.5*2=-1.
    # presence (output 2,3): -.5 each; frequency: token 2 count 2 -> -.5, token 3 -> -.25.
    want = torch.tensor([[1.0, -2.0, -0.75, -1.75, 1.0, 0.0],
                         [2.0, -1.0, 0.5, -0.5, 1.0, 0.0],
                         [2.0, -1.0, 0.5, -0.5, 4.0, -1.5]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    assert logits[0, 0] == 2.0                                  # input not mutated
    greedy = [SamplingParams(temperature=0, **{k: getattr(params[0], k) for k in (
        "repetition_penalty", "presence_penalty", "frequency_penalty")})]
    out = Sampler()(logits[:1], build(greedy, outputs[:1], prompts[:1], vocab_size=6))
    assert out.sampled_token_ids.tolist() == [0]                 # tie 1.0 vs 1.0: first


def test_all_greedy_fast_path() -> None:
    meta = build([SamplingParams(temperature=0)] * 3)
    assert meta.all_greedy and meta.no_penalties and meta.no_top_k and meta.no_top_p
    assert not meta.needs_logit_edits and not meta.needs_logprobs
    logits = torch.randn(3, V)
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprob_dicts() == [None, None, None]


def _run_steps(row_params: list[SamplingParams], target: int, num_steps: int,
               seed_of_logits: int, vocab: int = 50) -> list[int]:
    """Run the sampler step by step, feeding back each row's tokens; return the target's
    tokens. Each row's logits depend only on (row's params identity, step)."""
    outputs: list[list[int]] = [[] for _ in row_params]
    prompts = [[1, 2, 3] for _ in row_params]
    sampler = Sampler()
    for step in range(num_steps):
        rows = []
        for i, p in enumerate(row_params):
            g = torch.Generator().manual_seed(seed_of_logits + 97 * step + (0 if i == target
                                                                             else 1 + i))
            rows.append(torch.randn(vocab, generator=g) * 3)
        meta = SamplingMetadata.build(row_params, prompts, outputs,
                                      [len(o) for o in outputs], EOS, vocab, "cpu")
        sampled = sampler(torch.stack(rows), meta).sampled_token_ids.tolist()
        for i, tok in enumerate(sampled):
            outputs[i].append(tok)
    return outputs[target]


TARGET = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.3, seed=1234,
                        max_tokens=100)
OTHERS = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=7),
          SamplingParams(temperature=0.7, top_k=5), SamplingParams(min_p=0.1, seed=99),
          SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=3),
          SamplingParams(top_k=2, top_p=0.5, logit_bias={3: 5.0}),
          SamplingParams(temperature=0.5, presence_penalty=1.0, seed=1234),
          SamplingParams(min_tokens=5, stop_token_ids=[4], logprobs=0)]


def test_same_seed_same_tokens_alone_and_in_batch() -> None:
    torch.manual_seed(0)
    alone = _run_steps([TARGET], 0, 20, seed_of_logits=5)
    torch.manual_seed(12345)                     # different global RNG state
    batch = OTHERS[:3] + [TARGET] + OTHERS[3:]
    in_batch = _run_steps(batch, 3, 20, seed_of_logits=5)
    assert alone == in_batch
    assert len(set(alone)) > 3                   # actually random, not a constant
    other_seed = SamplingParams(**{**TARGET.__dict__, "seed": 1235})
    assert _run_steps([other_seed], 0, 20, seed_of_logits=5) != alone
    # The n samples of one seeded request differ (seed + index).
    samples = [_run_steps([SamplingParams(n=2, seed=3).clone_for_sample(i)], 0, 20, 5)
               for i in range(2)]
    assert samples[0] != samples[1]


def test_logprobs_of_processed_distribution() -> None:
    torch.manual_seed(3)
    vocab = 30
    logits = torch.randn(4, vocab) * 2
    params = [SamplingParams(temperature=0.7, top_k=10, min_p=0.05, logprobs=5),
              SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=3),
              SamplingParams(temperature=1.0),                       # no logprobs
              SamplingParams(temperature=1.2, top_p=0.8, logprobs=0, seed=4)]
    outputs = [[1, 2], [1, 2, 2], [], [5]]
    meta = SamplingMetadata.build(params, [[0]] * 4, outputs, [len(o) for o in outputs], EOS,
                                  vocab, "cpu")
    out = Sampler()(logits, meta)
    dicts = out.logprob_dicts()
    penalised = apply_logit_edits(logits, meta)
    reference = [apply_temperature_and_truncation(penalised, meta)[0].log_softmax(-1),
                 penalised[1].log_softmax(-1), None,
                 apply_temperature_and_truncation(penalised, meta)[3].log_softmax(-1)]
    assert dicts[2] is None
    for row in (0, 1, 3):
        ref = reference[row]
        chosen = int(out.sampled_token_ids[row])
        entries = list(dicts[row].items())
        assert entries[0][0] == chosen                                   # chosen first
        assert entries[0][1].logprob == pytest.approx(float(ref[chosen]), abs=1e-5)
        assert entries[0][1].rank == int((ref > ref[chosen]).sum()) + 1
        top = entries[1:]
        num = params[row].logprobs
        assert len(top) <= num
        lps = [lp.logprob for _, lp in top]
        assert lps == sorted(lps, reverse=True)                          # sorted
        want_top = ref.topk(num).indices.tolist() if num else []
        want_top = [t for t in want_top if ref[t] > float("-inf")]    # unsampleable: out
        assert [t for t, _ in top] == [t for t in want_top if t != chosen]
        for tok, lp in top:
            assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-5)
            assert lp.rank == want_top.index(tok) + 1
    assert int(out.sampled_token_ids[1]) == int(penalised[1].argmax())


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    # eos (0) most likely, stop id 5 next, then token 3.
    logits = torch.tensor([[9.0, 0.0, 0.0, 5.0, 0.0, 8.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], logprobs=2)
    sampled = []
    for num_out in range(5):
        meta = build([params], outputs=[[3] * num_out])
        out = Sampler()(logits, meta)
        sampled.append(int(out.sampled_token_ids[0]))
        if num_out < 3:
            d = out.logprob_dicts()[0]
            assert 0 not in d and 5 not in d                    # -inf entries left out
    assert sampled == [3, 3, 3, 0, 0]
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    assert int(Sampler()(logits, build([ignore])).sampled_token_ids[0]) == 0
    random_row = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[5])
    torch.manual_seed(0)
    out = Sampler()(logits.expand(500, V).contiguous(), build([random_row] * 500))
    assert not set(out.sampled_token_ids.tolist()) & {0, 5}


def test_prompt_logprobs_raw() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12)
    targets = torch.tensor([3, 0, 11, 7])
    result = compute_prompt_logprobs(logits, targets, 2)
    ref = logits.log_softmax(-1)
    assert len(result) == 4
    for t, d in enumerate(result):
        tok = int(targets[t])
        assert next(iter(d)) == tok
        assert d[tok].logprob == pytest.approx(float(ref[t, tok]), abs=1e-6)
        assert d[tok].rank == int((ref[t] > ref[t, tok]).sum()) + 1
        for i, top in enumerate(ref[t].topk(2).indices.tolist()):
            assert d[top].logprob == pytest.approx(float(ref[t, top]), abs=1e-6)
    assert compute_prompt_logprobs(torch.empty(0, 12), torch.empty(0, dtype=torch.long),
                                   3) == []


def _reference_nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """Token ids kept by top-p, by a plain sort of the whole row (float64)."""
    probs = row.double().softmax(-1)
    order = sorted(range(row.numel()), key=lambda i: -float(probs[i]))
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += float(probs[i])
    return kept


def test_top_p_large_vocab_candidates_and_fallback() -> None:
    """V > 4096: rows whose nucleus fits in 256 candidates, in 4096, and only in the whole
    vocabulary all match a plain full sort; top_p=1 keeps everything."""
    vocab = 6000
    g = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randn(vocab, generator=g) * 0.1,      # flat: > 4096
                          torch.randn(vocab, generator=g) * 1.5,      # medium
                          torch.randn(vocab, generator=g) * 5.0,      # peaky: < 256
                          torch.randn(vocab, generator=g)])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.8), SamplingParams(top_p=0.5),
              SamplingParams(top_p=1.0, top_k=-1)]
    meta = build(params, vocab_size=vocab)
    processed = apply_temperature_and_truncation(logits, meta)
    sizes = []
    for row, p in enumerate(params[:3]):
        kept = set(torch.isfinite(processed[row]).nonzero().squeeze(1).tolist())
        assert kept == _reference_nucleus(logits[row], p.top_p)
        assert torch.equal(processed[row][list(kept)], logits[row][list(kept)])
        sizes.append(len(kept))
    assert sizes[0] > 4096 and 256 < sizes[1] < 4096 and sizes[2] < 256, sizes
    assert torch.equal(processed[3], logits[3])
