"""Outputs travel as deltas: 32 requests generating 2,000 tokens each, the model replaced
by a fake executor so only the engine's own output handling runs. Each step's delta holds
one token, one logprob and its text; the memory a step allocates does not grow with the
output length (counted with tracemalloc, not timed); the deltas concatenate to the
cumulative view (OutputAccumulator) and to the decoded tokens."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tracemalloc

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.outputs import Logprob, ModelRunnerOutput, OutputAccumulator, SchedulerOutput
from duetserve.sampling_params import SamplingParams

NUM_REQUESTS, NUM_TOKENS = 32, 2000
# NOTE: both windows past 256 tokens, where counts stop being CPython's cached small ints.
EARLY, LATE = range(300, 400), range(NUM_TOKENS - 150, NUM_TOKENS - 50)


def _long_context_copy(src: str, dst: str) -> str:
    """The tiny checkpoint with room for 2,000 output tokens."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 4096
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


class FakeExecutor:
    """Samples token `letters[k % len]` (with its logprob) for every request whose slice
    reaches the end of its tokens; runs no model."""

    def __init__(self, engine: EngineCore, letters: list[int]) -> None:
        self.engine, self.letters, self.k = engine, letters, 0

    def execute(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, str]]:
        out = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids={},
                                logprobs={})
        for d in (*so.scheduled_cached_reqs, *so.scheduled_new_reqs):
            req = self.engine.scheduler.requests[d.req_id]
            if d.num_computed_tokens + so.num_scheduled_tokens[d.req_id] == req.num_tokens:
                tok = self.letters[self.k % len(self.letters)]
                self.k += 1
                out.sampled_token_ids[d.req_id] = [tok]
                out.logprobs[d.req_id] = [{tok: Logprob(-0.25 * (self.k % 7), 1)}]
            else:
                out.sampled_token_ids[d.req_id] = []
        return out, {}


def test_long_outputs_cost_the_same_per_step(tiny_checkpoints, tmp_path) -> None:
    path = _long_context_copy(tiny_checkpoints["llama-gqa-tied"], str(tmp_path / "m"))
    engine = EngineCore(EngineConfig(model=path, num_threads=1, kv_cache_memory=0.1,
                                     max_num_batched_tokens=256, max_num_seqs=NUM_REQUESTS,
                                     enable_prefix_caching=False,
                                     check_integrity_when_idle=True))
    tok = engine.tokenizer
    letters = [i for i in range(200) if len(tok.decode([i])) == 1
               and tok.decode([i]).isalnum()][:20]
    assert len(letters) == 20
    engine.executor = FakeExecutor(engine, letters)
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    for i in range(NUM_REQUESTS):
        engine.add_request(str(i), [5, 6, 7, i + 10], params)

    acc = OutputAccumulator()
    texts: dict[str, list[str]] = {str(i): [] for i in range(NUM_REQUESTS)}
    streamed_lps: dict[str, list] = {str(i): [] for i in range(NUM_REQUESTS)}
    peaks: dict[int, int] = {}
    finals = {}
    step = 0
    while engine.has_unfinished_requests():
        measured = step in EARLY or step in LATE
        if measured:
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
        deltas = engine.step_deltas()
        if measured:
            peaks[step] = tracemalloc.get_traced_memory()[1] - before
            tracemalloc.stop()
        assert len(deltas) == NUM_REQUESTS
        for d in deltas:
            (o,) = d.outputs
            assert len(o.token_ids) == 1 and len(o.logprobs) == 1   # this step's only
            texts[d.request_id].append(o.text)
            streamed_lps[d.request_id].extend(o.logprobs)
            out = acc.add(d)
            if out.finished:
                finals[d.request_id] = out
        step += 1

    assert step == NUM_TOKENS
    early = statistics.median(peaks[s] for s in EARLY)
    late = statistics.median(peaks[s] for s in LATE)
    # Nothing in a step copies a request's whole output: the same bytes at token 350 and
    # token 1,900 (a per-step copy of the token or logprob list alone would add 16 KB).
    assert late <= early + 512, (early, late)
    for req_id, out in finals.items():
        (o,) = out.outputs
        assert len(o.token_ids) == len(o.logprobs) == NUM_TOKENS
        assert "".join(texts[req_id]) == o.text == tok.decode(o.token_ids)
        assert o.finish_reason == "length"
        assert [next(iter(lp)) for lp in o.logprobs] == o.token_ids
        assert streamed_lps[req_id] == o.logprobs      # same ids, logprobs and ranks
