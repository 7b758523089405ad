"""StepAccountant against figures computed by hand for a tiny config (pure arithmetic)."""
from __future__ import annotations



import pytest

from duetserve.config import ConfigError, ModelConfig
from duetserve.metrics.cost_model import step_work
from duetserve.metrics.hardware import HardwareProfile, local_profile
from duetserve.metrics.step_accounting import StepAccountant, classify_phase
from duetserve.outputs import ScheduledSlice, StepStats

# d = 8, I = 16, L = 2 layers, 4 q heads / 2 kv heads of head_dim 2, vocab 100, untied.
# params: layers 1184, embedding 800, lm_head 800, final norm 8 -> 2792 in all.
TINY = ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=2, weight_dtype="q4_1")   # the file's dtype must NOT be used
WEIGHT_BYTES = 2792 * 4                              # executed as float32 tensors
HW = HardwareProfile(name="test", description="round numbers",
                     peak_flops=(("fp32", 1e4), ("bf16", 4e4)), mem_bandwidth=1e5,
                     memory_bytes=1e9, default_compute="fp32")


def Stats(items: list[tuple[str, int, int]], num_prefill_tokens: int,
          num_decode_tokens: int, step_seconds: float = 0.5) -> StepStats:
    """A StepStats of (req_id, num_new, num_computed_before) slices; a 1-token slice after
    a context is a decode here (the scheduler decides it in the engine)."""
    return StepStats(start_time=100.0, step_seconds=step_seconds,
                     num_prefill_tokens=num_prefill_tokens,
                     num_decode_tokens=num_decode_tokens,
                     items=[ScheduledSlice(req_id=r, num_new_tokens=n, num_computed_before=c,
                                           is_decode=n == 1 and c > 0)
                            for r, n, c in items])


def accountant(kv_dtype: str = "float32") -> StepAccountant:
    return StepAccountant(TINY, WEIGHT_BYTES, kv_dtype, HW)


def test_decode_step_by_hand() -> None:
    acc = accountant().observe(Stats([("a", 1, 10)], 0, 1))
    # FLOPs: linear 2 * 576 weights * 1 token * 2 layers            = 2304
    #        attention: pairs 1*10 + 1 = 11; 2 * 4 heads * 2 dim * 2 layers = 32 per pair,
    #                   x2 (scores, values)                        = 704
    #        lm head 2 * 8 * 100                                   = 1600
    assert acc.flops == 2304 + 704 + 1600 == 4608
    # bytes (4 per param): layers 4736 + final norm 32 + lm head 3200 + 1 embedding row 32
    #        KV f32: 2 (K,V) * 2 layers * 2 kv heads * 2 dim * 4 B = 64 B/token;
    #        read 10 tokens = 640, write 1 token = 64
    assert acc.bytes == 4736 + 32 + 3200 + 32 + 640 + 64 == 8704
    assert acc.phase == "decode"
    assert acc.seconds == 0.5
    assert acc.flops_per_s == pytest.approx(9216.0)
    assert acc.bytes_per_s == pytest.approx(17408.0)
    assert acc.mfu == pytest.approx(9216.0 / 1e4)        # fp32 peak for float32
    assert acc.mbu == pytest.approx(17408.0 / 1e5)
    assert acc.ai == pytest.approx(4608 / 8704)


def test_mixed_step_matches_cost_model() -> None:
    stats = Stats([("a", 3, 5), ("b", 1, 10)], 3, 1, step_seconds=0.25)
    acc = accountant().observe(stats)
    cost = step_work(TINY, [(3, 5), (1, 10)], kv_dtype="f32", weight_bytes=WEIGHT_BYTES)
    assert acc.phase == "mixed"
    assert (acc.flops, acc.bytes, acc.num_logits) == (cost.flops, cost.bytes, 2)
    assert acc.mfu == pytest.approx(cost.flops / 0.25 / HW.peak("fp32"))
    assert acc.mbu == pytest.approx(cost.bytes / 0.25 / HW.mem_bandwidth)


def test_a_moe_step_with_sliding_layers_is_accounted_by_family() -> None:
    """TINY with top-2 of 4 experts of 6 in layer 1 and a sliding window of 4 in layer 0:
    a decode after 10 tokens reads its own 2 experts and 3 cached tokens of layer 0."""
    from dataclasses import replace
    cfg = replace(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
                  moe_layer_ids=(1,), layer_types=("sliding", "full"), sliding_window=4)
    params = 1184 - 384 + 8 * 4 + 4 * 144                      # layer 1: router + experts
    acc = StepAccountant(cfg, (params + 1608) * 4, "float32", HW).observe(
        Stats([("a", 1, 10)], 0, 1))
    # FLOPs: attention projections 2 * 192 * 2 layers, layer 0's MLP 2 * 384, the router
    #        2 * 32, 2 experts 2 * 288; (query, key) pairs 11 in the full layer and 4 in
    #        the sliding one, 2 * 4 heads * 2 dim * 2 (scores, values) = 32 FLOPs each;
    #        lm head 1600
    assert acc.flops == 2 * 192 * 2 + 2 * 384 + 2 * 32 + 2 * 288 + 32 * (11 + 4) + 1600
    # bytes: every weight but the experts, 2 of the 4 experts, head, a row; KV 32 B a
    # token and layer: 10 read in the full layer, 3 in the sliding one, 2 written
    assert acc.bytes == ((params - 576) + 288 + 8 + 800 + 8) * 4 + 32 * (10 + 3) + 32 * 2


