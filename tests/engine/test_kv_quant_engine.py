"""--kv-cache-dtype int8 / int4 through the engine on tiny random models: greedy outputs
identical however the engine batches, chunks, caches, preempts or speculates (every path
reads the K/V as stored, the chunk's own included), close to float32 KV, on a Gemma-3-style
hybrid model too, and across a prefill/decode transfer that moves the rows as stored."""
from __future__ import annotations

import pytest
import torch

from test_equivalence import GREEDY, _engine, _prompts, _run_all
from tiny_families import make_family_checkpoint
from duetserve.config import ConfigError, EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.kv_transfer import KVTransferConfig
from duetserve.kv_transfer.params import KVRequestParams
from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams
from duetserve.worker.kv_cache import kv_row_elems
from pinned import pinned_step_time

# int8 against float32 KV on a tiny random model, which has near-ties everywhere (even
# bfloat16 KV changes 1 of _prompts' 16 greedy outputs, int8 8 of 16, each first where
# float32's top two tokens are within 0.09 nats). So logits are compared with a
# tolerance instead: until the outputs differ the same tokens are scored, and their
# log-probs may differ by MEAN_DLOGPROB on average (measured 0.025; bfloat16 KV 0.009);
# where they differ, float32's choice and int8's must be within NEAR_TIE of each other
# in float32's log-probs (the largest single change measured before a divergence: 0.22).
MEAN_DLOGPROB = 0.05
NEAR_TIE = 0.25


def _modes_equal(loaded, prompts, kv: str, small_blocks: int = 40) -> list[list[int]]:
    """The plain run's tokens, after checking one-at-a-time, chunked, prefix-cached (with
    hits), preempted and speculative (n-gram) runs give the same, on `prompts` (a few of
    _prompts', to keep the test short; the last ones after the shared prefix)."""
    base = _run_all(_engine(loaded, kv_cache_dtype=kv, max_num_batched_tokens=4096), prompts)
    eng = _engine(loaded, kv_cache_dtype=kv)
    assert eng.engine.runner.kv_caches[0][0].dtype == {"int8": torch.int8,
                                                       "int4": torch.uint8}[kv]
    assert _run_all(eng, prompts, one_at_a_time=True) == base
    assert _run_all(_engine(loaded, kv_cache_dtype=kv, max_num_batched_tokens=32),
                    prompts) == base
    cached = _engine(loaded, kv_cache_dtype=kv)
    _run_all(cached, prompts[-1:])                       # warm the shared prefix
    assert _run_all(cached, prompts) == base
    assert cached.engine.scheduler.make_stats().prefix_cache_hits > 0
    small = _engine(loaded, kv_cache_dtype=kv, num_gpu_blocks_override=small_blocks,
                    block_size=8)
    assert _run_all(small, prompts) == base
    assert small.engine.scheduler.num_preemptions > 0
    spec = _engine(loaded, kv_cache_dtype=kv,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert _run_all(spec, prompts) == base
    return base


def _close_to_float32(loaded, prompts, kv: str) -> int:
    """Checks `kv` greedy outputs against float32 KV's as the comment above says. Returns
    how many sequences are equal."""
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True,
                            logprobs=8)
    ours, ref = ([o.outputs[0] for o in _engine(loaded, kv_cache_dtype=d).generate(
        prompts, params)] for d in (kv, "float32"))
    equal, diffs = 0, []
    for a, b in zip(ours, ref):
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 None)
        for j in range(len(b.token_ids) if i is None else i):
            la, lb = a.logprobs[j], b.logprobs[j]
            diffs += [abs(la[t].logprob - lb[t].logprob) for t in lb if t in la]
        if i is None:
            equal += 1
            continue
        lb = b.logprobs[i]
        assert a.token_ids[i] in lb, (i, a.token_ids[i], b.token_ids[i])
        assert lb[b.token_ids[i]].logprob - lb[a.token_ids[i]].logprob <= NEAR_TIE, i
    assert sum(diffs) / len(diffs) <= MEAN_DLOGPROB
    return equal


