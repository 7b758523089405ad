"""The simulator against the real engine on a tiny random-weight model, in one run.

`duet simulate --calibrate --quick` runs on the tiny model (the code path; its timings are
not judged: tests share the machine). Then a small seeded chat workload is replayed on the
engine on the wall clock (bench/replay.py), the cost model is fitted on that run's own
steps (the engine measures every step; fitting on the same run keeps a neighbour's load
from skewing the comparison), and the simulator replays the same workload under the
engine's scheduler settings. Exact checks on what must match (requests, token counts);
ratios measured in the same run with wide bounds on the latencies (the full-size figures
are benchmarks/sim_fidelity.py's).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from duetserve.bench.bench_metrics import summarize
from duetserve.bench.datasets import make_dataset
from duetserve.bench.replay import replay
from duetserve.bench.token_workload import (arrival_offsets, id_range_for_vocab,
                                             token_conversations)
from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.step_cost import cache_key
from duetserve.entrypoints.cli import main as cli_main
from duetserve.entrypoints.sim_calibrate import calibrate, pooled_profile, rescale_to_now
from duetserve.loader import load_model
from duetserve.models.kernels import few_row_limit
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.fit import fit_cost
from duetserve.sim.noise import level_of
from duetserve.sim.profile import calibrated_profile, load_profile
from duetserve.sim.run import simulate


def test_simulation_tracks_the_engine_on_a_tiny_model(tiny_checkpoints, tmp_path,
                                                      capsys) -> None:
    path = tiny_checkpoints["llama-gqa-untied"]
    loaded = load_model(path, "auto", quantization="auto")    # as EngineCore loads it
    _, saved = calibrate(path, 2, quick=True, out=tmp_path / "tiny.json", kv_cache_memory=0.05,
                         verbose=False, loaded=loaded, max_foreign=float("inf"))
    profile = load_profile(saved)
    raw = json.loads(saved.with_suffix(".samples.json").read_text())
    assert profile.kind == "calibrated" and len(raw["samples"]) == profile.meta["fit"]["num_steps"]
    # the engine's settings are part of its key: calibrations of another --dtype never pool
    assert profile.meta["dtype"] == "auto"
    assert profile.meta["engine_key"] == cache_key(loaded.path, "auto/auto/auto", 2)
    assert cache_key(loaded.path, "float32/auto/auto", 2) != profile.meta["engine_key"]
    # the fit covers the grid and the serving scenario's steps (requests on the wall clock)
    serving = profile.meta["serving"]
    assert serving["steps"] > 0 and serving["requests"] == 2 * serving["conversations"] > 0
    assert raw["grid_steps"] + serving["steps"] == len(raw["samples"])
    # every step's start time is kept (the step-time noise is measured on them)
    assert len(raw["grid_starts"]) == raw["grid_steps"]
    assert sum(map(len, raw["serving_starts"])) == serving["steps"]
    assert all(b >= a for a, b in zip(raw["grid_starts"], raw["grid_starts"][1:]))
    # a cold grid step's idle time is the process's: the gap since the previous step of
    # either engine ended (the grid switches engines that share the weights and the cores)
    starts, grid = raw["grid_starts"], raw["samples"][:raw["grid_steps"]]
    gaps = [b - (a + s[1]) for a, b, s in zip(starts, starts[1:], grid)]
    colds = [(c, gap) for c, gap in zip(raw["cold"][1:raw["grid_steps"]], gaps) if c]
    assert colds and all(c == pytest.approx(max(gap, 1e-9), abs=1e-6) for c, gap in colds)
    assert max(c for c, _ in colds) >= 0.05        # the idle scenario slept 50 ms first
    assert profile.cost.flash_above == profile.meta["flash_above"] > 0
    # the kernel breakpoint is the engine's own switch (models/kernels.py), not fitted
    assert profile.meta["few_rows"] == few_row_limit(loaded.model) > 0
    assert profile.cost.breakpoint == profile.meta["few_rows"]
    assert profile.cost.chunk_rows == profile.meta["chunk_rows"] > 0    # the engine's layout
    # the speed probe ran on its own engine; its steps are kept apart from the fit's
    probe = profile.meta["speed_probe"]
    assert probe["steps"] == len(raw["probe"]["samples"]) == len(raw["probe"]["cold"]) > 0
    assert probe["ratio"] > 0
    # `duet simulate --speed-probe`: the probe again, the profile rescaled by now / then
    now = rescale_to_now(profile, quick=True, loaded=loaded, kv_cache_memory=0.05)
    factor = now.meta["speed_scale"]["factor"]
    assert factor > 0 and now.cost == profile.cost.scaled(factor)
    check_pooling(saved, tmp_path, capsys)

    engine = EngineCore(EngineConfig(model=path, num_threads=2, kv_cache_memory=0.05,
                                     max_num_batched_tokens=32), loaded)
    assert profile.scheduler["num_blocks"] == engine.num_blocks
    id_range = id_range_for_vocab(engine.model_config.vocab_size)
    convs = token_conversations(make_dataset("chat", num_prompts=8, input_len="8:24",
                                             output_len="6:12", num_turns=2, seed=3), id_range)
    rate = 20.0
    real = replay(engine, convs, arrival_offsets(len(convs), rate, 1.0, 3).tolist())
    cost, report = fit_cost([(sl, dt) for _, dt, sl in real.steps], cold=real.step_cold)
    own = calibrated_profile("replay-fit", cost, profile.scheduler, {})
    sim = simulate(convs, own, ClusterSpec(1), rate, 1.0, 3, None, engine.scheduler.config,
                   id_range)

    assert len(real.records) == len(sim.records) == 16
    for r, s in zip(real.records, sim.records):
        assert r.success and s.success
        assert (r.req_id, r.prompt_tokens, r.output_tokens) == \
            (s.req_id, s.prompt_tokens, s.output_tokens)
    busy = real.foreign_cpu_s / real.duration_s
    if busy > 0.3:
        pytest.skip(f"other processes used {busy:.2f} cores during the replay: its timings "
                    "measure them; the exact checks above passed")
    rs = summarize(real.records, real.duration_s, [50])
    ss = summarize(sim.records, sim.duration_s, [50])
    # Wide bounds: a gross error (a term off by an order of magnitude) fails, run-to-run
    # noise does not. Measured sim/real TPOT on this model: 0.67-0.89 run alone, 0.50 once
    # late in a full suite (16 requests of 6-12 tokens: a few slow steps move a median).
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        ratio = ss[key]["median"] / rs[key]["median"]
        assert 0.35 < ratio < 2.5, (key, ratio, report)


def check_pooling(saved, tmp_path, capsys) -> None:
    """sim_calibrate.pooled_profile over the calibration and a copy of it measured 25%
    slower (every step and probe step): one fit over both sets of steps, each
    calibration's level under it recorded (their ratio is the 1.25 put in); then `duet
    simulate --pool`, and the sets it refuses."""
    slow = tmp_path / "slow.json"
    slow.write_text(saved.read_text())
    raw = json.loads(saved.with_suffix(".samples.json").read_text())
    raw["samples"] = [(sl, 1.25 * dt) for sl, dt in raw["samples"]]
    raw["probe"]["samples"] = [(sl, 1.25 * dt) for sl, dt in raw["probe"]["samples"]]
    slow.with_suffix(".samples.json").write_text(json.dumps(raw))
    pooled = pooled_profile([saved, slow], tmp_path / "pooled.json")
    assert load_profile(tmp_path / "pooled.json").cost == pooled.cost
    assert pooled.meta["fit"]["num_steps"] == 2 * len(raw["samples"])
    fast_level, slow_level = pooled.meta["pooled"]["levels"]
    assert slow_level / fast_level == pytest.approx(1.25, rel=1e-6)
    assert pooled.cost.breakpoint == load_profile(saved).cost.breakpoint
    assert pooled.meta["speed_probe"]["steps"] == 2 * len(raw["probe"]["samples"])
    assert pooled.step_noise is None or pooled.step_noise.level == 0.0    # two: no spread
    # three calibrations: the run-to-run noise is their levels' spread
    mid = tmp_path / "mid.json"
    mid.write_text(saved.read_text())
    raw_mid = json.loads(saved.with_suffix(".samples.json").read_text())
    raw_mid["samples"] = [(sl, 1.1 * dt) for sl, dt in raw_mid["samples"]]
    mid.with_suffix(".samples.json").write_text(json.dumps(raw_mid))
    three = pooled_profile([saved, slow, mid], tmp_path / "pooled3.json")
    assert three.step_noise.level == pytest.approx(level_of(three.meta["pooled"]["levels"]))
    assert three.step_noise.level == pytest.approx(
        float(np.std(np.log([1.0, 1.25, 1.1]), ddof=1)), rel=1e-6)
    pooled_raw = json.loads((tmp_path / "pooled.samples.json").read_text())
    assert len(pooled_raw["samples"]) == pooled.meta["fit"]["num_steps"]
    # `duet simulate --pool`: the same fit from the command line, each level printed
    out = tmp_path / "cli-pooled.json"
    assert cli_main(["simulate", "--pool", str(saved), str(slow), "--profile-out",
                     str(out)]) == 0
    assert load_profile(out).cost == pooled.cost
    assert f"slow.json {slow_level:.3f}" in capsys.readouterr().out
    # what cannot pool is refused with the reason, and nothing is written
    other = tmp_path / "other-threads.json"
    doc = json.loads(saved.read_text())
    doc["meta"]["threads"] += 1
    other.write_text(json.dumps(doc))
    other.with_suffix(".samples.json").write_text(saved.with_suffix(".samples.json").read_text())
    bad = tmp_path / "bad.json"
    for argv, why in [([str(saved), str(other)], "calibrated another engine"),
                      ([str(saved), str(out)], "not one calibration"),
                      ([str(saved), str(tmp_path / "none.json")], "No such file"),
                      ([str(saved)], "--pool needs --profile-out")]:
        tail = ["--profile-out", str(bad)] if "needs" not in why else []
        assert cli_main(["simulate", "--pool", *argv, *tail]) == 2
        assert why in capsys.readouterr().err
        assert not bad.exists()
    assert cli_main(["simulate", "--pool", str(saved), str(slow), "--profile-out",
                     str(slow)]) == 2
    assert "one of the calibrations pooled" in capsys.readouterr().err


def test_replay_records_a_refusal_and_goes_on(tiny_checkpoints) -> None:
    """A turn the engine refuses (its waiting queue is full: EngineOverloadedError, the
    server's 503) is recorded as a failed request; the replay serves the rest."""
    path = tiny_checkpoints["llama-gqa-untied"]
    engine = EngineCore(EngineConfig(model=path, num_threads=2, kv_cache_memory=0.05,
                                     max_waiting_requests=2))
    id_range = id_range_for_vocab(engine.model_config.vocab_size)
    convs = token_conversations(make_dataset("chat", num_prompts=4, input_len="8:12",
                                             output_len="3:4", num_turns=2, seed=5), id_range)
    res = replay(engine, convs, [0.0] * 4)           # 4 first turns due at once, room for 2
    refused = [r for r in res.records if not r.success]
    assert [r.req_id for r in refused] == ["2-0", "3-0"]
    assert all("overloaded" in r.error for r in refused)
    served = [r for r in res.records if r.success]
    assert [r.req_id for r in served] == ["0-0", "0-1", "1-0", "1-1"]
    assert not engine.has_unfinished_requests()
