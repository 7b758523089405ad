"""The simulator against the real engine on a tiny random-weight model, in one run.

Calibrate on the quick grid, replay a small seeded workload on the engine on the wall clock
(bench/replay.py), simulate the same workload with the fitted profile under the engine's
own scheduler settings, and compare. Timings never decide pass/fail alone: the assertions
are ratios measured in the same run, with wide bounds (the full-size figures are the
benchmark in benchmarks/sim_fidelity.py), plus exact checks on what must match: token
counts, request count, the scheduler class.
"""
from __future__ import annotations

import numpy as np

from duetserve.bench.bench_metrics import summarize
from duetserve.bench.datasets import make_dataset
from duetserve.bench.replay import replay
from duetserve.bench.token_workload import (arrival_offsets, id_range_for_vocab,
                                             token_conversations)
from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.entrypoints.sim_calibrate import calibrate
from duetserve.loader import load_model
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.cost import shape_of
from duetserve.sim.run import simulate


def test_simulation_tracks_the_engine_on_a_tiny_model(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints["llama-gqa-untied"]
    loaded = load_model(path)
    profile, saved = calibrate(path, 2, quick=True, out=tmp_path / "tiny.json",
                               kv_cache_memory=0.05, verbose=False, loaded=loaded)
    assert saved.exists() and saved.with_suffix(".samples.json").exists()
    engine = EngineCore(EngineConfig(model=path, num_threads=2, kv_cache_memory=0.05,
                                     max_num_batched_tokens=32), loaded)
    id_range = id_range_for_vocab(engine.model_config.vocab_size)
    convs = token_conversations(make_dataset("chat", num_prompts=6, input_len="8:24",
                                             output_len="6:12", num_turns=2, seed=3), id_range)
    rate = 30.0
    real = replay(engine, convs, arrival_offsets(len(convs), rate, 1.0, 3).tolist())
    sim = simulate(convs, profile, ClusterSpec(1), rate, 1.0, 3, None,
                   engine.scheduler.config, id_range)

    assert len(real.records) == len(sim.records) == 12
    for r, s in zip(real.records, sim.records):
        assert r.success and s.success
        assert (r.req_id, r.prompt_tokens, r.output_tokens) == \
            (s.req_id, s.prompt_tokens, s.output_tokens)
    # the cost model on the engine's own steps: total time within 2x
    pred = sum(profile.cost.step_seconds(shape_of(sl)) for _, _, sl in real.steps)
    meas = sum(dt for _, dt, _ in real.steps)
    assert 0.5 < pred / meas < 2.0
    rs = summarize(real.records, real.duration_s, [50])
    ss = summarize(sim.records, sim.duration_s, [50])
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        ratio = ss[key]["median"] / rs[key]["median"]
        assert 1 / 3 < ratio < 3, (key, ratio)
    assert np.isclose(sim.duration_s, real.duration_s, rtol=0.5)
