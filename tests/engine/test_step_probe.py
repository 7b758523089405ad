"""The engine's start-up step-time measurement (engine/step_probe.py): cached under a key
that names every kernel switch; a noisy or implausible measurement is not cached; a cached
model that a quick step shows to be inflated (it was measured on a busy machine) is
measured again. The fake-probe tests time nothing; the tiny-model test measures for real
and only counts entries."""
from __future__ import annotations

import json

import pytest
import torch

from duetserve.config import UNBOUNDED_ROWS, EngineConfig
from duetserve.core.step_budget import IDLE_PROBE
from duetserve.core.step_fit import fit_step_time
from duetserve.core.step_time import Layout, StepShape, StepTime
from duetserve.engine import step_probe
from duetserve.engine.engine_core import EngineCore

LAYOUT = Layout(0, 8, step_probe.GROUPED_MAX_SCORES // 4)
GOOD = StepTime.of(LAYOUT, many_step=0.010, many_row=0.001)
SWITCHES = EngineConfig().kernel_switches()


class FakeRunner:
    model = torch.nn.Module()          # no quantized linears: few_rows 0
    chunk_rows = 8


class FakeProbes:
    """Stands in for measure() and _quick_decode(): counts calls; the measured steps are
    priced by `model`, flagged noisy `noisy` times."""

    def __init__(self, monkeypatch, model: StepTime = GOOD, now_s: float = 0.026,
                 noisy: int = 0) -> None:
        self.model, self.now_s, self.noisy = model, now_s, noisy
        self.measures = self.quick = 0
        monkeypatch.setattr(step_probe, "measure", self.measure)
        monkeypatch.setattr(step_probe, "_quick_decode", self.quick_decode)

    def measure(self, runner, probes, layout, vocab_size, block_size, repeats=2):
        self.measures += 1
        samples = [(p.shape(layout), max(self.model.seconds(p.shape(layout)), 1e-6))
                   for p in probes]
        noisy, self.noisy = ("repeats disagree" if self.noisy else ""), max(0, self.noisy - 1)
        return samples, noisy

    def quick_decode(self, runner, layout, vocab_size, block_size) -> float:
        self.quick += 1
        return self.now_s


@pytest.fixture
def model(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x")
    return str(path)


def start(model: str, threads: int = 2, switches: dict = SWITCHES):
    return step_probe.startup_step_time(FakeRunner(), model, switches, threads, 300, 4, 16,
                                        4096)


def test_noise_free_probe_steps_are_fitted_exactly() -> None:
    """Steps priced exactly by a model with two terms: the start-up fit over every term
    (some of them combinations of others on these probes) finds that model, not zeros
    from a 0/0 in the active-set solver."""
    probes = step_probe.fits(step_probe.startup_probes(LAYOUT), 4096)
    samples = [(p.shape(LAYOUT), GOOD.seconds(p.shape(LAYOUT))) for p in probes]
    model, report = fit_step_time(samples, LAYOUT, step_probe.STARTUP_TERMS)
    assert report["rms_rel_error"] < 1e-9
    assert (model.term("many_step"), model.term("many_row")) == pytest.approx((0.010, 0.001))


def test_measurement_is_cached_under_every_switch(model, monkeypatch) -> None:
    probes = FakeProbes(monkeypatch)
    got, source = start(model)
    assert source.how == "measured" and probes.measures == 1
    assert got.seconds(StepShape.of([(40, 0, 1)], LAYOUT)) == pytest.approx(0.050)
    again, source = start(model)
    assert again == got and source.how == "cached" and probes.quick == 1
    assert start(model, threads=4)[1].how == "measured"            # threads are in the key
    for name, other in (("decode_stack", False), ("native_kernels", False),
                        ("kquant_forms", "exact"), ("huge_pages", False),
                        ("kv_prefault", True), ("dtype", "bfloat16")):
        before = probes.measures
        assert start(model, switches={**SWITCHES, name: other})[1].how == "measured", name
        assert probes.measures == before + 1


def test_an_inflated_cached_model_is_measured_again(model, monkeypatch) -> None:
    """A model cached from a busy machine predicts ~10x the decode step that takes 26 ms
    now: it is measured again and replaced. One that predicts a little faster than now
    (the machine is busy now) is kept."""
    FakeProbes(monkeypatch, model=GOOD.scaled(10.0))
    start(model)
    probes = FakeProbes(monkeypatch, now_s=0.026)
    assert start(model)[1].how == "measured" and probes.measures == 1
    assert start(model)[1].how == "cached"                        # the replacement
    busy_now = FakeProbes(monkeypatch, now_s=0.2)
    assert start(model)[1].how == "cached" and busy_now.measures == 0


def test_noisy_or_implausible_measurements_are_not_cached(model, monkeypatch, tmp_path) -> None:
    noisy = FakeProbes(monkeypatch, noisy=2)             # noisy twice: used, not cached
    got, source = start(model)
    assert got is not None and noisy.measures == 2 and "not cached" in source.detail
    once = FakeProbes(monkeypatch, noisy=1)              # noisy once, then clean: cached
    assert start(model)[1].how == "measured" and once.measures == 2
    assert start(model)[1].how == "cached"
    flat = StepTime.of(LAYOUT, many_step=1.8)            # rows free: noise
    FakeProbes(monkeypatch, model=flat)
    assert "implausible" in start(model, threads=3)[1].detail
    entries = json.loads((tmp_path / step_probe.CACHE_FILE).read_text())
    assert len(entries) == 1


def test_malformed_cache_files_are_measured_again(model, monkeypatch, tmp_path) -> None:
    (tmp_path / step_probe.CACHE_FILE).write_text('[1, 2]')
    probes = FakeProbes(monkeypatch)
    assert start(model)[1].how == "measured" and probes.measures == 1
    assert start(model)[1].how == "cached"


def test_a_measurement_the_terms_cannot_fit_leaves_no_model(model, monkeypatch,
                                                            tmp_path) -> None:
    """Probes that identify fewer terms than the layout prices (a few-row limit measured
    very low on a busy machine: 8 probes, 9 terms, seen in a full test run) give no
    step-time model (the fixed fallback budget) instead of an engine that fails to
    start; nothing is cached."""
    probes = FakeProbes(monkeypatch)
    full = probes.measure
    monkeypatch.setattr(step_probe, "measure", lambda *a, **k: (full(*a, **k)[0][:1], ""))
    got, source = start(model)
    assert got is None and source.how == "none" and "measurement failed" in source.detail
    assert not (tmp_path / step_probe.CACHE_FILE).exists()


def test_a_cache_too_small_for_the_probes_is_not_measured(model, monkeypatch) -> None:
    """A 16-token context (tests' toy engines) cannot hold a probe: no measurement, no
    cache entry; the engine then schedules with the fixed fallback budget."""
    probes = FakeProbes(monkeypatch)
    got, source = step_probe.startup_step_time(FakeRunner(), model, SWITCHES, 2, 300, 4, 16,
                                               16)
    assert got is None and source.how == "none"
    assert probes.measures == probes.quick == 0


def test_flipping_a_switch_measures_the_real_engine_again(tiny_checkpoints, tmp_path,
                                                           monkeypatch) -> None:
    """The acceptance: on the tiny model, an engine with the decode stack off does not
    reuse the step time measured with it on (another cache key: measured); the same
    switches again name the same entry. (Whether a real measurement is cached depends on
    how busy the machine is, so only keys and sources are compared.)"""
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    path = tiny_checkpoints["llama-gqa-untied"]

    def engine(**kw) -> EngineCore:
        return EngineCore(EngineConfig(model=path, num_threads=1, kv_cache_memory=0.05, **kw))
    first = engine()
    assert first.step_time_source.how == "measured"          # a fresh cache directory
    assert first.step_time is not None
    off = engine(decode_stack=False)
    assert off.step_time_source.how == "measured"
    assert off.step_time_source.key != first.step_time_source.key
    assert engine().step_time_source.key == first.step_time_source.key
    printed = engine(max_num_batched_tokens=64).resolved_config()
    assert printed["step_time"] is None and printed["step_time_source"]["how"] == "none"
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(first.resolved_config()))        # --print-config's output
    again = engine(step_time=str(pinned))
    assert again.step_time == first.step_time and again.step_time_source.how == "file"


@pytest.mark.parametrize("few_rows", [0, 16, 64, 65, 128, 512, UNBOUNDED_ROWS])
def test_startup_probes_stay_small_whatever_the_few_row_limit(few_rows) -> None:
    """Probe sizes follow the few-row limit R up to PROBE_FEW_ROWS; past it (prefill
    chunks on the low-bit kernels, or every step) they stay those of R = 64 and within R,
    so start-up takes what it does at 64 and every probe runs the few-row kernels; but one:
    a lone prompt's IDLE_PROBE tokens, the largest step the idle budget may choose
    (core/step_budget.idle_chunk), measured whatever its kernels."""
    layout = Layout(few_rows, 64, step_probe.GROUPED_MAX_SCORES // 4)
    def small(lay: Layout) -> list:
        probes = step_probe.startup_probes(lay)
        idle = [p for p in probes if p.name == "prefill_idle"]
        assert [p.seqs for p in idle] == [((IDLE_PROBE, IDLE_PROBE),)]
        return [p for p in probes if p.name != "prefill_idle"]
    def rows(lay: Layout) -> list[int]:
        return [sum(new for _, new in p.seqs) for p in small(lay)]
    assert max(rows(layout)) <= max(rows(Layout(64, 64, 0))) == 160
    paths = {p.shape(layout).path for p in small(layout)}
    if few_rows > step_probe.PROBE_FEW_ROWS:
        assert max(rows(layout)) <= few_rows and paths == {"few", "mixed"}
    else:
        assert "many" in paths


def test_an_unbounded_layout_is_measured_plausible_and_cached(model, monkeypatch) -> None:
    """Every step on the few-row kernels: the start-up fit over the probes (none past the
    limit) prices the few and mixed paths, is plausible and cached; a bounded limit past
    the probes gets its many-row path priced as the mixed one."""
    for few_rows in (UNBOUNDED_ROWS, 512):
        layout = Layout(few_rows, 8, step_probe.GROUPED_MAX_SCORES // 4)
        truth = StepTime.of(layout, few_step=0.010, few_row=0.001, mixed_step=0.015,
                            mixed_row=0.002, logit=1e-4)
        FakeProbes(monkeypatch, model=truth)
        monkeypatch.setattr(FakeRunner, "model", _policy_model(few_rows))
        got, source = start(model)
        assert got.layout == layout and got.is_plausible() and "cached" in source.detail
        every = Layout(UNBOUNDED_ROWS, 8, 0)       # the truth's mixed path at 2,048 rows
        assert got.seconds(StepShape.of([(2048, 0, 1)], layout)) == pytest.approx(
            StepTime(every, truth.coef).seconds(StepShape.of([(2048, 0, 1)], every)),
            rel=0.05)
        if few_rows == 512:
            assert got.term("many_row") == got.term("mixed_row") > 0
        else:
            assert got.term("many_row") == 0.0


def _policy_model(lowbit_max_rows: int) -> torch.nn.Module:
    """A model whose one quantized linear runs the low-bit kernels up to this many rows."""
    from duetserve.models.quant import Int8Weight, KernelPolicy, QuantLinear, quantize_int8
    layer = QuantLinear(Int8Weight(*quantize_int8(torch.randn(8, 64))), None,
                        KernelPolicy(lowbit_max_rows=lowbit_max_rows))
    return torch.nn.Sequential(layer)


class CacheRunner:
    """What ProbeBlocks reads of a runner, over a real (tiny) KV cache."""

    def __init__(self, num_blocks: int, lazy: bool) -> None:
        from duetserve.config import ModelConfig
        from duetserve.worker.kv_cache import allocate_kv_cache
        cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                          rms_norm_eps=1e-5, rope_theta=10000.0)
        self.num_blocks, self.kv_windows, self.kv_lazy = num_blocks, (None,), lazy
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, 16, torch.float32, "cpu")


def _faults_writing(t: torch.Tensor, blocks: torch.Tensor | None = None) -> int:
    """Page faults taken writing ones to `t` (to its `blocks` along dim 1, when given)."""
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if blocks is None:
        t.fill_(1.0)
    else:
        t.index_fill_(1, blocks, 1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_probe_blocks_spread_over_the_pool_and_wrap() -> None:
    """Probe sequences read KV scattered over the pool, as a served engine's blocks are,
    each its own blocks while the pool holds them all."""
    runner = CacheRunner(64, lazy=False)
    probe = step_probe.Probe("d", ((128, 1),) * 4)               # 4 x 8 blocks of 16
    blocks = step_probe.ProbeBlocks(runner, [probe], 16)
    tables = blocks.tables(probe)
    ids = [b for t in tables for b in t]
    assert [len(t) for t in tables] == [8] * 4 and len(set(ids)) == 32
    assert ids != sorted(ids) and max(ids) - min(ids) > 32      # not blocks 0..31 in order
    big = step_probe.Probe("big", ((1024, 1),) * 2)              # 128 blocks from a pool of 64
    wrapped = [b for t in step_probe.ProbeBlocks(runner, [big], 16).tables(big) for b in t]
    assert len(wrapped) == 128 and set(wrapped) == set(range(64))


def test_probe_blocks_map_their_pages_and_hand_a_lazy_cache_back() -> None:
    """Entering writes the blocks the probes use (unwritten pages would all read the one
    zero page, always in cache); leaving hands a lazily mapped cache's pages back, so they
    read as zeros and fault again on the next write; a cache mapped by someone else
    (prefaulted, a shared buffer) keeps its pages and contents."""
    probe = step_probe.Probe("d", ((256, 1),) * 4)               # 64 of 256 blocks
    lazy = CacheRunner(256, lazy=True)
    k = lazy.kv_caches[0][0]                                      # [kv_heads, blocks, 16, 32]
    with step_probe.ProbeBlocks(lazy, [probe], 16) as blocks:
        used = torch.tensor(blocks.order[:blocks.num_used])
        assert blocks.num_used == 64
        pages = k.index_select(1, used).numel() * 4 // 4096        # 64 blocks x 2 heads x 2 KiB
        assert _faults_writing(k, used) < pages // 4              # mapped on entering
    assert float(k.abs().sum()) == 0.0
    assert _faults_writing(k, used) >= pages // 2                 # handed back
    kept = CacheRunner(256, lazy=False)
    kept.kv_caches[1][1].fill_(2.0)
    with step_probe.ProbeBlocks(kept, [probe], 16) as blocks:
        pass
    v = kept.kv_caches[1][1]
    assert float(v[:, blocks.order[0]].abs().sum()) == 0.0        # used: written zeros
    assert float(v[:, blocks.order[-1]].min()) == 2.0             # others: untouched
