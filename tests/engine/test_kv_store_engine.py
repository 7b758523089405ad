"""The prefix cache's disk tier end to end (tiny random model): a new engine on the same
--kv-store directory takes a long shared prefix from disk (fewer tokens computed) and
answers exactly what a store-less engine answers; after a writer is killed with SIGKILL
mid-writes, and with a torn file in the store, outputs are still exactly the store-less
ones."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from duetserve.config import ConfigError, EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PREFIX = [(i * 37 + 11) % 250 + 3 for i in range(120)]       # 30 blocks of 4
SUFFIXES = [[5, 6, 7], [9, 8, 7, 6, 5], [40, 41], [77, 78, 79, 80, 81, 82]]
OPTS = dict(num_threads=2, block_size=4, max_num_batched_tokens=64,
            num_gpu_blocks_override=256, check_integrity_when_idle=True)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["llama-gqa-untied"])


def engine(loaded, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=loaded.path, **OPTS, **kw), loaded=loaded)


def run(eng: EngineCore, prompts):
    return LLM.from_engine(eng).generate(prompts, GREEDY)


@pytest.fixture(scope="module")
def reference(loaded):
    """Each prompt alone on a fresh store-less engine: nothing cached."""
    out = {}
    for s in SUFFIXES:
        (o,) = run(engine(loaded), [PREFIX + s])
        assert o.num_cached_tokens == 0
        out[tuple(s)] = o.outputs[0].token_ids
    return out


def test_restart_reads_the_prefix_from_disk(loaded, reference, tmp_path) -> None:
    first = engine(loaded, kv_store=str(tmp_path))
    (o,) = run(first, [PREFIX + SUFFIXES[0]])
    assert o.outputs[0].token_ids == reference[tuple(SUFFIXES[0])]
    first.shutdown()                          # the queued writes reach the disk
    snap = first.disk_cache.io.store.snapshot()
    assert snap.files == (len(PREFIX) + 3) // 4 and first.make_stats().prefix_cache_disk_hits == 0
    second = engine(loaded, kv_store=str(tmp_path))   # a restart: nothing in memory
    outs = run(second, [PREFIX + SUFFIXES[1]])
    assert outs[0].outputs[0].token_ids == reference[tuple(SUFFIXES[1])]
    st = second.make_stats()
    assert st.prefix_cache_hits == 0 and st.prefix_cache_disk_hits == len(PREFIX)
    assert outs[0].num_cached_tokens == len(PREFIX)   # only the suffix was computed
    # the loaded blocks entered the in-memory cache: the next prompt hits memory
    (o3,) = run(second, [PREFIX + SUFFIXES[2]])
    assert o3.outputs[0].token_ids == reference[tuple(SUFFIXES[2])]
    assert second.make_stats().prefix_cache_hits == len(PREFIX)
    second.shutdown()


def test_a_torn_block_on_disk_is_recomputed(loaded, reference, tmp_path) -> None:
    first = engine(loaded, kv_store=str(tmp_path))
    run(first, [PREFIX + SUFFIXES[0]])
    first.shutdown()
    store = first.disk_cache.io.store
    h = run_hashes(first, PREFIX)[10]           # block 10 torn: blocks 0-9 still load
    with open(store.path_of(h), "r+b") as f:
        f.truncate(os.path.getsize(store.path_of(h)) - 1)
    second = engine(loaded, kv_store=str(tmp_path))
    (o,) = run(second, [PREFIX + SUFFIXES[3]])
    assert o.outputs[0].token_ids == reference[tuple(SUFFIXES[3])]
    assert second.make_stats().prefix_cache_disk_hits == 40 and o.num_cached_tokens == 40
    assert second.disk_cache.io.store.snapshot().corrupt == 1
    second.shutdown()
    # the torn block was computed again and written again, whole
    assert store.read(h, run_hashes(first, PREFIX)[9], tuple(PREFIX[40:44])) is not None


def run_hashes(eng: EngineCore, tokens: list[int]) -> list[bytes]:
    from duetserve.core.hashing import hash_block_tokens
    out, parent = [], None
    for i in range(len(tokens) // eng.config.block_size):
        parent = hash_block_tokens(parent, tokens[i * 4:(i + 1) * 4])
        out.append(parent)
    return out


CHILD = textwrap.dedent("""
    import itertools, sys
    sys.path.insert(0, {tests!r})
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    from duetserve.engine.llm import LLM
    from duetserve.sampling_params import SamplingParams
    eng = EngineCore(EngineConfig(model={model!r}, kv_store={store!r}, **{opts!r}))
    llm = LLM.from_engine(eng)
    prefix = {prefix!r}
    for k in itertools.count():     # new blocks forever: killed while writing
        llm.generate([prefix[:4 * (k % 30)] + [k % 200 + 3] * 40],
                     SamplingParams(temperature=0.0, max_tokens=1))
