"""The simulator: the real Scheduler timed by the step-time model (no torch, no timing
asserts).

A constant model (every step takes STEP seconds) makes every latency exact
arithmetic, so the tests check the event loop, the update mimicry and the latency
conventions to the microsecond.
"""
from __future__ import annotations

import math

import pytest

from duetserve.bench.bench_metrics import summarize
from duetserve.bench.token_workload import TokenTurn
from duetserve.config import SchedulerConfig
from duetserve.core import scheduler as core_scheduler
from duetserve.core.step_time import Layout, StepShape, StepTime
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.instance import SimInstance
from duetserve.sim.simulator import Simulation

STEP = 0.010


def constant_cost(step: float = STEP, per_token: float = 0.0, **terms: float) -> StepTime:
    """t = step + per_token * T (every step on the many-row path: few_rows 0)."""
    return StepTime.of(Layout(), many_step=step, many_row=per_token, **terms)


def config(**kw) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, block_size=4,
                num_blocks=256)
    base.update(kw)
    return SchedulerConfig(**base)


def one_turn(prompt_len: int, output_len: int, first_id: int = 1000) -> list[TokenTurn]:
    return [TokenTurn(tuple(range(first_id, first_id + prompt_len)), output_len)]


def run(convs, offsets, cluster=ClusterSpec(1), cost=None, **kw):
    cfg = kw.pop("cfg", config())
    sim = Simulation(convs, offsets, cluster, cfg, cost or constant_cost(), **kw)
    return sim, sim.run()


def test_the_real_scheduler_class_decides() -> None:
    inst = SimInstance(0, config(), constant_cost())
    assert type(inst.scheduler) is core_scheduler.Scheduler
    sim, _ = run([one_turn(5, 2)], [0.0])
    assert all(type(i.scheduler) is core_scheduler.Scheduler for i in sim.prefill)


def test_latencies_of_one_request_are_step_arithmetic() -> None:
    # prompt 10 (one step: first token at 10 ms), then 4 decode steps of 10 ms each.
    _, res = run([one_turn(10, 5)], [0.25])
    (rec,) = res.records
    assert rec.success and rec.output_tokens == 5 and rec.prompt_tokens == 10
    assert rec.send_time == pytest.approx(0.25)
    assert rec.ttft == pytest.approx(STEP)
    assert rec.e2e == pytest.approx(5 * STEP)
    assert rec.tpot == pytest.approx(STEP)
    assert rec.itl == pytest.approx([STEP] * 4)
    assert res.duration_s == pytest.approx(0.25 + 5 * STEP)


def test_chunked_prefill_takes_budget_sized_steps() -> None:
    # 100-token prompt, budget 32 -> chunks 32, 32, 32, 4: the first token after 4 steps.
    _, res = run([one_turn(100, 3)], [0.0], cfg=config(max_num_batched_tokens=32))
    (rec,) = res.records
    assert rec.ttft == pytest.approx(4 * STEP)
    assert rec.e2e == pytest.approx(6 * STEP)


def test_arrival_during_a_step_waits_for_the_step_boundary() -> None:
    # B arrives at 3 ms while A's first step (0..10 ms) runs; it is scheduled at 10 ms with
    # A's decode, so its first token comes at 20 ms (TTFT 17 ms).
    _, res = run([one_turn(8, 3), one_turn(8, 2, first_id=2000)], [0.0, 0.003])
    a, b = res.records
    assert a.ttft == pytest.approx(STEP)
    assert b.ttft == pytest.approx(2 * STEP - 0.003)
    assert b.e2e == pytest.approx(3 * STEP - 0.003)


def test_a_cold_step_pays_the_cold_terms() -> None:
    # cold_step 20 ms: A finds the instance idle (it starts so), B arrives after A ended:
    # each first step costs STEP + 20 ms, A's decodes STEP
    _, res = run([one_turn(8, 3), one_turn(8, 2, first_id=2000)], [0.25, 2.0],
                 cost=constant_cost(cold_step=0.020))
    a, b = res.records
    assert a.ttft == pytest.approx(STEP + 0.020)
    assert a.e2e == pytest.approx(STEP + 0.020 + 2 * STEP)
    assert b.ttft == pytest.approx(STEP + 0.020)
    assert b.e2e == pytest.approx(b.ttft + STEP)


def test_cost_depends_on_the_step_shape() -> None:
    # t = 1 ms + 0.5 ms/token: a 40-token prefill step costs 21 ms, a decode 1.5 ms.
    _, res = run([one_turn(40, 3)], [0.0], cost=constant_cost(0.001, 0.0005))
    (rec,) = res.records
    assert rec.ttft == pytest.approx(0.021)
    assert rec.tpot == pytest.approx(0.0015)


