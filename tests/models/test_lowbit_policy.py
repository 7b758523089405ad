"""The low-bit / dense kernel policy (models/kernels.py, issue 67): the crossover is
searched over the row counts prefill steps have (1..2,048), a dense path that dequantizes
per call is timed with its dequantization, one lucky sample cannot move the bound, and the
path a many-row step then takes is the one the measurement found faster. The timing tests
run on a fake clock: each path advances it by a cost model of the rows (nothing is
timed for real)."""
from __future__ import annotations

import pytest
import torch

from duetserve.config import UNBOUNDED_ROWS, describe_row_limit
from duetserve.core.step_budget import IDLE_BUDGET
from duetserve.core.step_time import Layout, StepShape
from duetserve.models import kernels
from duetserve.models.quant import (Int4Weight, KernelPolicy, QuantLinear,
                                    int4_groups_from_float)


class FakeOps:
    """The native module as the policy sees it: AMX or not, whatever this CPU has."""

    def __init__(self, amx: bool) -> None:
        self.amx = amx

    def amx_available(self) -> bool:
        return self.amx


class FakePaths:
    """A QuantLinear whose paths cost `lowbit(rows)`, `dense(rows, call)` and, where
    given, `amx(rows)` seconds of a fake clock (call: how many times the dense path ran at
    that row count), and record which path ran. The dense path stands for the per-call
    dequantization and its GEMM together (QuantLinear._dequantized_gemm). Without `amx`
    the CPU has no AMX, whatever the real one has."""

    def __init__(self, monkeypatch, lowbit, dense, n: int = 64, k: int = 256,
                 amx=None) -> None:
        self.clock = 0.0
        self.calls: list[tuple[str, int]] = []
        self.dense_calls: dict[int, int] = {}
        self.amx_calls = 0
        gen = torch.Generator().manual_seed(0)
        qw = Int4Weight(*int4_groups_from_float(torch.randn(n, k, generator=gen)))
        self.layer = QuantLinear(qw, None, KernelPolicy(lowbit_max_rows=8))
        self.model = torch.nn.Sequential(self.layer)

        def lowbit_path(x: torch.Tensor) -> torch.Tensor:
            self.clock += lowbit(x.shape[0])
            self.calls.append(("lowbit", x.shape[0]))
            return torch.zeros(x.shape[0], n)

        def dense_path(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            self.dense_calls[rows] = self.dense_calls.get(rows, 0) + 1
            self.clock += dense(rows, self.dense_calls[rows])
            self.calls.append(("dense", rows))
            return torch.zeros(rows, n)
        def amx_path(x: torch.Tensor) -> torch.Tensor:
            self.clock += amx(x.shape[0])
            self.calls.append(("amx", x.shape[0]))
            self.amx_calls += 1
            return torch.zeros(x.shape[0], n)
        monkeypatch.setattr(qw, "matmul", lowbit_path)
        monkeypatch.setattr(qw, "amx_matmul", amx_path)
        monkeypatch.setattr(kernels, "ops", lambda: FakeOps(amx is not None))
        monkeypatch.setattr(self.layer, "_dequantized_gemm", dense_path)
        monkeypatch.setattr(kernels.time, "perf_counter", lambda: self.clock)
        self.keys: list[str] = []

        def uncached(key: str, measure):
            self.keys.append(key)
            return measure()
        monkeypatch.setattr(kernels, "_cached", uncached)

    def path_of(self, rows: int) -> str:
        """The path a step of `rows` rows takes under the layer's policy now."""
        self.calls.clear()
        self.layer(torch.randn(rows, self.layer.in_features))
        return self.calls[-1][0]


def test_the_crossover_is_searched_up_to_the_largest_derived_step() -> None:
    assert kernels.LOWBIT_ROWS[-1] == IDLE_BUDGET
    assert list(kernels.LOWBIT_ROWS) == sorted(set(kernels.LOWBIT_ROWS))


def test_dense_faster_past_n_rows_bounds_the_lowbit_kernels_at_n(monkeypatch) -> None:
    """Low-bit 1 s a row; dense 200 s of dequantization + 0.2 s a row: dense wins from
    250 rows, so from 256 on; the bound is 128 and a 2,048-row step runs dense."""
    fake = FakePaths(monkeypatch, lambda m: 1.0 * m, lambda m, call: 200.0 + 0.2 * m)
    kernels.finish_policy(fake.model, fake.layer.policy)
    policy = fake.layer.policy
    assert policy.lowbit_max_rows == 128 == kernels.few_row_limit(fake.model)
    assert "low-bit kernels for steps of <= 128 rows" in policy.reason
    assert "dequantized per call" in policy.reason and "1..2048 rows" in policy.reason
    assert fake.path_of(128) == "lowbit" and fake.path_of(2048) == "dense"
    assert fake.path_of(256) == "dense"
    # the search ended at the confirming count: nothing timed past 512 rows
    assert 512 in fake.dense_calls and 1024 not in fake.dense_calls


def test_lowbit_faster_everywhere_runs_every_step_on_the_lowbit_kernels(monkeypatch) -> None:
    """The 1.5B Q4_K_M case: the dense path pays a dequantization that no row count up to
    2,048 amortizes. Every step runs the low-bit kernels, 2,048 rows and more."""
    fake = FakePaths(monkeypatch, lambda m: 1.0 * m, lambda m, call: 5000.0 + 0.5 * m)
    kernels.finish_policy(fake.model, fake.layer.policy)
    policy = fake.layer.policy
    assert policy.lowbit_max_rows == UNBOUNDED_ROWS == kernels.few_row_limit(fake.model)
    assert "low-bit kernels at every step size" in policy.reason
    assert set(fake.dense_calls) == set(kernels.LOWBIT_ROWS)      # measured at every count
    assert fake.path_of(2048) == "lowbit" and fake.path_of(8192) == "lowbit"
    assert any("upto2048" in key for key in fake.keys)            # not a 64-capped entry
    # the step-time model sees the same decision: a 2,048-token prefill is not "many"
    layout = Layout(kernels.few_row_limit(fake.model), 0, 0)
    assert layout.is_unbounded
    assert StepShape.of([(2048, 0, 1)], layout).path == "mixed"
    assert describe_row_limit(policy.lowbit_max_rows) == "unbounded"


def test_dense_faster_from_one_row_runs_every_step_dense(monkeypatch) -> None:
    fake = FakePaths(monkeypatch, lambda m: 10.0 + m, lambda m, call: 1.0 + 0.1 * m)
    kernels.finish_policy(fake.model, fake.layer.policy)
    assert fake.layer.policy.lowbit_max_rows == 0
    assert ("many-row path (dense path, dequantized per call) at every step size"
            in fake.layer.policy.reason)
    assert fake.path_of(1) == "dense"


def test_one_lucky_dense_sample_does_not_cut_the_bound(monkeypatch) -> None:
    """The dense path is slower at every count, but one of its timed calls at 64 rows
    comes out 100x fast (a lucky sample: the best of the repeats keeps it). The next count
    does not confirm it, so the low-bit kernels keep every size."""
    def dense(m: int, call: int) -> float:
        return 0.02 * m if (m, call) == (64, 3) else 2.0 * m
    fake = FakePaths(monkeypatch, lambda m: 1.0 * m, dense)
    assert kernels.calibrate_lowbit_rows(fake.layer) == UNBOUNDED_ROWS


def test_a_dense_win_at_the_last_count_is_measured_again(monkeypatch) -> None:
    """At 2,048 rows (the last count) a dense win is confirmed by timing that count once
    more: confirmed, the bound is 1,024; a lucky first round alone does not move it."""
    always = FakePaths(monkeypatch, lambda m: 1.0 * m,
                       lambda m, call: 0.5 * m if m == 2048 else 2.0 * m)
    assert kernels.calibrate_lowbit_rows(always.layer) == 1024
    assert always.dense_calls[2048] == 2 * (1 + kernels._LOWBIT_REPS_MANY)
    lucky = FakePaths(monkeypatch, lambda m: 1.0 * m,
                      lambda m, call: 0.5 * m if (m, call) == (2048, 2) else 2.0 * m)
    assert kernels.calibrate_lowbit_rows(lucky.layer) == UNBOUNDED_ROWS


@pytest.mark.parametrize("form", ["int4", "int4k", "int6", "int8g", "int8"])
def test_many_rows_on_the_lowbit_kernels_equal_the_dense_result(form) -> None:
    """A 300-row input (several 8-row passes and weight tiles) through a QuantLinear under
    the "always low-bit" policy gives the dense path's product within the int8 rounding of
    the activations (|x - dx xq| <= dx / 2 per element, dx = max|x_g| / 127), and really
    runs the low-bit path (the policy bound is above any step)."""
    gen = torch.Generator().manual_seed(1)
    if form == "int8g":
        from duetserve.models.quant import Int8GWeight
        w = Int8GWeight(torch.randint(0, 256, (96, 512), dtype=torch.uint8, generator=gen),
                        torch.full((96, 16), 1e-3, dtype=torch.float16),
                        torch.full((96, 16), -0.128, dtype=torch.float16))
    else:
        w = kernels.probe_forms(96, 512, gen)[form]
    x = torch.randn(300, 512, generator=gen)
    lowbit = QuantLinear(w, None, KernelPolicy(lowbit_max_rows=UNBOUNDED_ROWS))
    dense = QuantLinear(w, None, KernelPolicy(lowbit_max_rows=0))
    with torch.inference_mode():
        got, want = lowbit(x).double(), dense(x).double()
    wd = w.dequantize().double()
    torch.testing.assert_close(want, x.double() @ wd.t(), atol=1e-3, rtol=1e-4)
    dx = x.double().view(300, -1, 32).abs().amax(-1) / 127
    bound = (dx.repeat_interleave(32, 1) / 2) @ wd.abs().t() + 1e-3 * (1 + want.abs())
    assert torch.all((got - want).abs() <= bound)
    ran = []
    lowbit.qweight = type("Spy", (), {"matmul": lambda self, x: ran.append(x.shape[0])
                                      or torch.zeros(x.shape[0], 96), "bits": w.bits})()
    lowbit(x)
    assert ran == [300]


def test_amx_faster_than_the_dense_path_runs_many_row_steps_on_amx(monkeypatch) -> None:
    """AMX tiles beat the dense path at the probe's rows: many-row steps run on them, and
    the low-bit crossover is measured against AMX (low-bit 1 s a row, AMX 100 s + 0.1 s a
    row: AMX wins from 128 rows, confirmed at 256, so the bound is 64)."""
    fake = FakePaths(monkeypatch, lambda m: 1.0 * m, lambda m, call: 5000.0 + 0.5 * m,
                     amx=lambda m: 100.0 + 0.1 * m)
    kernels.finish_policy(fake.model, fake.layer.policy)
    policy = fake.layer.policy
    assert policy.many_rows == "amx" and policy.lowbit_max_rows == 64
    assert "many-row steps: AMX bf16 tiles" in policy.reason
    assert "many-row path (AMX tiles) above" in policy.reason
    assert fake.path_of(64) == "lowbit" and fake.path_of(2048) == "amx"
    assert any(key.split("|")[3] == "amx_speedup" for key in fake.keys)


def test_amx_slower_than_the_dense_path_keeps_the_dense_path(monkeypatch) -> None:
    fake = FakePaths(monkeypatch, lambda m: 1.0 * m, lambda m, call: 100.0 + 0.1 * m,
                     amx=lambda m: 200.0 + 0.2 * m)
    kernels.finish_policy(fake.model, fake.layer.policy)
    policy = fake.layer.policy
    assert policy.many_rows == "dense"
    assert "AMX bf16 tiles only 0.5" in policy.reason
    assert fake.path_of(2048) == "dense"


@pytest.mark.parametrize("amx_cpu", [True, False])
def test_no_amx_switch_or_cpu_never_takes_the_amx_path(monkeypatch, amx_cpu) -> None:
    """--no-amx (EngineConfig.amx False) on an AMX CPU, or a CPU without AMX: the AMX path
    is neither timed nor taken, whatever it would cost."""
    fake = FakePaths(monkeypatch, lambda m: 1.0 * m, lambda m, call: 100.0 + 0.1 * m,
                     amx=lambda m: 1.0)
    if not amx_cpu:
        monkeypatch.setattr(kernels, "ops", lambda: FakeOps(False))
    kernels.finish_policy(fake.model, fake.layer.policy, amx=not amx_cpu)
    assert fake.layer.policy.many_rows == "dense"
    assert ("--no-amx" if amx_cpu else "no AMX (CPU flags") in fake.layer.policy.reason
    assert fake.path_of(2048) == "dense"
    assert fake.amx_calls == 0
    assert not any("amx_speedup" in key for key in fake.keys)


class FakeAttentionOps:
    """The native module as the prompt-attention choice sees it: with or without the
    AVX512-BF16 kernel, whatever this CPU has."""

    def __init__(self, bf16: bool) -> None:
        self.bf16 = bf16

    def bf16_attention_available(self) -> bool:
        return self.bf16

    def prefill_attention_bf16(self, q, k, v, scale):
        """The choice only asks whether the kernel covers the heads (one row)."""
        assert q.shape[0] == 1 and self.bf16
        return torch.zeros(1)


@pytest.mark.parametrize("native_bf16,many_rows,mode,speedup,want", [
    (True, "dense", "auto", 2.0, "native"), (True, "dense", "auto", 0.8, None),
    (True, "amx", "auto", 2.0, "native"), (True, "dense", "float32", 2.0, None),
    (True, "dense", "bfloat16", 0.8, "native"),
    (False, "amx", "auto", 3.0, "torch"), (False, "amx", "auto", 0.8, None),
    (False, "dense", "auto", 3.0, None), (False, "dense", "bfloat16", 3.0, None)])
def test_prompt_attention_in_bf16_where_the_cpu_has_it_and_it_is_faster(
        monkeypatch, native_bf16, many_rows, mode, speedup, want) -> None:
    """Prompt chunks' attention runs in bf16 dot products where the CPU has them (the
    native AVX512-BF16 kernel; else torch's bf16 flash beside AMX many-row steps) and,
    under --prefill-attention auto, they measured faster; `float32` never, `bfloat16`
    wherever a kernel exists. Sliding-window backends never change."""
    from duetserve.models.attention import TorchAttention
    measured = []
    monkeypatch.setattr(kernels, "ops", lambda: FakeAttentionOps(native_bf16))
    monkeypatch.setattr(kernels, "bf16_attention_speedup",
                        lambda h, kvh, d, kernel: measured.append(kernel) or speedup)
    full, window = TorchAttention(4, 2, 64), TorchAttention(4, 2, 64, window=32)
    model = torch.nn.Sequential(*(type("L", (torch.nn.Module,), {})() for _ in range(2)))
    model[0].backend, model[1].backend = full, window
    reason = kernels.finish_prefill_attention(model, KernelPolicy(many_rows=many_rows), mode)
    assert (full.bf16_kernel is not None) is (want == "native")
    assert full.bf16_prefill is (want == "torch")
    assert window.bf16_kernel is None and window.bf16_prefill is False
    assert ("prompt attention in bf16" if want else "prompt attention in float32") in reason
    available = "native" if native_bf16 else "torch" if many_rows == "amx" else None
    assert measured == ([available] if mode == "auto" and available else [])
    if measured:
        assert f"{speedup:.2f}x" in reason


@pytest.mark.parametrize("many_rows,dense_dtype,large", [("dense", torch.bfloat16, "bf16"),
                                                        ("dense", torch.float32, "fp32"),
                                                        ("amx", torch.float32, "bf16")])
def test_compute_by_rows_follows_the_kernel_switch(monkeypatch, many_rows, dense_dtype,
                                                   large) -> None:
    """A step's MFU is against the peak of what its linears multiply in: int8 products on
    the low-bit GEMVs up to the few-row limit (float32 without native kernels), the AMX
    tiles' bf16 or the dense GEMMs' dtype above it; a float model, its weights' dtype."""
    w = Int4Weight(*int4_groups_from_float(torch.randn(32, 64)))
    policy = KernelPolicy(lowbit_max_rows=8, many_rows=many_rows, dense_dtype=dense_dtype)
    model = torch.nn.Sequential(QuantLinear(w, None, policy))
    monkeypatch.setattr(kernels, "ops", lambda: object())
    compute = kernels.compute_by_rows(model)
    assert [compute(r) for r in (1, 8, 9, 2048)] == ["int8", "int8", large, large]
    monkeypatch.setattr(kernels, "ops", lambda: None)
    assert kernels.compute_by_rows(model)(1) == "fp32"
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        dense = torch.nn.Sequential(torch.nn.Linear(64, 32).to(dtype))
        assert {kernels.compute_by_rows(dense)(r) for r in (1, 512)} == {key}