""")


def test_kill_during_writes_then_restart(loaded, reference, tmp_path) -> None:
    store_dir = str(tmp_path / "store")
    code = CHILD.format(tests=os.path.dirname(os.path.dirname(__file__)), model=loaded.path,
                        store=store_dir, opts=OPTS, prefix=PREFIX)
    child = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while count_blocks(store_dir) < 40:     # wait for files, not for a time
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child wrote no blocks"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    second = engine(loaded, kv_store=store_dir)
    outs = run(second, [PREFIX + s for s in SUFFIXES])
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(s)] for s in SUFFIXES]
    # the child's first two prompts were written whole (one FIFO writer): block 0 of
    # PREFIX came from disk; its temporary files (a write cut short) are gone
    assert second.make_stats().prefix_cache_disk_hits >= 4
    assert not [n for _, _, names in os.walk(store_dir) for n in names
                if n.startswith(".tmp-")]
    second.shutdown()


def count_blocks(root: str) -> int:
    n = 0
    for dirpath, _, names in os.walk(root):
        n += sum(1 for name in names if name.endswith(".kvb"))
    return n


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="prefix caching"):
        EngineConfig(kv_store="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="kv_store_max_gib"):
        EngineConfig(kv_store_max_gib=0)


def test_async_engine_serves_disk_loads(loaded, reference, tmp_path) -> None:
    """The server's loop: a request loading from disk wakes the engine thread when its
    read ends (it sleeps meanwhile, as for KV transfers); a request without a disk hit
    runs alongside."""
    import asyncio

    from duetserve.engine.async_engine import AsyncEngine
    from duetserve.outputs import OutputAccumulator
    first = engine(loaded, kv_store=str(tmp_path))
    run(first, [PREFIX + SUFFIXES[0]])
    first.shutdown()
    second = engine(loaded, kv_store=str(tmp_path))
    aeng = AsyncEngine(second)
    aeng.start()

    async def one(req_id: str, ids: list[int]) -> list[int]:
        acc, last = OutputAccumulator(), None
        async for delta in await aeng.add_request(req_id, ids, GREEDY):
            last = acc.add(delta)
        return last.outputs[0].token_ids

    async def both():
        return await asyncio.gather(one("disk", PREFIX + SUFFIXES[1]),
                                    one("other", list(reversed(PREFIX)) + [3]))

    try:
        got = asyncio.run(both())
    finally:
        aeng.shutdown()
    assert got[0] == reference[tuple(SUFFIXES[1])]
    (alone,) = run(engine(loaded), [list(reversed(PREFIX)) + [3]])
    assert got[1] == alone.outputs[0].token_ids
    assert second.make_stats().prefix_cache_disk_hits == len(PREFIX)


def test_models_with_sliding_window_groups_are_refused(tmp_path) -> None:
    from tiny_families import make_family_checkpoint
    path = make_family_checkpoint(str(tmp_path / "g"), "gemma3")
    with pytest.raises(ConfigError, match="KV groups"):
        EngineCore(EngineConfig(model=path, kv_store=str(tmp_path / "s"), **OPTS))


def test_an_int8_cache_round_trips_through_the_store(loaded, tmp_path) -> None:
    """A quantized cache's blocks (values and their scales, stored in the rows) are saved
    and loaded as they are: a restarted int8 engine answers from disk exactly what a
    store-less int8 engine answers; a bfloat16 engine on the same directory reads none
    of them (another fingerprint)."""
    (ref,) = run(engine(loaded, kv_cache_dtype="int8"), [PREFIX + SUFFIXES[1]])
    first = engine(loaded, kv_store=str(tmp_path), kv_cache_dtype="int8")
    run(first, [PREFIX + SUFFIXES[0]])
    first.shutdown()
    second = engine(loaded, kv_store=str(tmp_path), kv_cache_dtype="int8")
    (o,) = run(second, [PREFIX + SUFFIXES[1]])
    assert second.make_stats().prefix_cache_disk_hits == len(PREFIX)
    assert o.outputs[0].token_ids == ref.outputs[0].token_ids
    second.shutdown()
    other = engine(loaded, kv_store=str(tmp_path), kv_cache_dtype="bfloat16")
    run(other, [PREFIX + SUFFIXES[1]])
    assert other.make_stats().prefix_cache_disk_hits == 0
    other.shutdown()