def test_explicit_num_logits() -> None:
    stats = Stats([("a", 4, 0)], 4, 0)
    default = accountant().account(stats)
    none = accountant().account(stats, num_logits=0)
    assert default.flops - none.flops == 2 * 8 * 100          # one lm head row
    assert default.bytes - none.bytes == 800 * 4     # untied: only the head table read


@pytest.mark.parametrize("num_prefill,num_decode,phase", [
    (7, 0, "prefill"), (0, 3, "decode"), (5, 2, "mixed")])
def test_phase_classification(num_prefill: int, num_decode: int, phase: str) -> None:
    assert classify_phase(num_prefill, num_decode) == phase


def test_summary_mean_and_time_weighted() -> None:
    a = accountant()
    d1 = a.observe(Stats([("a", 1, 10)], 0, 1, step_seconds=0.5))
    d2 = a.observe(Stats([("a", 1, 10)], 0, 1, step_seconds=1.5))
    p = a.observe(Stats([("b", 6, 0)], 6, 0, step_seconds=1.0))
    s = a.summary()
    dec = s["decode"]
    assert (dec["steps"], dec["tokens"], dec["seconds"]) == (2, 2, 2.0)
    assert dec["mean_mfu"] == pytest.approx((d1.mfu + d2.mfu) / 2)
    # time-weighted: total FLOPs over total seconds (2 x 4608 / 2.0 s) / peak
    assert dec["time_weighted_mfu"] == pytest.approx(2 * 4608 / 2.0 / 1e4)
    assert dec["time_weighted_mbu"] == pytest.approx(2 * 8704 / 2.0 / 1e5)
    assert dec["time_weighted_mfu"] != pytest.approx(dec["mean_mfu"])
    assert s["prefill"]["steps"] == 1 and s["prefill"]["mean_mfu"] == pytest.approx(p.mfu)
    assert s["mixed"]["steps"] == 0 and s["mixed"]["mean_mfu"] == 0.0
    assert s["all"]["steps"] == 3 and s["all"]["tokens"] == 8
    assert a.last == p
    assert "decode" in a.format_summary()
    a.reset()
    assert a.summary()["all"]["steps"] == 0 and a.last is None


def test_account_for_reuses_last_without_double_counting() -> None:
    a = accountant()
    stats = Stats([("a", 1, 10)], 0, 1)
    first = a.observe(stats)
    assert a.account_for(stats) is first
    other = a.account_for(Stats([("a", 1, 11)], 0, 1))
    assert other is not first
    assert a.summary()["all"]["steps"] == 1


def test_zero_duration_and_empty_step() -> None:
    a = accountant()
    acc = a.account(Stats([("a", 1, 10)], 0, 1, step_seconds=0.0))
    assert acc.flops > 0 and acc.flops_per_s == 0.0 and acc.mfu == 0.0
    empty = a.account(Stats([], 0, 0))
    assert (empty.flops, empty.bytes, empty.mfu) == (0, 0.0, 0.0)


def test_dtypes_and_default_hardware() -> None:
    bf16 = StepAccountant(TINY, 2792 * 2, "bfloat16", HW)
    assert bf16.compute_dtype == "bf16" and bf16.peak_flops == 4e4
    acc = bf16.account(Stats([("a", 1, 10)], 0, 1))
    # bytes halve: weights 2 B/param, KV 2 B/element
    assert acc.bytes == pytest.approx(8704 / 2)
    local = StepAccountant(TINY, WEIGHT_BYTES, "float32")
    assert local.hardware == local_profile()
    assert local.peak_flops == local_profile().peak("fp32")
    with pytest.raises(ConfigError):
        StepAccountant(TINY, 0, "float32", HW)


def test_mfu_against_the_peak_of_each_steps_compute() -> None:
    """With compute_of (the engine's kernels by rows), a decode step's MFU is against one
    peak and a prefill's against another; time-weighted MFU adds each step's FLOPs at its
    own peak, and the summary names the peaks used."""
    a = StepAccountant(TINY, WEIGHT_BYTES, "float32", HW,
                       compute_of=lambda rows: "fp32" if rows <= 4 else "bf16")
    assert a.peaks() == {"fp32": 1e4}                   # nothing observed yet: the default
    decode = a.observe(Stats([("a", 1, 10)], 0, 1, step_seconds=0.5))
    prefill = a.observe(Stats([("b", 8, 0)], 8, 0, step_seconds=0.25))
    assert (decode.compute, prefill.compute) == ("fp32", "bf16")
    assert decode.mfu == pytest.approx(decode.flops / 0.5 / 1e4)
    assert prefill.mfu == pytest.approx(prefill.flops / 0.25 / 4e4)
    s = a.summary()
    assert s["peaks"] == {"bf16": 4e4, "fp32": 1e4}
    assert s["prefill"]["time_weighted_mfu"] == pytest.approx(prefill.mfu)
    assert s["all"]["time_weighted_mfu"] == pytest.approx(
        (decode.flops / 1e4 + prefill.flops / 4e4) / 0.75)
    assert "peak bf16 0, fp32 0 GFLOP/s" in a.format_summary()
    a.reset()
    assert a.peaks() == {"fp32": 1e4}
