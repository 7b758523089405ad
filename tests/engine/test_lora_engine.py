"""LoRA adapters through the engine: greedy tokens of each adapter equal transformers' on
the adapter merged into the weights (float32); a batch mixing four adapters and the base
equals each request alone; prefix caching never shares KV across adapters; at most
max_loras adapters run at once; bad adapters are refused at admission."""
from __future__ import annotations

import threading

import pytest
import torch

from lora_helpers import hf_greedy, make_adapter, merged_reference
from pinned import pinned_step_time
from tiny_models import make_tiny_checkpoint
from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.errors import RequestError
from duetserve.loader import load_model
from duetserve.request import LoRARequest
from duetserve.sampling_params import SamplingParams

N = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250, 42, 42, 7, 128, 64, 1, 77, 78], [200, 33, 12, 90, 91],
           [92, 150, 11, 8, 8, 9, 70, 71, 72], [3, 4, 5], [260, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = make_tiny_checkpoint(str(root / "base"), "llama-gqa-untied")
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base, str(root / f"a{i}"), seed=10 + i,
                                                      r=r, use_rslora=i == 1))
             for i, r in enumerate((4, 8, 2, 4))]
    return base, loras, load_model(base)


def _llm(loaded, **opts) -> LLM:
    cfg = EngineConfig(model=loaded.path, num_threads=2, step_time=pinned_step_time(),
                       check_integrity_when_idle=True, **opts)
    return LLM.from_engine(EngineCore(cfg, loaded=loaded))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_match_merged_reference_alone_and_mixed(setup):
    base, loras, loaded = setup
    llm = _llm(loaded, max_loras=4)
    per_prompt = loras + [None]                     # prompt i under adapter i, the last base
    alone = [_tokens(llm.generate(p, GREEDY, lora_request=lora))[0]
             for p, lora in zip(PROMPTS, per_prompt)]
    for p, lora, ours in zip(PROMPTS, per_prompt, alone):
        ref = merged_reference(base, None if lora is None else lora.lora_path)
        assert hf_greedy(ref, p, N) == ours, lora
    # the adapters change the tokens: prompt 0 on the base differs
    assert _tokens(llm.generate(PROMPTS[0], GREEDY))[0] != alone[0]
    # one batch mixing the four adapters and the base
    stack = loaded.model._stack              # built on the first forward
    calls = stack.calls if stack is not None else 0
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=per_prompt)) == alone
    if stack is not None:      # decode steps with adapter rows ran the native stack,
        # unless the measured GEMV bound (models/kernels.py, timed at load: 0 on a busy
        # machine) keeps even 1-row steps off it
        assert stack.calls > calls or stack.max_rows == 0
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_max_loras_bounds_the_adapters_running_at_once(setup):
    _, loras, loaded = setup
    alone = _tokens(_llm(loaded, max_loras=4).generate(
        PROMPTS[:4], GREEDY, lora_request=loras))
    llm = _llm(loaded, max_loras=2)
    seen = []
    llm.engine.add_step_observer(lambda _: seen.append(
        {r.lora_request.lora_int_id for r in llm.engine.scheduler.running if r.lora_request}))
    assert _tokens(llm.generate(PROMPTS[:4], GREEDY, lora_request=loras)) == alone
    assert max(len(s) for s in seen) == 2
    slots = llm.engine.runner.lora
    assert slots.num_loads == 4 and len(slots.resident()) == 2      # LRU evicted two


def test_lora_dtype_auto_is_int8_on_a_low_bit_base(setup):
    """--lora-dtype auto: int8 adapter weights where the base's linears are low-bit, the
    base's dtype otherwise; an explicit dtype wins. The int8 engine still runs the adapter
    (its tokens differ from the base's)."""
    base, loras, loaded = setup
    low = load_model(base, quantization="int8")
    assert _llm(loaded).engine.runner.lora.dtype == torch.float32
    assert _llm(low, lora_dtype="float32").engine.runner.lora.dtype == torch.float32
    llm = _llm(low)
    assert llm.engine.runner.lora.dtype == torch.int8
    adapted = _tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=loras[0]))[0]
    assert adapted != _tokens(llm.generate(PROMPTS[0], GREEDY))[0]
    assert llm.engine.runner.lora.resident()


