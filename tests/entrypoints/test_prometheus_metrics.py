"""ServerMetrics without a server: names, per-app registries, counters from cumulative
engine totals, finished-request histograms and the throughput log line."""
from __future__ import annotations

import logging

from duetserve.config import UNBOUNDED_ROWS
from duetserve.metrics.prometheus import ServerMetrics, buckets_1_2_5
from duetserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats

NAMES = ["time_to_first_token_seconds", "time_per_output_token_seconds",
         "inter_token_latency_seconds", "e2e_request_latency_seconds",
         "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens",
         "prompt_tokens_total", "generation_tokens_total", "request_success_total",
         "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
         "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
         "step_prefill_tokens", "step_decode_tokens", "step_duration_seconds",
         "kv_cache_used_blocks"]


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_metrics_feed_and_render(caplog) -> None:
    a, b = ServerMetrics("m", 2048, 512, log_interval=0.0), ServerMetrics("m", 2048, 512)
    with caplog.at_level(logging.INFO, logger="duetserve.metrics"):
        a.observe_step(StepStats(start_time=0.0, step_seconds=0.01, num_prefill_tokens=100,
                                 num_decode_tokens=3, num_running=4, num_waiting=1,
                                 kv_usage=0.5, num_used_blocks=10, num_preemptions=1,
                                 prefix_cache_queries=64, prefix_cache_hits=32))
        a.observe_step(StepStats(start_time=0.0, step_seconds=0.01, num_prefill_tokens=0,
                                 num_decode_tokens=4, num_running=4, num_waiting=0,
                                 kv_usage=0.5, num_used_blocks=12, num_preemptions=2,
                                 prefix_cache_queries=64, prefix_cache_hits=48))
    assert any("prefill" in r.message and "decode" in r.message for r in caplog.records)
    m = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                       last_token_time=3.0, finished_time=3.0, num_generation_tokens=3,
                       inter_token_latencies=[0.5, 0.5])
    out = RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0, "abc", [4, 5, 6],
                                                              finish_reason="stop")],
                        True, m)
    a.observe_finished(out, "stop")
    a.observe_finished(None, "abort")
    text = a.render().decode()
    for name in NAMES:
        assert f"duet:{name}" in text, name
    assert "_created" not in text
    assert _sample(text, "duet:num_preemptions_total") == 2
    assert _sample(text, "duet:prefix_cache_hits_total") == 48
    assert _sample(text, "duet:kv_cache_used_blocks") == 12
    assert _sample(text, "duet:request_success_total") == 2
    assert _sample(text, "duet:generation_tokens_total") == 3
    assert _sample(text, "duet:inter_token_latency_seconds_count") == 2
    assert _sample(text, "duet:time_to_first_token_seconds_sum") == 1.0
    assert _sample(b.render().decode(), "duet:request_success_total") == 0  # own registry
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_goodput_counters_judge_ended_requests_by_the_slo() -> None:
    m = ServerMetrics("m", 2048, 512, slo_s=(1.0, 0.1))

    def ended(ttft: float, tpot: float | None, reason: str = "stop") -> None:
        n = 1 if tpot is None else 11
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=ttft,
                                 last_token_time=ttft + (tpot or 0) * (n - 1),
                                 finished_time=ttft + (tpot or 0) * (n - 1),
                                 num_generation_tokens=n)
        out = RequestOutput("r", None, [1], [CompletionOutput(0, "x", [4] * n,
                                                            finish_reason=reason)], True,
                            metrics)
        m.observe_finished(out, reason)
    ended(0.5, 0.05)                     # both met
    ended(0.5, 0.2)                      # TPOT missed
    ended(1.5, 0.05, "length")           # TTFT missed
    ended(0.2, None)                     # one token: no TPOT, which cannot be missed
    m.observe_finished(None, "error")    # missed everything
    m.observe_finished(None, "abort")    # the client's choice: not counted
    text = m.render().decode()

    def count(slo: str, outcome: str) -> float:
        return _sample(text, f'duet:goodput_requests_total{{model_name="m",outcome="{outcome}"'
                             f',slo="{slo}"}}')
    assert (count("ttft", "met"), count("ttft", "missed")) == (3, 2)
    assert (count("tpot", "met"), count("tpot", "missed")) == (3, 2)
    assert (count("both", "met"), count("both", "missed")) == (2, 3)
    assert 'duet:goodput_slo_seconds{model_name="m",slo="tpot"} 0.1' in text


