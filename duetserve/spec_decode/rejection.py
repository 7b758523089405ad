"""The lossless verifier: rejection sampling over k drafts (Leviathan et al., 2023).

One request's verify slice computed k+1 target distributions:

    position:   N-1      N        N+1   ...   N+k-1
    input:      t_last   d_0      d_1   ...   d_{k-1}
    target:     p_0      p_1      p_2   ...   p_k        (p_j scores the token at N+j)
    draft:      q_0      q_1            ...   q_{k-1}    (q_j proposed d_j)

Greedy requests: accept d_j while d_j == argmax p_j; at the first mismatch emit argmax p_j
instead and stop; if all k match, emit argmax p_k (the bonus token). The output is exactly
the target's greedy continuation.

Sampled requests: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)). On the first
rejection emit a token drawn from the residual r_j = normalize(max(p_j - q_j, 0)) and stop;
if all k are accepted, emit a token drawn from p_k. Why this is exactly p_j: the chance to
emit x at step j is
    q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) r(x)
  = min(q(x), p(x)) + max(p(x) - q(x), 0) = p(x),
since 1 - sum_y min(q(y), p(y)) = sum_y max(p(y) - q(y), 0) is r's normaliser.
n-gram drafts are deterministic: q_j is one-hot at d_j, so the acceptance probability is
p_j(d_j) and the residual is p_j with d_j removed, renormalised.

p_j is the target's distribution after the request's full sampling pipeline (bias,
min_tokens, penalties with the history up to d_{j-1}, temperature, top-k, top-p, min-p),
so what is preserved is exactly what the sampler would have drawn from. Random numbers
come from the global RNG.

Seeded sampled requests are verified by coupling instead (verify_coupled): the token at
output position i is the target's own inverse-CDF sample x_i = F_p_i^-1(u_i), with the
uniform u_i = seeded_uniform(seed, i) the plain sampler would use there, and draft d_i is
accepted iff d_i == x_i. Every emitted token is x_i, so the output is token for token what
the request gives without speculation (the same seed, the same distributions), whatever
number of drafts each step verified; speculation only changes how many come per step.
- n-gram drafts (q one-hot at d): d is accepted with probability p(d), as above.
- draft model: the draft proposes F_q_i^-1(u_i) with the same uniform, so it is accepted
  when both inverse CDFs land on the same token: probability sum_x of the overlap of x's
  intervals [F(x-), F(x)) under p and q. That equals sum_x min(p(x), q(x)) when the
  tokens before x carry the same mass in p and q, and falls short by the CDFs' drift
  otherwise (mass moved between distant ids), which top-k / top-p truncation keeps small.
"""
from __future__ import annotations

import torch


def verify_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """target_ids: argmax of p_0..p_k (k+1 ids). Returns the accepted drafts followed by
    the target's own token (between 1 and k+1 tokens)."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        out.append(target_ids[j])
        if target_ids[j] != draft:
            return out
    out.append(target_ids[len(drafts)])
    return out


def _uniform(generator: torch.Generator | None) -> float:
    if generator is None:
        return float(torch.rand(1, dtype=torch.float64))
    return float(torch.rand(1, generator=generator, dtype=torch.float64,
                            device=generator.device))


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id from the (unnormalised, non-negative) weights `probs` [V], by inverse CDF
    with one uniform draw (the sampler's method)."""
    return sample_at(probs, _uniform(generator))


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The id whose inverse-CDF interval of the weights `probs` [V] holds u in [0, 1)
    (the sampler's rule: the first id whose cumulative mass exceeds u * total)."""
    cdf = probs.double().cumsum(dim=0)
    total = cdf[-1]
    target = min(u * float(total), float(torch.nextafter(total, total * 0)))
    idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64),
                                 right=True))
    return min(idx, probs.shape[0] - 1)


def verify_sampled(target_probs: torch.Tensor, drafts: list[int],
                   draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """target_probs: p_0..p_k [k+1, V]; draft_probs: q_0..q_{k-1} [k, V], or None for
    deterministic (one-hot) drafts. Returns the accepted drafts then one more token
    (the residual's on a rejection, p_k's bonus when all are accepted). Draws at most
    k + 1 uniforms from `generator`; mutates nothing else."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = target_probs[j]
        p_x = float(p[draft])
        q_x = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        # accept with probability min(1, p(x) / q(x))  <=>  u * q(x) < p(x)
        if _uniform(generator) * q_x < p_x:
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0            # max(p - onehot(x), 0)
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: nothing left to fix
            residual = p
        out.append(sample_from(residual, generator))
        return out
    out.append(sample_from(target_probs[len(drafts)], generator))
    return out


def verify_coupled(target_probs: torch.Tensor, drafts: list[int],
                   uniforms: list[float]) -> list[int]:
    """target_probs: p_0..p_k [k+1, V]; uniforms: u_0..u_k, the seeded uniforms of the k+1
    output positions. Returns the accepted drafts then the target's own token at the first
    mismatch (or the bonus p_k token): x_j = sample_at(p_j, u_j) at every position, the
    plain sampler's token. Mutates nothing."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        x = sample_at(target_probs[j], uniforms[j])
        out.append(x)
        if x != draft:
            return out
    out.append(sample_at(target_probs[len(drafts)], uniforms[len(drafts)]))
    return out