def test_prefix_cache_keyed_by_adapter(setup):
    _, loras, loaded = setup
    prompt = list(range(10, 60))                        # three full 16-token blocks
    a, b = loras[0], loras[1]
    expected_b = _tokens(_llm(loaded).generate(prompt, GREEDY, lora_request=b))
    llm = _llm(loaded, max_loras=2)
    stats = llm.engine.scheduler.make_stats

    llm.generate(prompt, GREEDY, lora_request=a)
    assert stats().prefix_cache_hits == 0
    assert _tokens(llm.generate(prompt, GREEDY, lora_request=b)) == expected_b
    assert stats().prefix_cache_hits == 0               # A's KV is no prefix of B's
    llm.generate(prompt, GREEDY)
    assert stats().prefix_cache_hits == 0               # nor of the base's
    assert _tokens(llm.generate(prompt, GREEDY, lora_request=b)) == expected_b
    assert stats().prefix_cache_hits > 0                # B's own prefix is a hit


def test_bad_adapter_refused_at_admission(setup, tmp_path):
    _, loras, loaded = setup
    llm = _llm(loaded, max_lora_rank=4)
    cases = [(LoRARequest("gone", 7, str(tmp_path / "gone")), "is not a folder"),
             (loras[1], r"rank 8, above the limit of 4 \(max_lora_rank\)")]
    for lora, match in cases:
        with pytest.raises(RequestError, match=match) as info:
            llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, lora_request=[None, lora])
        assert info.value.param == "model"
        assert not llm.engine.has_unfinished_requests()       # nothing left queued
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="got 1 lora requests for 2 prompts"):
        llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, lora_request=[loras[0]])
    assert _tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=loras[0]))  # still serves
    assert torch.is_grad_enabled()


def test_ngram_speculation_verifies_under_the_adapter(setup):
    """Verify rows carry their request's adapter: n-gram speculation gives the tokens of
    plain decoding, for adapters and the base mixed."""
    _, loras, loaded = setup
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 4, [40, 41, 42] * 5, [9, 9, 10, 11] * 3]
    per_prompt = [loras[0], loras[1], None]
    plain = _tokens(_llm(loaded, max_loras=2).generate(prompts, params,
                                                        lora_request=per_prompt))
    spec = _llm(loaded, max_loras=2,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert _tokens(spec.generate(prompts, params, lora_request=per_prompt)) == plain
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0


def test_release_frees_an_idle_adapter(setup):
    _, loras, loaded = setup
    llm = _llm(loaded, max_loras=2)
    llm.generate(PROMPTS[:2], GREEDY, lora_request=loras[:2])
    slots = llm.engine.runner.lora
    assert sorted(slots.resident()) == [1, 2]
    assert llm.engine.release_lora(1) and slots.resident() == [2]
    assert sum(a is not None for a in slots.adapters) == 1
    assert not llm.engine.release_lora(1)                 # not resident any more
    again = _tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=loras[0]))
    assert again == _tokens(_llm(loaded).generate(PROMPTS[0], GREEDY, lora_request=loras[0]))


def _held_loader(slots, hold: dict):
    """A LoRASlots loader that, for a folder in `hold`, waits for its Event first and
    then raises its error (None: reads it)."""
    read = slots.load

    def load(path, cfg, rank):
        if path in hold:
            event, error = hold[path]
            assert event.wait(60), "the test never released the read"
            if error is not None:
                raise error
        return read(path, cfg, rank)
    return load


