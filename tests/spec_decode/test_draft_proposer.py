"""The draft-model proposer's own KV bookkeeping: drafts the target kept are not
forwarded again (their KV is already right), short catch-ups run as decode rows, and
after any accept/reject history the draft's cache holds the same K/V as a proposer that
computed the whole sequence from scratch."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams
from duetserve.spec_decode.draft_model import DraftModelProposer
from duetserve.worker.model_runner import RunnerRequestState

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from spec_decode.test_spec_engine import draft_path, tiny  # noqa: E402,F401

BLOCK = 8


def _proposer(loaded) -> DraftModelProposer:
    return DraftModelProposer(loaded.model, loaded.config, 16, BLOCK, torch.float32,
                              loaded.config.vocab_size, (), "cpu")


def _state(tokens: list[int]) -> RunnerRequestState:
    return RunnerRequestState("r", list(tokens), 10, SamplingParams(temperature=0.0),
                              list(range(16)), 0)


def _kv(p: DraftModelProposer, num: int) -> torch.Tensor:
    """K and V of the last layer for positions 0 .. num-1 (the table is blocks 0, 1, ..)."""
    k, v = p.kv_caches[-1]          # [KVH, blocks, block_size, hd]
    return torch.stack([k.flatten(1, 2)[:, :num], v.flatten(1, 2)[:, :num]])


def test_kept_drafts_are_not_forwarded_again(tiny, draft_path) -> None:  # noqa: F811
    loaded = load_model(draft_path, quantization="int4")
    # One kernel for every row count here (1 to 18 rows): the crossover between the low-bit
    # GEMV (int8 activations) and the dense GEMM is timed at load, so it differs from
    # machine to machine, and the two paths round differently. This test is about which
    # positions get forwarded, not about the kernels (tests/models covers those).
    loaded.kernel_policy.lowbit_max_rows = 64
    p = _proposer(loaded)
    rows: list[int] = []
    p.model.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    st = _state([11, 40, 7, 99, 23, 150, 8, 61, 200, 17])
    d = p.propose({"r": st}, {"r": 4})[0]["r"]
    assert len(d) == 4 and rows == [10, 1, 1, 1]       # prompt (prefill), then 1 row each
    # all four kept, plus the target's bonus token: only d_3 (never forwarded) and the
    # bonus need the draft's KV
    rows.clear()
    st.token_ids += d + [5]
    d = p.propose({"r": st}, {"r": 3})[0]["r"]
    assert rows == [2, 1, 1]
    # d_0 kept, d_1 rejected (the target's token differs)
    rows.clear()
    st.token_ids += [d[0], (d[1] + 1) % 300]
    d = p.propose({"r": st}, {"r": 2})[0]["r"]
    assert rows == [1, 1]
    # the first draft rejected
    rows.clear()
    st.token_ids += [(d[0] + 1) % 300]
    p.propose({"r": st}, {"r": 1})
    assert rows == [1]
    fresh = _proposer(loaded)
    fresh.propose({"r": _state(st.token_ids)}, {"r": 1})
    n = len(st.token_ids)
    torch.testing.assert_close(_kv(p, n), _kv(fresh, n), atol=2e-3, rtol=2e-3)
    p.forget("r")
    rows.clear()
    p.propose({"r": st}, {"r": 1})
    assert rows == [n]                                   # forgotten: from scratch
