"""Cost models, the calibration fit and profiles (pure arithmetic, no engine)."""
from __future__ import annotations

import numpy as np
import pytest

from duetserve.config import ConfigError
from duetserve.metrics.cost_model import step_cost
from duetserve.metrics.hardware import GPU_PROFILES
from duetserve.metrics.known_models import LLAMA_3_8B
from duetserve.sim.cost import (FEATURES, IDLE_KNEE_S, CalibratedCost, cold_state,
                                rewarm_counts, run_shapes, shape_for, shape_of, with_idle)
from duetserve.sim.fit import fit_cost, nnls
from duetserve.sim.gpu import Efficiency, fit_efficiency, roofline_cost, unit_costs
from duetserve.sim.profile import load_profile, roofline_profile


def test_shape_sums() -> None:
    s = shape_of([(1, 100, True), (1, 50, True), (32, 64, False), (8, 0, True)])
    assert (s.num_reqs, s.num_tokens, s.num_logits, s.num_decodes) == (4, 42, 3, 2)
    assert s.decode_context == 150
    assert s.prefill_context == 64
    assert s.prefill_pairs == 32 * 64 + 32 * 33 // 2 + 8 * 9 // 2
    # the calibrated model's split: flash pairs of the fresh prompt, the masked score
    # matrix (chunk x whole context) of the chunk after 64 cached tokens
    assert (s.num_prefills, s.fresh_pairs, s.chunk_scores) == (2, 8 * 9 // 2, 32 * 96)
    assert s.chunk_pairs == 0


def test_decode_context_is_priced_on_the_busiest_thread_of_the_split() -> None:
    """The engine's paged decode attention gives each thread a contiguous run of its
    (row, KV head) items (csrc/paged_attention.cpp, at::parallel_for), rows ordered as
    worker/batch.py lays them out: decodes by context, then chunk rows. With the split
    known, decode_context counts as threads x the busiest thread's KV entries / KV heads
    (less the rows' own token, as decode_context counts c): the sum when items divide
    evenly, more when one long row sits on one thread. The split travels with the cost."""
    even = shape_of([(1, 99, True), (1, 99, True)], decode_split=(2, 3))
    assert even.decode_busiest() == even.decode_context == 198
    one = shape_of([(1, 699, True)], decode_split=(2, 3))      # 3 items: 2 on one thread
    assert one.decode_busiest() == pytest.approx(2 * 700 * 2 / 3 - 1)
    # a decode at 709 and a 4-token chunk after 37 cached (rows 38..41 long): 15 items,
    # runs of 8; the first thread holds the long row's 3 and 5 short ones
    items = [(1, 709, True), (4, 37, False)]
    mixed = shape_of(items, chunk_rows=8, decode_split=(2, 3))
    busiest = 3 * 710 + 3 * 38 + 2 * 39
    assert mixed.decode_busiest() == pytest.approx(busiest * 2 / 3 - 5)
    assert mixed.decode_context == 709 + 4 * 37 + 6                 # unchanged
    # decodes are sorted by context before the split, chunk rows stay after them
    assert shape_of([(1, 699, True), (1, 9, True)], decode_split=(2, 1)).decode_busiest() \
        == shape_of([(1, 9, True), (1, 699, True)], decode_split=(2, 1)).decode_busiest() \
        == pytest.approx(700 * 2 - 2)
    # split unknown or one thread: the plain sum
    assert shape_of(items, chunk_rows=8).decode_busiest() == mixed.decode_context
    assert shape_of(items, chunk_rows=8, decode_split=(1, 3)).decode_busiest() \
        == mixed.decode_context
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("decode_context")] = 1e-6
    cost = CalibratedCost(tuple(coef), 16, chunk_rows=8, decode_split=(2, 3))
    assert cost.step_seconds(shape_for(cost, items)) == pytest.approx(
        mixed.decode_busiest() * 1e-6)
    assert CalibratedCost.from_json(cost.to_json()) == cost
    assert cost.scaled(2.0).decode_split == (2, 3)
    old = cost.to_json()
    del old["decode_split"]                                 # profiles from before it
    assert CalibratedCost.from_json(old).decode_split == (0, 0)


