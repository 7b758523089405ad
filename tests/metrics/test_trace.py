"""TraceWriter: Chrome trace structure on synthetic steps, then a real engine run + duet plot."""
from __future__ import annotations

import json


import jsonschema
import pytest

from duetserve.metrics.hardware import HardwareProfile
from duetserve.metrics.step_accounting import StepAccountant
from duetserve.metrics.trace import STEPS_TID, STEPS_TRACK, TraceWriter
from duetserve.outputs import ScheduledSlice, StepStats

# A strict schema of the Chrome trace "JSON object format" subset we write.
_EVENT = {
    "type": "object",
    "required": ["name", "ph", "ts", "pid", "tid"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "ph": {"enum": ["X", "M", "i", "C"]},
        "ts": {"type": "number", "minimum": 0},
        "dur": {"type": "number", "minimum": 0},
        "pid": {"type": "integer"},
        "tid": {"type": "integer"},
        "s": {"enum": ["g", "p", "t"]},
        "args": {"type": "object"},
    },
    "additionalProperties": False,
    "allOf": [{"if": {"properties": {"ph": {"const": "X"}}},
               "then": {"required": ["dur"]}}],
}
TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents", "displayTimeUnit"],
    "properties": {"traceEvents": {"type": "array", "items": _EVENT},
                   "displayTimeUnit": {"enum": ["ms", "ns"]},
                   "otherData": {"type": "object"}},
    "additionalProperties": False,
}


def validate_trace(data: dict) -> dict[int, str]:
    """Validate `data`; return tid -> track name."""
    jsonschema.validate(data, TRACE_SCHEMA)
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[STEPS_TID] == STEPS_TRACK
    for e in data["traceEvents"]:
        assert e["tid"] in names, e
    return names


def Stats(start_time: float, step_seconds: float, items: list[tuple[str, int, int]],
          num_prefill_tokens: int = 0, num_decode_tokens: int = 0,
          finished_req_ids: list[str] | None = None) -> StepStats:
    """A StepStats of (req_id, num_new, num_computed_before) slices; the 1-token slices of
    the steps with decode tokens are decodes (the scheduler's decision in the engine)."""
    return StepStats(start_time=start_time, step_seconds=step_seconds,
                     num_prefill_tokens=num_prefill_tokens,
                     num_decode_tokens=num_decode_tokens, num_running=1, kv_usage=0.1,
                     items=[ScheduledSlice(req_id=r, num_new_tokens=n, num_computed_before=c,
                                           is_decode=n == 1 and num_decode_tokens > 0)
                            for r, n, c in items],
                     finished_req_ids=finished_req_ids or [])


def test_request_tracks_on_synthetic_steps(tmp_path) -> None:
    path = str(tmp_path / "t.json")
    w = TraceWriter(path)
    w.request_arrived("a", 10.0, num_prompt_tokens=6)
    # step 0: a prefills 4 of 6; step 1: a prefills the last 2 (1-token chunks would be
    # prefill too: computed < prompt); b (unknown arrival) prefills 3; steps 2-4: decodes.
    w.observe(Stats(11.0, 0.5, [("a", 4, 0)], 4, 0))
    w.observe(Stats(11.5, 0.5, [("a", 2, 4), ("b", 3, 0)], 5, 0))
    w.observe(Stats(12.0, 0.1, [("a", 1, 6), ("b", 1, 3)], 0, 2))
    w.observe(Stats(12.1, 0.1, [("a", 1, 7), ("b", 1, 4)], 0, 2, finished_req_ids=["a"]))
    w.observe(Stats(12.2, 0.1, [("b", 1, 5)], 0, 1))
    w.flush()                                   # flush-safe: valid with b still open
    data = json.load(open(path))
    names = validate_trace(data)
    tid = {v: k for k, v in names.items()}
    evs = lambda t: [(e["name"], e["ts"], e.get("dur")) for e in data["traceEvents"]  # noqa
                     if e["tid"] == tid[t] and e["ph"] != "M"]
    # t0 = arrival of a (10.0 s); microseconds
    assert evs("req a") == [("queued", 0, 1e6), ("prefill", 1e6, 0.5e6),
                            ("prefill", 1.5e6, 0.5e6), ("decode", 2e6, pytest.approx(0.2e6)),
                            ("finished", pytest.approx(2.2e6), None)]
    b = evs("req b")
    assert b[0] == ("queued", 1e6, 0.5e6)      # unknown arrival: from the first step
    assert b[1][0] == "prefill" and b[2][0] == "decode"
    assert b[2][2] == pytest.approx(0.3e6)      # three decode steps merged
    steps = [e for e in data["traceEvents"] if e["tid"] == STEPS_TID and e["ph"] == "X"]
    assert [e["name"] for e in steps] == ["prefill", "prefill", "decode", "decode", "decode"]
    assert steps[1]["args"]["prefill_tokens"] == 5 and steps[1]["args"]["mfu"] is None
    w.close()
    w.close()                                   # idempotent
    w.observe(Stats(13.0, 0.1, [("b", 1, 6)], 0, 1))   # ignored after close
    assert json.load(open(path)) == json.load(open(path))


