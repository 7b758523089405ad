"""Seeded randomness keyed by position.

A seeded request's uniform for its output token i is a hash of (seed, i), not the i-th draw
of a stream. So its tokens depend only on the seed and the distributions, never on how the
steps were cut: what else was in the batch, a preemption and recompute, a prefill instance
handing over to a decode instance, or how many drafts speculation verified in a step (the
verifier uses the same uniform for position i as the plain sampler, see
spec_decode/rejection.py). Pure functions; nothing is mutated.
"""
from __future__ import annotations

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """u in [0, 1) (53 random bits) for output token `position` of a request seeded with
    `seed` (any int in SamplingParams' range [-2**63, 2**64): the high word keeps negative
    seeds apart from large positive ones)."""
    key = _mix(_mix(seed & _MASK) ^ ((seed >> 64) & _MASK))
    return (_mix(key ^ _mix(position)) >> 11) * (1.0 / (1 << 53))