def test_long_chunks_after_context_count_as_flash_pairs() -> None:
    """Above `flash_above` score entries n*(c+n) a chunk after context runs two flash calls
    (models/attention.py _after_prefix): pairs n*c + n(n+1)/2, no score matrix."""
    items = [(32, 64, False), (256, 512, True), (1, 10, True)]
    s = shape_of(items, flash_above=32 * 96)            # the first is at the limit: grouped
    assert (s.chunk_scores, s.chunk_pairs) == (32 * 96, 256 * 512 + 256 * 257 // 2)
    assert s.prefill_pairs == 32 * 64 + 32 * 33 // 2 + s.chunk_pairs
    assert shape_of(items).chunk_scores == 32 * 96 + 256 * 768      # no split given
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("chunk_pairs")] = 1e-6
    cost = CalibratedCost(tuple(coef), 16, flash_above=32 * 96)
    assert cost.step_seconds(shape_for(cost, items)) == pytest.approx(s.chunk_pairs * 1e-6)
    assert CalibratedCost.from_json(cost.to_json()) == cost


def test_short_chunks_count_as_decode_rows_where_the_engine_runs_them_so() -> None:
    """With `chunk_rows`, a chunk of up to that many tokens is counted as the engine lays
    it out (worker/batch.py): one decode row per token, row j after c + j tokens, no
    prefill slice (so a step of them and decodes is a decode-stack step); a longer chunk
    stays a prefill. The setting travels with the cost."""
    items = [(1, 100, True), (4, 10, True), (8, 0, False)]
    s = shape_of(items, chunk_rows=4)
    assert (s.num_tokens, s.num_decodes, s.num_prefills, s.num_logits) == (13, 5, 1, 2)
    assert s.decode_context == 100 + 4 * 10 + 4 * 3 // 2
    assert (s.prefill_context, s.fresh_pairs, s.chunk_scores) == (0, 8 * 9 // 2, 0)
    assert shape_of(items).num_decodes == 1                   # no layout given
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("mixed_few")] = 1.0
    cost = CalibratedCost(tuple(coef), 32, chunk_rows=8)
    assert cost.step_seconds(shape_for(cost, items)) == 0.0   # all decode rows
    assert cost.step_seconds(shape_for(cost, items + [(9, 0, True)])) == 1.0
    assert CalibratedCost.from_json(cost.to_json()) == cost
    assert cost.scaled(2.0).chunk_rows == 8


def test_calibrated_features_tell_the_engine_paths_apart() -> None:
    """Few-row steps with prefill work run the modules (mixed_few); decode-only ones the
    native decode stack; above the breakpoint both are dense GEMM steps."""
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("mixed_few")] = 1.0
    coef[FEATURES.index("chunk_scores")] = 1e-6
    cost = CalibratedCost(tuple(coef), 16)
    assert cost.step_seconds(shape_of([(1, 10, True)] * 4)) == 0.0
    assert cost.step_seconds(shape_of([(1, 10, True)] * 4 + [(4, 0, False)])) == 1.0
    assert cost.step_seconds(shape_of([(1, 10, True)] * 4 + [(20, 0, False)])) == 0.0
    assert cost.step_seconds(shape_of([(20, 30, True)])) == pytest.approx(20 * 50 * 1e-6)