def test_preemption_under_a_small_kv_cache_still_finishes_every_request() -> None:
    convs = [one_turn(12, 20, first_id=1000 + 100 * i) for i in range(6)]
    sim, res = run(convs, [0.0] * 6, cfg=config(num_blocks=20, block_size=4))
    assert all(r.success and r.output_tokens == 20 for r in res.records)
    assert sum(i["num_preemptions"] for i in res.instances) > 0
    for inst in sim.prefill:
        inst.scheduler.check_integrity()
        assert not inst.scheduler.has_unfinished_requests()


def test_chat_turns_resend_the_history_and_hit_the_prefix_cache() -> None:
    conv = [TokenTurn(tuple(range(1000, 1032)), 8), TokenTurn(tuple(range(3000, 3016)), 4)]
    _, res = run([conv], [0.0])
    t0, t1 = res.records
    assert t1.prompt_tokens == 32 + 8 + 16
    assert t1.send_time == pytest.approx(t0.send_time + t0.e2e)   # sent when turn 0 ends
    assert res.instances[0]["prefix_cache_hit_rate"] > 0


def test_a_next_turn_sent_at_a_step_end_joins_the_very_next_step() -> None:
    # A decodes 20 tokens; B's first turn (8 in, 2 out) ends at 20 ms (steps 0-10, 10-20).
    # Its next turn is sent at 20 ms and joins the step beginning then (prompt 8 + 2 + 4
    # tokens, 8 of them cached: the step at 20-30 ms has A's decode and B's chunk), as the
    # engine's loop adds it before stepping again: first token at 30 ms, TTFT one step.
    # (It used to wait a step, beside A's decode only: TTFT two steps.)
    conv_b = [TokenTurn(tuple(range(2000, 2008)), 2), TokenTurn(tuple(range(3000, 3004)), 2)]
    _, res = run([one_turn(8, 20), conv_b], [0.0, 0.0])
    b0, b1 = res.records[1:]
    assert b0.e2e == pytest.approx(2 * STEP)
    assert b1.send_time == pytest.approx(2 * STEP)
    assert b1.ttft == pytest.approx(STEP)


def test_a_prompt_over_the_context_fails_alone() -> None:
    convs = [one_turn(600, 4), one_turn(10, 2, first_id=5000)]
    _, res = run(convs, [0.0, 0.0])
    bad, good = res.records
    assert not bad.success and "max_model_len" in bad.error
    assert good.success


def test_max_concurrency_queues_sends() -> None:
    convs = [one_turn(8, 2, first_id=1000 + 50 * i) for i in range(3)]
    _, res = run(convs, [0.0, 0.0, 0.0], max_concurrency=1)
    starts = sorted(r.send_time for r in res.records)
    assert starts == pytest.approx([0.0, 2 * STEP, 4 * STEP])


def test_round_robin_and_least_loaded_routers() -> None:
    convs = [one_turn(8, 4, first_id=1000 + 50 * i) for i in range(4)]
    _, res = run(convs, [0.0, 0.001, 0.002, 0.003], ClusterSpec(2, router="round_robin"))
    assert [i["tokens"] for i in res.instances] == [2 * (8 + 3)] * 2
    # least loaded: the first two requests go to different instances.
    _, res = run(convs[:2], [0.0, 0.001], ClusterSpec(2, router="least_loaded"))
    assert all(i["num_steps"] > 0 for i in res.instances)


def test_disaggregated_ttft_from_prefill_and_decode_after_the_transfer() -> None:
    # 1P1D, 100 bytes of KV per token over a 1 MB/s link: a 20-token prompt moves 2,000 B
    # in 2 ms (+ the link's latency). Prefill step 0..10 ms gives the first token; the
    # decode instance gets the request at 12 ms + latency and produces token 2 one step on.
    cluster = ClusterSpec(num_prefill=1, num_decode=1, link="nvlink", link_bandwidth=1e6,
                          kv_bytes_per_token=100.0)
    _, res = run([one_turn(20, 3)], [0.0], cluster)
    (rec,) = res.records
    arrive = STEP + 0.002 + cluster.latency
    assert rec.ttft == pytest.approx(STEP)
    assert rec.e2e == pytest.approx(arrive + 2 * STEP)
    assert rec.output_tokens == 3
    assert res.kv_transfer["bytes"] == pytest.approx(2000.0)
    prefill, decode = res.instances
    assert prefill["tokens"] == 20          # the prompt is computed once, on the prefill side
    assert decode["tokens"] == 2            # the decode side computes only its two tokens


