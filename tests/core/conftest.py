"""Helpers for the core tests: a scheduler factory and a fake model runner.

FakeRunner keeps the runner's side of the SchedulerOutput protocol (full data once, diffs
afterwards) and simulates the paged KV cache: every computed position writes a fingerprint
of its whole prefix into its slot (block_id, offset); every position a request attends to
must hold its own prefix's fingerprint. So a wrong prefix hit, a block shared while being
overwritten, or a wrong block table fails the test. Writes of a step happen before reads,
like the real runner (each layer writes the batch's K/V before attention reads).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from duetserve.config import SchedulerConfig
from duetserve.core.scheduler import Scheduler
from duetserve.outputs import ModelRunnerOutput, SchedulerOutput


@dataclass
class _RunnerReq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    fingerprints: list[int] = field(default_factory=list)

    def fingerprint(self, pos: int) -> int:
        while len(self.fingerprints) <= pos:
            i = len(self.fingerprints)
            prev = self.fingerprints[-1] if self.fingerprints else 0
            self.fingerprints.append(hash((prev, self.token_ids[i])))
        return self.fingerprints[pos]


class FakeRunner:
    def __init__(self, block_size: int, seed: int = 0, vocab_size: int = 50,
                 sample: list[int] | None = None) -> None:
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.reqs: dict[str, _RunnerReq] = {}
        self.slots: dict[tuple[int, int], int] = {}
        self.sample = sample   # fixed token to sample (None: random)

    def _slot(self, req: _RunnerReq, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // self.block_size], pos % self.block_size

    def apply_state(self, out: SchedulerOutput) -> None:
        """The runner's request states from the step's diffs (drop, learn new, extend)."""
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            self.reqs[new.req_id] = _RunnerReq(list(new.token_ids), list(new.block_ids),
                                               new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            req = self.reqs[cached.req_id]
            assert req.num_computed_tokens == cached.num_computed_tokens, cached.req_id
            req.block_ids.extend(cached.new_block_ids)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.apply_state(out)
        assert set(out.num_scheduled_tokens) == (
            {r.req_id for r in out.scheduled_new_reqs}
            | {r.req_id for r in out.scheduled_cached_reqs})
        # Write phase: K/V of every scheduled token.
        for req_id, num in out.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            end = req.num_computed_tokens + num
            assert num >= 1 and end <= len(req.token_ids), (req_id, num, end)
            assert len(req.block_ids) * self.block_size >= end, f"{req_id}: too few blocks"
            for pos in range(req.num_computed_tokens, end):
                self.slots[self._slot(req, pos)] = req.fingerprint(pos)
        # Read phase: attention over [0, end); then sample at the end of known tokens.
        sampled: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            end = req.num_computed_tokens + num
            for pos in range(end):
                assert self.slots.get(self._slot(req, pos)) == req.fingerprint(pos), (
                    f"{req_id}: wrong KV at position {pos}")
            req.num_computed_tokens = end
            if end == len(req.token_ids):
                token = self.sample if self.sample is not None else \
                    self.rng.randrange(self.vocab_size)
                req.token_ids.append(token)
                sampled[req_id] = [token]
            else:
                sampled[req_id] = []
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens),
                                 sampled_token_ids=sampled)


def make_config(**overrides: object) -> SchedulerConfig:
    kwargs: dict = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                        block_size=4, num_blocks=64)
    kwargs.update(overrides)
    return SchedulerConfig(**kwargs)


@pytest.fixture
def make_scheduler():
    """make_scheduler(**config_overrides) -> (Scheduler, FakeRunner)."""
    def factory(seed: int = 0, vocab_size: int = 50, sample: int | None = None,
                **overrides: object) -> tuple[Scheduler, FakeRunner]:
        config = make_config(**overrides)
        return Scheduler(config), FakeRunner(config.block_size, seed, vocab_size, sample)
    return factory


def run_step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list]:
    """schedule -> fake execute -> update; checks integrity and the step limits."""
    out = scheduler.schedule()
    cfg = scheduler.config
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
    assert scheduler.num_running <= cfg.max_num_seqs
    result = runner.execute(out)
    touched = scheduler.update_from_output(out, result)
    scheduler.check_integrity()
    return out, touched


@pytest.fixture
def step():
    return run_step