def test_unit_costs_reproduce_the_cost_model() -> None:
    """FLOPs and bytes rebuilt from the per-unit figures equal metrics.cost_model's."""
    u = unit_costs(LLAMA_3_8B)
    step = [(7, 100), (1, 300), (1, 0)]
    ref = step_cost(LLAMA_3_8B, step, weight_dtype="bf16", kv_dtype="bf16")
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
    cost = roofline_cost(LLAMA_3_8B, hw, eff)
    u = unit_costs(LLAMA_3_8B)
    byte_s, flop_s = hw.mem_bandwidth * 0.8, hw.peak("bf16") * 0.5
    decode = shape_of([(1, 1000, True)])
    expect = ((u["weight_bytes"] + u["head_bytes"]) / byte_s          # linear: weights
              + u["kv_bytes_per_token"] * 1000 / byte_s               # decode attention: KV
              + u["kv_bytes_per_token"] / byte_s)                     # KV write
    assert cost.step_seconds(decode) == pytest.approx(expect)
    prefill = shape_of([(4096, 0, True)])
    lin = (u["flops_per_token"] * 4096 + u["flops_per_logit"]) / flop_s
    attn = u["flops_per_pair"] * (4096 * 4097 // 2) / flop_s
    assert cost.step_seconds(prefill) == pytest.approx(
        lin + attn + u["kv_bytes_per_token"] * 4096 / byte_s)


def test_nnls_matches_unconstrained_when_positive_and_clips_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((50, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    assert nnls(a, a @ x_true) == pytest.approx(x_true, rel=1e-9)
    x = nnls(a, a @ np.array([1.0, -2.0, 0.5, 3.0]))
    assert (x >= 0).all()


def test_fit_recovers_a_known_cost_and_breakpoint() -> None:
    coef = [0.0] * len(FEATURES)
    for name, value in (("step", 0.009), ("requests", 0.0004), ("rows_few", 0.0015),
                        ("many_rows", 0.006), ("rows_many", 0.0011), ("logits", 0.0002),
                        ("decode_context", 2e-6), ("fresh_pairs", 3e-8),
                        ("chunk_scores", 8e-8), ("chunk_pairs", 4e-8), ("mixed_few", 0.004),
                        ("cold_rows", 5e-5), ("rewarm", 0.003), ("multi_rows", 0.002),
                        ("cold_idle", 0.02), ("cold_idle_rows", 6e-5)):
        coef[FEATURES.index(name)] = value
    truth = CalibratedCost(tuple(coef), 4, flash_above=20_000)
    rng = np.random.default_rng(1)
    steps, cold = [], []
    for _ in range(300):
        b = int(rng.choice([1, 1, 1, 2, 2, 3, 4, 5, 6, 8, 16, 32, 47]))
        slices = [(1, int(rng.integers(10, 2000)), True) for _ in range(b)]
        if rng.random() < 0.4:       # a fresh prompt or a chunk after context, some tiny
            n = int(rng.integers(2, 4 if b <= 2 and rng.random() < 0.5 else 512))
            c = 0 if rng.random() < 0.5 else int(rng.integers(1, 1024))
            slices.append((n, c, bool(rng.random() < 0.5)))   # mid-prompt chunks sample nothing
        steps.append(slices)
        # a cold step after 0.001-20 s idle, some with the idle time not recorded
        cold.append(False if rng.random() >= 0.15 else
                    True if rng.random() < 0.2 else float(np.exp(rng.uniform(-7, 3))))
    # the steps ran in this order: each one's place after the last reset is priced
    samples = [(sl, truth.step_seconds(s)) for sl, s in zip(steps, run_shapes(truth, steps, cold))]
    samples.append(([(1, 10, True)], 5.0))       # a stall: dropped as an outlier
    cold.append(False)
    with pytest.raises(ValueError, match="cold flags"):
        fit_cost(samples, cold=cold[:-1])
    cost, report = fit_cost(samples, arrival_s=0.0003, cold=cold, flash_above=20_000)
    assert cost.breakpoint == 4 and cost.flash_above == 20_000
    assert cost.coef == pytest.approx(truth.coef, rel=1e-6, abs=1e-12)
    assert report["num_outliers"] == 1
    assert report["rms_rel_error"] < 1e-6
    assert cost.arrival_s == 0.0003
    # the engine's own kernel switch, when given, is the breakpoint (not fitted): at the
    # true one the fit is exact again; at another it is what the engine says, and worse
    given, report = fit_cost(samples, arrival_s=0.0003, cold=cold, flash_above=20_000,
                             breakpoint=4)
    assert given.breakpoint == 4 and list(report["rms_by_breakpoint"]) == ["4"]
    assert given.coef == pytest.approx(truth.coef, rel=1e-6, abs=1e-12)
    other, report = fit_cost(samples, arrival_s=0.0003, cold=cold, flash_above=20_000,
                             breakpoint=16)
    assert other.breakpoint == 16 and report["rms_rel_error"] > 1e-3


def test_steps_after_a_reset_pay_a_decaying_rewarm_cost() -> None:
    """rewarm: 0 on a cold step, a many-row step (above the breakpoint) and before the
    first of them; then 1, 2, ... The k-th step after a reset pays the coefficient times
    exp(-(k-1)/REWARM_STEPS), up to REWARM_LIMIT steps; a profile fitted before the term
    existed loads with it at 0."""
    from duetserve.sim.cost import REWARM_LIMIT, REWARM_STEPS
    assert rewarm_counts([False, True, False, False, False, False, True, False],
                         [1, 1, 2, 9, 1, 4, 1, 1], 4) == [0, 0, 1, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="cold flags"):
        rewarm_counts([True], [1, 1], 4)
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("rewarm")] = 2.0
    cost = CalibratedCost(tuple(coef), 16)
    priced = [cost.step_seconds(shape_of([(1, 64, True)], rewarm=k))
              for k in (0, 1, 2, 1 + int(REWARM_STEPS), REWARM_LIMIT, REWARM_LIMIT + 1)]
    assert priced == pytest.approx([0.0, 2.0, 2.0 * np.exp(-1 / REWARM_STEPS), 2.0 * np.exp(-1),
                                    2.0 * np.exp(-(REWARM_LIMIT - 1) / REWARM_STEPS), 0.0])
    # one run's shapes: the counts under the cost's breakpoint
    shapes = run_shapes(cost, [[(1, 5, True)], [(1, 6, True)], [(20, 0, True)], [(1, 7, True)]],
                        [True, False, False, False])
    assert [s.rewarm for s in shapes] == [0, 1, 0, 1]
    # a profile from before the term: its coefficients, the new one (and later ones) 0
    k = FEATURES.index("rewarm")
    old = cost.to_json()
    old["features"], old["coef_s"] = old["features"][:k], old["coef_s"][:k]
    again = CalibratedCost.from_json(old)
    assert again.coef[:k] == cost.coef[:k] and again.coef[k:] == (0.0,) * (len(FEATURES) - k)


def test_the_few_row_path_steps_up_from_one_row_to_two() -> None:
    """multi_rows: 1 on a step of 2 to `breakpoint` rows, 0 on one row and on the
    many-row path; a profile fitted before the term loads with it at 0."""
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("multi_rows")] = 0.002
    cost = CalibratedCost(tuple(coef), 8)
    priced = [cost.step_seconds(shape_of(sl)) for sl in
              ([(1, 50, True)], [(1, 50, True), (1, 9, True)], [(1, 50, True)] * 8,
               [(1, 50, True)] * 9, [(5, 0, True)])]
    assert priced == pytest.approx([0.0, 0.002, 0.002, 0.0, 0.002])
    old = cost.to_json()
    k = FEATURES.index("multi_rows")
    old["features"], old["coef_s"] = old["features"][:k], old["coef_s"][:k]
    assert CalibratedCost.from_json(old).coef == (0.0,) * len(FEATURES)
    old["features"] = old["features"][::-1]
    with pytest.raises(ValueError, match="re-run"):
        CalibratedCost.from_json(old)


def test_profiles_round_trip_and_reject_bad_files(tmp_path) -> None:
    prof = roofline_profile("llama-3-8b", "h100-sxm", Efficiency(mfu=0.6))
    path = prof.save(tmp_path / "gpu.json")
    again = load_profile(path)
    assert again.cost == prof.cost and again.scheduler == prof.scheduler
    # an edited efficiency factor changes the model
    text = path.read_text().replace('"mfu": 0.6', '"mfu": 0.3')
    path.write_text(text)
    assert load_profile(path).cost.mfu == 0.3
    cal = CalibratedCost(tuple(range(len(FEATURES))), 8, 0.001)
    assert CalibratedCost.from_json(cal.to_json()) == cal
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


def test_few_row_slope_changes_above_the_knot() -> None:
    """rows_few_over: up to KNOT_ROWS rows each costs rows_few; each row above it also
    rows_few_over, up to the breakpoint (above it the dense-GEMM terms take over)."""
    from duetserve.sim.cost import KNOT_ROWS
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("rows_few")] = 1.0
    coef[FEATURES.index("rows_few_over")] = 0.5
    cost = CalibratedCost(tuple(coef), 16)
    t = [cost.step_seconds(shape_of([(1, 64, True)] * b)) for b in range(1, 18)]
    assert t[:KNOT_ROWS] == [1.0, 2.0, 3.0][:KNOT_ROWS]
    assert t[KNOT_ROWS] == pytest.approx(KNOT_ROWS + 1 + 0.5)
    assert t[15] == pytest.approx(16 + 0.5 * (16 - KNOT_ROWS))
    assert t[16] == 0.0                   # 17 rows: above the breakpoint
    # a fit recovers the two slopes from noiseless steps
    truth = CalibratedCost(tuple(1e-3 if f in ("step", "rows_few") else
                                 6e-4 if f == "rows_few_over" else 0.0 for f in FEATURES), 16)
    samples = [([(1, 64, True)] * b, truth.step_seconds(shape_of([(1, 64, True)] * b)))
               for b in list(range(1, 17)) * 3]
    fitted, report = fit_cost(samples)
    assert report["rms_rel_error"] < 1e-6
    for b in (1, 3, 4, 8, 16):
        s = shape_of([(1, 64, True)] * b)
        assert fitted.step_seconds(s) == pytest.approx(truth.step_seconds(s), rel=1e-6)