def test_steps_carry_accountant_figures(tmp_path) -> None:
    from duetserve.config import ModelConfig
    cfg = ModelConfig(architecture="llama", vocab_size=100, hidden_size=8,
                      intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=2)
    hw = HardwareProfile("test", "", (("fp32", 1e4),), 1e5, 1e9, "fp32")
    acc = StepAccountant(cfg, 2792 * 4, "float32", hw)
    path = str(tmp_path / "t.json")
    with TraceWriter(path, acc) as w:
        s = Stats(1.0, 0.5, [("a", 1, 10)], 0, 1)
        w.observe(s)            # writer first: computes without recording
        acc.observe(s)
    data = json.load(open(path))
    step = [e for e in data["traceEvents"] if e["tid"] == STEPS_TID and e["ph"] == "X"][0]
    assert step["args"]["mfu"] == pytest.approx(4608 / 0.5 / 1e4)
    assert step["args"]["mbu"] == pytest.approx(8704 / 0.5 / 1e5)
    assert data["otherData"]["hardware"]["peak_flops"] == 1e4
    assert acc.summary()["all"]["steps"] == 1


def test_engine_run_trace_and_plot(tiny_checkpoints, tmp_path) -> None:
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.engine.llm import LLM
    from duetserve.entrypoints.cli import main as cli_main
    from duetserve.metrics.step_accounting import StepAccountant
    from duetserve.sampling_params import SamplingParams

    engine = EngineCore(EngineConfig(model=tiny_checkpoints["llama-gqa-untied"],
                                     num_threads=1, kv_cache_memory=0.05,
                                     max_num_batched_tokens=2048,
                                     check_integrity_when_idle=True))
    acc = StepAccountant(engine.model_config, engine.loaded.weight_bytes,
                         str(engine.kv_dtype).replace("torch.", ""))
    trace = str(tmp_path / "trace.json")
    writer = TraceWriter(trace, acc)
    engine.add_step_observer(acc.observe)
    engine.add_step_observer(writer.observe)
    prompts = [f"request {i} " + "ab" * (i % 7) for i in range(32)]
    outs = LLM.from_engine(engine).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    writer.close()
    assert len(outs) == 32

    data = json.load(open(trace))
    names = validate_trace(data)
    assert sum(1 for n in names.values() if n.startswith("req ")) == 32
    events = data["traceEvents"]
    steps = [e for e in events if e["tid"] == STEPS_TID and e["ph"] == "X"]
    s = acc.summary()
    assert len(steps) == s["all"]["steps"] > 0
    assert sum(e["args"]["decode_tokens"] for e in steps) == s["decode"]["tokens"] + sum(
        e["args"]["decode_tokens"] for e in steps if e["name"] == "mixed")
    assert all(0 <= e["args"]["mfu"] and 0 <= e["args"]["mbu"] for e in steps)
    for tid in (t for t, n in names.items() if n.startswith("req ")):
        kinds = [e["name"] for e in events if e["tid"] == tid and e["ph"] != "M"]
        assert "prefill" in kinds and "decode" in kinds and kinds[-1] == "finished"
    # every request generates 8 tokens: 1 from its (last) prefill step + 7 decodes
    decoded = sum(e["args"]["tokens"] for e in events
                  if e["name"] == "decode" and e["tid"] != STEPS_TID)
    assert decoded == 32 * 7

    png = str(tmp_path / "timeline.png")
    assert cli_main(["plot", trace, "-o", png]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_generate_cli_writes_its_trace_file(tiny_checkpoints, tmp_path) -> None:
    """`duet generate --trace-file` closes its engine, so even a run of well under the
    trace's flush interval leaves a complete trace (it used to leave nothing)."""
    from duetserve.entrypoints.cli import main as cli_main
    trace = str(tmp_path / "gen_trace.json")
    rc = cli_main(["generate", "--model", tiny_checkpoints["llama-gqa-untied"], "--prompt",
                   "hello", "--max-tokens", "4", "--num-threads", "1", "--kv-cache-memory",
                   "0.05", "--trace-file", trace])
    assert rc == 0
    names = validate_trace(json.load(open(trace)))
    assert sum(1 for n in names.values() if n.startswith("req ")) == 1