def _run(engine, until) -> dict:
    """Step until `until(finished outputs by id)`; returns them."""
    done = {}
    while not until(done):
        assert engine.has_unfinished_requests()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_adapter_read_does_not_block_other_requests(setup):
    """An adapter that is not resident is read on a loader thread: the request waits
    while a base request submitted after it runs to the end; once the read ends it runs
    and gives the merged reference's tokens."""
    base, loras, loaded = setup
    expected = hf_greedy(merged_reference(base, loras[0].lora_path), PROMPTS[0], N)
    engine = _llm(loaded, max_loras=2).engine
    slots, release = engine.runner.lora, threading.Event()
    slots.load = _held_loader(slots, {loras[0].lora_path: (release, None)})
    engine.add_request("lora", PROMPTS[0], GREEDY, lora_request=loras[0])
    engine.add_request("base", PROMPTS[1], GREEDY)
    done = _run(engine, lambda d: "base" in d)
    assert len(done["base"].outputs[0].token_ids) == N and "lora" not in done
    waiting = engine.scheduler.requests["lora"]
    assert waiting.is_waiting and waiting.num_output_tokens == 0
    assert not engine.has_work_now()         # nothing to do but wait for the read
    release.set()
    done = _run(engine, lambda d: "lora" in d)
    assert done["lora"].outputs[0].token_ids == expected
    assert slots.num_loads == 1 and slots.resident() == [loras[0].lora_int_id]
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_failed_read_fails_its_request_alone(setup):
    """An adapter whose read fails (its files gone after the check) fails its request
    when admitted; a running request of another adapter, re-sent by the step's
    isolation, keeps its adapter."""
    _, loras, loaded = setup
    expected = _tokens(_llm(loaded).generate(PROMPTS[0], GREEDY, lora_request=loras[0]))[0]
    engine = _llm(loaded, max_loras=2).engine
    slots, fail = engine.runner.lora, threading.Event()
    slots.load = _held_loader(slots, {loras[1].lora_path: (
        fail, FileNotFoundError("adapter_model.safetensors vanished"))})
    engine.add_request("good", PROMPTS[0], GREEDY, lora_request=loras[0])
    engine.add_request("bad", PROMPTS[1], GREEDY, lora_request=loras[1])
    _run(engine, lambda d: engine.scheduler.requests["good"].num_output_tokens > 0)
    fail.set()
    assert slots.reads_done.wait(60)              # the failed read has ended
    done = _run(engine, lambda d: len(d) == 2)
    assert "could not be read: FileNotFoundError: adapter_model.safetensors vanished" in \
        done["bad"].error and done["bad"].outputs[0].finish_reason == "error"
    assert engine.executor.num_isolations == 1
    assert done["good"].error is None and done["good"].outputs[0].token_ids == expected
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_disaggregated_pair_runs_the_adapter(setup):
    """A prefill and a decode instance (one process, shared-memory reader) both serving
    an adapter: the decode instance continues under it from the KV the prefill instance
    computed under it; greedy tokens equal the colocated engine's with the adapter."""
    from duetserve.kv_transfer import KVTransferConfig
    from duetserve.kv_transfer.params import KVRequestParams
    _, loras, loaded = setup
    lora, prompts = loras[1], PROMPTS[:3]
    colo = _llm(loaded, max_loras=2)
    want = _tokens(colo.generate(prompts, GREEDY, lora_request=lora))
    assert want != _tokens(colo.generate(prompts, GREEDY))      # the adapter matters
    cfg = EngineConfig(model=loaded.path, num_threads=2, step_time=pinned_step_time(),
                       max_loras=2, check_integrity_when_idle=True)
    pre = EngineCore(cfg, loaded=loaded, kv_transfer=KVTransferConfig("prefill",
                                                                      mooncake=False))
    dec = EngineCore(cfg, loaded=loaded, kv_transfer=KVTransferConfig("decode"))
    got = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        pre.kv_roles.expect(rid, KVRequestParams(do_remote_decode=True))
        pre.add_request(rid, p, GREEDY, lora_request=lora)
        first = _run(pre, lambda d: rid in d)[rid].outputs[0].token_ids
        remote = pre.kv_roles.connector.published(rid)
        assert remote is not None and first == [remote.first_token_id]
        dec.kv_roles.expect(rid, KVRequestParams(remote_prefill=remote))
        dec.add_request(rid, p, GREEDY, lora_request=lora)
        got.append(_run(dec, lambda d: rid in d)[rid].outputs[0].token_ids)
    assert got == want
    assert pre.runner.lora.num_loads == dec.runner.lora.num_loads == 1
    assert dec.scheduler.kv_cache_manager.num_used_blocks == 0