def test_fit_efficiency_recovers_the_factors_that_made_the_times() -> None:
    """Steps timed by a roofline with MFU 0.42, MBU 0.63 and 0.5 ms a step (what
    benchmarks/gpu_step_probe.py measures on a GPU) give those factors back, and the caps
    hold when the truth lies above them."""
    hw = GPU_PROFILES["h200"]
    truth = roofline_cost(LLAMA_3_8B, hw, Efficiency(mfu=0.42, mbu=0.63, step_overhead_ms=0.5))
    shapes = [shape_of(items) for items in (
        [(2048, 0, True)], [(512, 4096, True)], [(1, 256, True)], [(1, 4096, True)] * 16,
        [(1, 1024, True)] * 128, [(512, 0, True)] + [(1, 1024, True)] * 32)]
    times = [truth.step_seconds(s) for s in shapes]
    start = roofline_cost(LLAMA_3_8B, hw, Efficiency())
    fitted, rms = fit_efficiency(start, shapes, times)
    assert (fitted.mfu, fitted.mbu) == pytest.approx((0.42, 0.63))
    assert fitted.step_overhead_s == pytest.approx(0.5e-3)
    assert rms == pytest.approx(0.0, abs=1e-9)
    capped, rms_capped = fit_efficiency(start, shapes, times, mbu_max=0.5)
    assert capped.mbu <= 0.5 and rms_capped > 0.01
    with pytest.raises(ConfigError):
        fit_efficiency(start, shapes, times[:-1])