def test_summary_is_bench_serves_and_plots(tmp_path) -> None:
    from duetserve.bench.plot import load_results, plot
    from duetserve.sim.run import run_json
    convs = [one_turn(16, 4, first_id=1000 + 50 * i) for i in range(5)]
    _, res = run(convs, [0.01 * i for i in range(5)])
    entry = run_json(res, 100.0, 1.0, None, [50, 90], {"ttft": 50.0})
    assert set(entry["summary"]) == set(summarize([], 1.0, [50, 90], {"ttft": 1.0}))
    assert entry["summary"]["completed"] == 5
    assert entry["summary"]["total_output_tokens"] == 20
    doc = {"schema": "duet-bench-serve/1", "label": "sim", "config": {}, "runs": [entry]}
    path = tmp_path / "sim.json"
    import json
    path.write_text(json.dumps(doc))
    assert plot(load_results([str(path)]), str(tmp_path / "p.png")).exists()


def test_rate_inf_sends_everything_at_once() -> None:
    from duetserve.bench.token_workload import arrival_offsets
    assert arrival_offsets(3, math.inf).tolist() == [0.0, 0.0, 0.0]
    convs = [one_turn(8, 2, first_id=1000 + 50 * i) for i in range(3)]
    _, res = run(convs, arrival_offsets(3, math.inf).tolist())
    # all three are added before the first step: they share every step
    assert [r.ttft for r in res.records] == pytest.approx([STEP] * 3)


def test_a_step_budget_gives_idle_steps_the_idle_budget_and_chunks_beside_decodes() -> None:
    # The engine's per-step budget (core/step_budget.StepBudget) through the real
    # scheduler: a 24 ms target -> (24 - 8) / 0.5 = 32 tokens while anything decodes,
    # the idle chunk when nothing does (512: a fixed cost a step, the biggest chunk the
    # start-up probes measure).
    from duetserve.core.step_budget import IDLE_PROBE, StepBudget
    policy = StepBudget(constant_cost(0.008, 0.0005), max_step_ms=24.0, min_chunk=4)
    assert (policy.for_step(0), policy.for_step(1)) == (IDLE_PROBE, 32)
    cfg = config(max_num_batched_tokens=policy.idle, step_budget=policy)
    # A (100 tokens) arrives idle: one step, not the 4 a fixed 32 would take. B (100)
    # arrives during it and then shares steps with A's decode: 31 + 31 + 31 + 7 -> its
    # first token at the end of step 5.
    _, res = run([one_turn(100, 10), one_turn(100, 2, first_id=2000)], [0.0, 0.003], cfg=cfg)
    a, b = res.records
    assert a.ttft == pytest.approx(STEP)
    assert b.ttft == pytest.approx(5 * STEP - 0.003)
    # the same workload under the fixed budget of the idle size: B in one step
    _, res = run([one_turn(100, 10), one_turn(100, 2, first_id=2000)], [0.0, 0.003],
                 cfg=config(max_num_batched_tokens=policy.idle))
    assert res.records[1].ttft == pytest.approx(2 * STEP - 0.003)


def test_a_step_after_the_engine_went_idle_is_cold() -> None:
    """The engine releases freed heap memory when it has no requests left (and after its
    start-up measurement), so the simulated instance marks the next step cold, as
    bench/replay.py and the calibration grid mark the engine's."""
    from duetserve.request import Request
    from duetserve.sampling_params import SamplingParams

    seen: list[bool] = []

    class Recorder:
        layout = Layout()

        def seconds(self, shape: StepShape) -> float:
            seen.append(shape.cold)
            return 0.01

    inst = SimInstance(0, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                          num_blocks=64, block_size=16, max_model_len=256),
                       Recorder())

    def run_one(req_id: str) -> None:
        inst.submit(Request(req_id, [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True),
                            arrival_time=0.0))
        assert inst.admit_pending() == []
        while inst.begin_step() is not None:
            inst.end_step()

    run_one("a")
    run_one("b")
    # a: prefill (cold: fresh engine), two decodes; b after idle: cold again, then warm
    assert seen == [True, False, False, True, False, False]


def test_the_instance_lays_out_steps_as_its_step_time_was_measured() -> None:
    """The simulated step's shape follows the model's layout: a 40-token prompt is a
    prefill slice (more than chunk_rows), the next step one decode row reading 41 KV
    entries; both sampled."""
    from duetserve.request import Request
    from duetserve.sampling_params import SamplingParams

    seen: list[tuple] = []

    class Recorder:
        layout = Layout(few_rows=16, chunk_rows=8)

        def seconds(self, shape: StepShape) -> float:
            seen.append((shape.num_prefills, shape.fresh_pairs, shape.num_decode_rows,
                         shape.decode_kv, shape.num_logits, shape.path))
            return 0.01

    inst = SimInstance(0, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                          num_blocks=64, block_size=16, max_model_len=256),
                       Recorder())
    inst.submit(Request("a", list(range(5, 45)), SamplingParams(max_tokens=2, ignore_eos=True),
                        arrival_time=0.0))
    assert inst.admit_pending() == []
    while inst.begin_step() is not None:
        inst.end_step()
    assert seen == [(1, 40 * 41 // 2, 0, 0, 1, "many"), (0, 0, 1, 41, 1, "few")]
