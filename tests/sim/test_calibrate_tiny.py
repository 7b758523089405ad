"""`duet simulate --calibrate --quick` on a tiny random-weight model, then a simulation on
the profile it saved: the code path end to end. Its timings are not judged (tests share
the machine; benchmarks/sim_fidelity.py compares full-size runs)."""
from __future__ import annotations

from duetserve.bench.datasets import make_dataset
from duetserve.bench.token_workload import id_range_for_vocab, token_conversations
from duetserve.core.step_time import TERMS, Layout, StepTime
from duetserve.engine.step_probe import GROUPED_MAX_SCORES
from duetserve.entrypoints.sim_calibrate import calibrate, format_report
from duetserve.loader import load_model
from duetserve.models.kernels import few_row_limit
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.profile import load_profile
from duetserve.sim.run import simulate


def test_calibration_saves_a_profile_the_simulator_runs(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints["llama-gqa-untied"]
    loaded = load_model(path, "auto", quantization="auto")    # as EngineCore loads it
    profile, saved = calibrate(path, 2, quick=True, out=tmp_path / "tiny.json",
                               kv_cache_memory=0.05, verbose=False, loaded=loaded,
                               max_foreign=float("inf"))
    again = load_profile(saved)
    assert again.kind == "calibrated" and isinstance(again.step_time, StepTime)
    assert again.step_time == profile.step_time
    # the layout is the engine's own: its kernel switch, chunk rows, attention split
    lay = again.step_time.layout
    assert lay == Layout(few_row_limit(loaded.model), 64,
                         GROUPED_MAX_SCORES // loaded.config.num_attention_heads)
    assert len(again.step_time.coef) == len(TERMS) and min(again.step_time.coef) >= 0
    # the fit covers the probes and the serving scenario's steps
    meta = again.meta
    assert meta["fit"]["num_steps"] == meta["probe_steps"] + meta["serving"]["steps"]
    assert meta["serving"]["requests"] == 2 * meta["serving"]["conversations"] > 0
    assert meta["kernel_switches"]["decode_stack"] is True and again.arrival_s > 0
    assert "step time:" in format_report(again, saved)
    # the simulated instance budgets steps as the engine did (its own start-up model)
    config = again.scheduler_config()
    assert (config.step_budget is None) == ("step_time" not in again.scheduler)
    convs = token_conversations(
        make_dataset("chat", num_prompts=6, input_len="4:16", output_len="2:6", num_turns=2,
                     seed=3), id_range_for_vocab(loaded.config.vocab_size))
    res = simulate(convs, again, ClusterSpec(1), 2.0, seed=3, config=config,
                   id_range=id_range_for_vocab(loaded.config.vocab_size))
    assert len(res.records) == 12 and all(r.success for r in res.records)
    assert all(r.output_tokens == r.expected_output_len for r in res.records)