def test_int8_kv_all_modes_and_float32_agreement(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama-gqa-untied"])
    prompts = _prompts(loaded.config.vocab_size)
    _modes_equal(loaded, prompts[1::3], "int8")
    _close_to_float32(loaded, prompts[::2], "int8")


def test_int8_kv_without_native_kernels(tiny_checkpoints):
    """The plain-torch paths (no native kernels: dequantizing gathers) write the same
    rows and give the native run's greedy tokens."""
    loaded = load_model(tiny_checkpoints["llama-gqa-untied"])
    prompts = _prompts(loaded.config.vocab_size)[1::3]
    native = _run_all(_engine(loaded, kv_cache_dtype="int8", max_num_batched_tokens=32),
                      prompts)
    from duetserve.models import native as nat
    try:
        plain_loaded = load_model(loaded.path, native=False)
        plain = _engine(plain_loaded, kv_cache_dtype="int8", native_kernels=False,
                        max_num_batched_tokens=32)
        assert plain.engine.runner.paged_decode is False
        assert _run_all(plain, prompts) == native
    finally:
        nat.set_enabled(True)


def test_int4_kv_all_modes(tmp_path):
    """int4 (head_dim 32: one group a row) on the same modes; agreement with float32 is
    for the KL benchmark (benchmarks/kl_divergence.py), not asserted on a random model."""
    from tiny_models import make_tiny_checkpoint
    loaded = load_model(make_tiny_checkpoint(str(tmp_path / "m"), "llama-gqa-untied",
                                             hidden_size=128))
    assert loaded.config.head_dim == 32
    _modes_equal(loaded, _prompts(loaded.config.vocab_size)[1::3], "int4")


def test_int4_refuses_a_head_size_it_cannot_group(tiny_checkpoints):
    with pytest.raises(ConfigError, match="head_dim divisible by 32"):
        EngineCore(EngineConfig(model=tiny_checkpoints["llama-gqa-tied"], num_threads=2,
                                kv_cache_dtype="int4", step_time=pinned_step_time()))


def test_gemma3_hybrid_int8(tmp_path):
    """Sliding-window groups and a full group in one int8 cache (tests/engine/
    test_family_engines.py's model, prompts and preempting pool): chunked and preempted
    runs equal the plain one, prefix hits happen along the way, and float32 KV agrees
    within the tolerances above."""
    loaded = load_model(make_family_checkpoint(str(tmp_path / "g"), "gemma3"))
    groups = len(loaded.config.kv_groups())
    assert groups > 1
    prompts = _prompts(loaded.config.vocab_size, seed=2)
    base = _run_all(_engine(loaded, kv_cache_dtype="int8"), prompts)
    chunked = _engine(loaded, kv_cache_dtype="int8", max_num_batched_tokens=32)
    assert _run_all(chunked, prompts) == base
    assert chunked.engine.scheduler.make_stats().prefix_cache_hits > 0
    small = _engine(loaded, kv_cache_dtype="int8", num_gpu_blocks_override=20 * groups,
                    block_size=8)
    assert _run_all(small, prompts) == base
    assert small.engine.scheduler.num_preemptions > 0
    _close_to_float32(loaded, prompts[::2], "int8")


def _drain(eng: EngineCore, rid: str) -> list[int]:
    """Steps until `rid` finishes; its tokens."""
    for _ in range(10_000):
        for o in eng.step():
            if o.request_id == rid and o.finished:
                return o.outputs[0].token_ids
    raise AssertionError(f"{rid} did not finish")


def test_disaggregated_int8_moves_rows_as_stored(tiny_checkpoints):
    """A prefill instance and a decode instance (one process, shared-memory reader) with
    int8 caches: the decode instance's greedy tokens equal a colocated int8 engine's, the
    bytes moved are the int8 layout's (values + scales, no staging even with
    --kv-transfer-compression int8), and the loaded rows equal the producer's bytes."""
    path = tiny_checkpoints["llama-gqa-untied"]
    loaded = load_model(path)
    prompts = _prompts(loaded.config.vocab_size)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cfg = EngineConfig(model=path, num_threads=2, step_time=pinned_step_time(),
                       kv_cache_dtype="int8", kv_cache_memory=0.01)
    colo = _engine(loaded, kv_cache_dtype="int8", kv_cache_memory=0.01)
    want = [o.outputs[0].token_ids for o in colo.generate(prompts, params)]
    pre = EngineCore(cfg, loaded=loaded, kv_transfer=KVTransferConfig(
        "prefill", mooncake=False, compression="int8"))
    dec = EngineCore(cfg, loaded=loaded, kv_transfer=KVTransferConfig("decode"))
    conn = dec.kv_roles.connector
    assert conn.layout.dtype == "int8"
    assert conn.layout.row_width == kv_row_elems(loaded.config.head_dim, torch.int8)
    got = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        pre.kv_roles.expect(rid, KVRequestParams(do_remote_decode=True))
        pre.add_request(rid, p, params)
        first = _drain(pre, rid)
        remote = pre.kv_roles.connector.published(rid)
        assert remote is not None and remote.compression == "none"
        assert first[:1] == [remote.first_token_id]
        before = conn.totals["shm"].bytes if "shm" in conn.totals else 0
        dec.kv_roles.expect(rid, KVRequestParams(remote_prefill=remote))
        dec.add_request(rid, p, params)
        got.append(_drain(dec, rid))
        moved = conn.totals["shm"].bytes - before
        assert moved == len(remote.block_ids) * conn.layout.bytes_per_block
    assert got == want