def test_kernel_choice_visible() -> None:
    """The start-up kernel choice is an info series; each step counts under the kernel its
    row count selects."""
    m = ServerMetrics("m", 2048, 512)
    m.set_kernel_info("120 int4", "bfloat16", 4, "bf16 GEMM 2.00x fp32")
    m.observe_step(StepStats(start_time=0.0, step_seconds=0.01, num_prefill_tokens=0,
                             num_decode_tokens=3))
    m.observe_step(StepStats(start_time=0.0, step_seconds=0.01, num_prefill_tokens=60,
                             num_decode_tokens=4))
    m.observe_step(StepStats(start_time=0.0, step_seconds=0.01, num_prefill_tokens=0,
                             num_decode_tokens=4))
    text = m.render().decode()
    assert 'lowbit_max_rows="4"' in text and 'weights="120 int4"' in text
    assert _sample(text, 'duet:steps_by_kernel_total{kernel="lowbit",model_name="m"}') == 2
    assert _sample(text, 'duet:steps_by_kernel_total{kernel="dense",model_name="m"}') == 1
    every = ServerMetrics("m", 2048, 512)      # the low-bit kernels at every step size
    every.set_kernel_info("120 int4", "float32", UNBOUNDED_ROWS, "measured")
    every.observe_step(StepStats(start_time=0.0, step_seconds=0.5, num_prefill_tokens=2048,
                                 num_decode_tokens=0))
    text = every.render().decode()
    assert 'lowbit_max_rows="unbounded"' in text
    assert _sample(text, 'duet:steps_by_kernel_total{kernel="lowbit",model_name="m"}') == 1


def test_spec_decode_counters_follow_cumulative_totals() -> None:
    from duetserve.outputs import SpecDecodeStats
    m = ServerMetrics("m", 2048, 512)
    m.observe_step(StepStats(0.0, 0.01, 0, 4, 1, 0, 0.1, 1, 0, 0, 0,
                             spec=SpecDecodeStats(2, 6, 3, [2, 1, 0])))
    m.observe_step(StepStats(0.0, 0.01, 0, 4, 1, 0, 0.1, 1, 0, 0, 0,
                             spec=SpecDecodeStats(3, 9, 5, [3, 2, 0])))
    text = m.render().decode()
    drafts = _sample(text, "duet:spec_decode_num_drafts_total")
    drafted = _sample(text, "duet:spec_decode_num_draft_tokens_total")
    accepted = _sample(text, "duet:spec_decode_num_accepted_tokens_total")
    assert (drafts, drafted, accepted) == (3, 9, 5) and accepted <= drafted
    per_pos = _sample(text, "duet:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == accepted
    assert 'position="1"} 2.0' in text and 'position="2"} 0.0' in text


def test_prefix_cache_tiers_capacity_and_kv_store() -> None:
    import threading

    from duetserve.kv_transfer.disk_store import StoreStats
    from duetserve.metrics.kv_store import KVStoreMetrics
    m = ServerMetrics("m", 2048, 512)
    m.set_kv_cache_info("bfloat16", 65536, 100)
    for mem, disk in ((16, 0), (48, 32)):
        m.observe_step(StepStats(prefix_cache_queries=100, prefix_cache_hits=mem,
                                 prefix_cache_disk_hits=disk))
    snap = StoreStats(files=3, bytes=3000, writes=5, write_bytes=5000, hits=2,
                      hit_bytes=2000, corrupt=1, evictions=2, writes_dropped=4)
    store = KVStoreMetrics(m.registry, "m", lambda: snap, threading.Lock())
    store.observe_step()
    store.observe_step()            # the same totals again: counted once
    text = m.render().decode()
    assert _sample(text, 'duet:kv_cache_capacity_tokens{kv_cache_dtype="bfloat16",'
                   'model_name="m"}') == 65536
    assert _sample(text, "duet:prefix_cache_hits_total") == 48
    assert _sample(text, "duet:prefix_cache_disk_hits_total") == 32
    assert _sample(text, 'duet:prefix_cache_hit_bytes_total{model_name="m",tier="memory"}'
                   ) == 4800
    assert _sample(text, 'duet:prefix_cache_hit_bytes_total{model_name="m",tier="disk"}'
                   ) == 3200
    for name, value in (("blocks", 3), ("bytes", 3000), ("writes_total", 5),
                        ("write_bytes_total", 5000), ("read_blocks_total", 2),
                        ("read_bytes_total", 2000), ("corrupt_blocks_total", 1),
                        ("evictions_total", 2), ("writes_dropped_total", 4)):
        assert _sample(text, f"duet:kv_store_{name}") == value, name
