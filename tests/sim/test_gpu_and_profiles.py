"""GPU step times (the roofline behind the same interface), NNLS and profiles (pure
arithmetic, no engine)."""
from __future__ import annotations

import numpy as np
import pytest

from duetserve.config import ConfigError
from duetserve.core.step_fit import nnls
from duetserve.core.step_time import Layout, StepShape, StepTime
from duetserve.metrics.cost_model import param_count, step_work
from duetserve.metrics.hardware import GPU_PROFILES
from duetserve.metrics.known_models import GEMMA_3_270M, LLAMA_3_8B, get_known_model
from duetserve.request import Request
from duetserve.sampling_params import SamplingParams
from duetserve.sim.gpu import GPU_LAYOUT, Efficiency, fit_efficiency, roofline_cost, unit_costs
from duetserve.sim.instance import SimInstance
from duetserve.sim.profile import calibrated_profile, load_profile, roofline_profile


def shape(items) -> StepShape:
    return StepShape.of(items, GPU_LAYOUT)


def test_unit_costs_reproduce_the_cost_model() -> None:
    """FLOPs and bytes rebuilt from the per-unit figures equal metrics.cost_model's."""
    u = unit_costs(LLAMA_3_8B)
    step = [(7, 100), (1, 300), (1, 0)]
    ref = step_work(LLAMA_3_8B, step, weight_dtype="bf16", kv_dtype="bf16")
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in step)
    flops = u["flops_per_token"] * 9 + u["flops_per_pair"] * pairs + u["flops_per_logit"] * 3
    assert flops == pytest.approx(ref.flops, rel=1e-12)
    kv = u["kv_bytes_per_token"]
    assert kv * 400 == pytest.approx(ref.kv_read_bytes)
    assert u["weight_bytes"] + u["head_bytes"] == pytest.approx(
        ref.weight_bytes - dict(ref.byte_terms)["weights.embedding"])


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    hw = GPU_PROFILES["h100-sxm"]
    eff = Efficiency(mfu=0.5, mbu=0.8, step_overhead_ms=0.0, request_overhead_ms=0.0)
    model = roofline_cost(LLAMA_3_8B, hw, eff)
    u = unit_costs(LLAMA_3_8B)
    byte_s, flop_s = hw.mem_bandwidth * 0.8, hw.peak("bf16") * 0.5
    expect = ((u["weight_bytes"] + u["head_bytes"]) / byte_s          # linear: weights
              + u["kv_bytes_per_token"] * 1000 / byte_s               # decode attention: KV
              + u["kv_bytes_per_token"] / byte_s)                     # KV write
    assert model.seconds(shape([(1, 1000, 1)])) == pytest.approx(expect)
    lin = (u["flops_per_token"] * 4096 + u["flops_per_logit"]) / flop_s
    attn = u["flops_per_pair"] * (4096 * 4097 // 2) / flop_s
    assert model.seconds(shape([(4096, 0, 1)])) == pytest.approx(
        lin + attn + u["kv_bytes_per_token"] * 4096 / byte_s)
    # a chunk after context is priced by its pairs (GPU layout: every chunk on flash)
    after = shape([(512, 4096, 1)])
    assert after.chunk_pairs == 512 * 4096 + 512 * 513 // 2 and after.chunk_scores == 0


def test_fit_efficiency_recovers_the_factors_that_made_the_times() -> None:
    """Steps timed by a roofline with MFU 0.42, MBU 0.63 and 0.5 ms a step (what
    benchmarks/gpu_step_probe.py measures on a GPU) give those factors back, and the caps
    hold when the truth lies above them."""
    hw = GPU_PROFILES["h200"]
    truth = roofline_cost(LLAMA_3_8B, hw, Efficiency(mfu=0.42, mbu=0.63, step_overhead_ms=0.5))
    shapes = [shape(items) for items in (
        [(2048, 0, 1)], [(512, 4096, 1)], [(1, 256, 1)], [(1, 4096, 1)] * 16,
        [(1, 1024, 1)] * 128, [(512, 0, 1)] + [(1, 1024, 1)] * 32)]
    times = [truth.seconds(s) for s in shapes]
    start = roofline_cost(LLAMA_3_8B, hw, Efficiency())
    fitted, rms = fit_efficiency(start, shapes, times)
    assert (fitted.mfu, fitted.mbu) == pytest.approx((0.42, 0.63))
    assert fitted.step_overhead_s == pytest.approx(0.5e-3)
    assert rms == pytest.approx(0.0, abs=1e-9)
    capped, rms_capped = fit_efficiency(start, shapes, times, mbu_max=0.5)
    assert capped.mbu <= 0.5 and rms_capped > 0.01
    with pytest.raises(ConfigError):
        fit_efficiency(start, shapes, times[:-1])


def test_nnls_matches_unconstrained_when_positive_and_clips_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((50, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    assert nnls(a, a @ x_true) == pytest.approx(x_true, rel=1e-9)
    x = nnls(a, a @ np.array([1.0, -2.0, 0.5, 3.0]))
    assert (x >= 0).all()


def test_profiles_round_trip_and_reject_bad_files(tmp_path) -> None:
    prof = roofline_profile("llama-3-8b", "h100-sxm", Efficiency(mfu=0.6))
    path = prof.save(tmp_path / "gpu.json")
    again = load_profile(path)
    assert again.step_time == prof.step_time and again.scheduler == prof.scheduler
    # an edited efficiency factor changes the model
    text = path.read_text().replace('"mfu": 0.6', '"mfu": 0.3')
    path.write_text(text)
    assert load_profile(path).step_time.mfu == 0.3
    cal = calibrated_profile("c", StepTime.of(Layout(few_rows=8), few_row=1e-3),
                             {"max_num_batched_tokens": 64, "max_num_seqs": 4,
                              "num_blocks": 32, "block_size": 16, "max_model_len": 256,
                              "enable_prefix_caching": True}, {"x": 1}, "d", 0.002)
    back = load_profile(cal.save(tmp_path / "cal.json"))
    assert (back.step_time, back.arrival_s, back.meta) == (cal.step_time, 0.002, {"x": 1})
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    with pytest.raises(ConfigError, match="not a simulation profile"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_kv_blocks_fill_the_memory_beside_the_weights() -> None:
    prof = roofline_profile("llama-3-8b", "h100-sxm", Efficiency())
    kv_tokens = prof.scheduler["num_blocks"] * 16
    # 80 GB x (0.9 - 0.05) - 16 GB of bf16 weights = 52 GB at 128 KiB per token
    assert kv_tokens == pytest.approx((80e9 * 0.85 - 16.06e9) / 131072, rel=0.01)
    with pytest.raises(ConfigError, match="no room"):
        roofline_profile("llama-3-70b", "l40s", Efficiency())


@pytest.mark.parametrize("model", ["gemma-3-270m", "qwen3-30b-a3b"])
def test_the_roofline_step_time_prices_families_as_the_cost_model(model) -> None:
    """At MFU = MBU = 1 and no overheads, memory-bound decode steps take the cost model's
    bytes / bandwidth (Gemma 3's sliding layers read at most their window, a MoE step the
    experts its rows are expected to choose) and a compute-bound prefill its FLOPs / peak
    (sliding layers' pairs capped at the window)."""
    cfg = get_known_model(model)
    hw = GPU_PROFILES["h100-sxm"]
    cost = roofline_cost(cfg, hw, Efficiency(mfu=1.0, mbu=1.0, step_overhead_ms=0.0,
                                             request_overhead_ms=0.0))
    assert cost.layout.window == (512 if model.startswith("gemma") else 0)
    bw, peak = hw.mem_bandwidth, hw.peak("bf16")
    kw = {"weight_dtype": "bf16", "kv_dtype": "bf16"}
    for rows, context in ((1, 8191), (16, 3000), (4, 100)):
        ref = step_work(cfg, [(1, context)] * rows, **kw)
        embedding = dict(ref.byte_terms)["weights.embedding"]     # rows gathered: ignored
        shape = StepShape.of([(1, context, 1)] * rows, cost.layout)
        assert cost.seconds(shape) == pytest.approx((ref.bytes - embedding) / bw, rel=1e-12)
    ref = step_work(cfg, [(8192, 0)], num_logits=1, **kw)
    shape = StepShape.of([(8192, 0, 1)], cost.layout)
    assert cost.seconds(shape) == pytest.approx(ref.flops / peak + ref.kv_write_bytes / bw,
                                                rel=1e-12)


def test_a_gemma3_profile_simulates_its_sliding_kv_groups(tmp_path) -> None:
    """The profile's scheduler keeps one block table per KV group, in blocks of one group's
    layers, so a long context holds about the window in the sliding groups."""
    prof = roofline_profile("gemma-3-270m", "h100-sxm", Efficiency())
    assert prof.scheduler["kv_windows"] == [None] + [512] * 5
    per_block = GEMMA_3_270M.kv_block_bytes(16, 2)                # 3 layers of bf16
    free = 80e9 * 0.85 - param_count(GEMMA_3_270M).total * 2
    assert prof.scheduler["num_blocks"] == int(free // per_block)
    again = load_profile(prof.save(tmp_path / "gemma.json"))
    assert again.scheduler == prof.scheduler and again.step_time == prof.step_time
    config = again.scheduler_config(num_blocks=2000, max_num_batched_tokens=256)
    assert config.kv_windows == (None, 512, 512, 512, 512, 512)
    # one simulated instance, stepped by hand: two prompts of 6,000 tokens, 3 tokens each
    inst = SimInstance(0, config, again.step_time)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i in range(2):
        inst.submit(Request(f"r{i}", [1000 + (i * 31 + j) % 5000 for j in range(6000)],
                            params))
    inst.admit_pending()
    peak: dict[str, int] = {}
    seconds = 0.0
    while (duration := inst.begin_step()) is not None:
        seconds += duration
        used = inst.scheduler.kv_cache_manager.used_blocks_by_kind()
        peak = {k: max(n, peak.get(k, 0)) for k, n in used.items()}
        inst.end_step()
    assert not inst.scheduler.has_unfinished_requests() and seconds > 0
    # the full group holds a whole request (6,003 tokens: 376 blocks) at least; each of
    # the 5 sliding groups at most the window and a chunk of 256 a request: 50 blocks
    assert peak["full"] >= 376
    assert 5 * 512 // 16 <= peak["sliding"] <= 5 * 2 * 50