def test_a_cold_step_costs_more_the_longer_the_engine_idled() -> None:
    """cold_idle: ln(1 + idle / IDLE_KNEE_S) on a cold step (cold_idle_rows: that times its
    rows), 0 on a warm one and on a cold one whose idle time was not recorded (True);
    with_idle fills those in from the steps' starts and durations, the first left True."""
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("cold_idle")] = 0.02
    coef[FEATURES.index("cold_idle_rows")] = 1e-4
    cost = CalibratedCost(tuple(coef), 8)
    prompt = [(40, 0, True)]
    priced = [cost.step_seconds(shape_of(prompt, c)) for c in (0.0, False, True, 0.3, 5.0)]
    assert priced == pytest.approx([0.0, 0.0, 0.0, (0.02 + 40e-4) * np.log(2.0),
                                    (0.02 + 40e-4) * np.log1p(5.0 / IDLE_KNEE_S)])
    assert cold_state(True) == (True, 0.0) and cold_state(0.0) == (False, 0.0)
    assert cold_state(2.5) == (True, 2.5)
    filled = with_idle([True, False, True, 0.7], [0.0, 1.0, 4.0, 9.0], [0.5, 0.5, 1.0, 1.0])
    assert filled == [True, False, pytest.approx(2.5), 0.7]
    with pytest.raises(ValueError, match="starts"):
        with_idle([True], [0.0, 1.0], [0.5])
