"""Live phase accounting: FLOPs, bytes, MFU and MBU of every engine step as it runs.

An engine step is described by a `StepStats` (duetserve/outputs.py: `start_time`,
`step_seconds`, `num_prefill_tokens`, `num_decode_tokens` as the scheduler decided them,
`items` = [ScheduledSlice]). The cost model turns the items into
FLOPs and bytes; the step's measured duration turns those into achieved FLOP/s and
bytes/s; the hardware profile turns those into utilisations:

    MFU = achieved FLOP/s  / peak FLOP/s of the step's compute  (model FLOPs utilisation)
    MBU = achieved bytes/s / memory bandwidth                    (model bandwidth utilisation)

The step's compute is the number type its linear layers multiply in, which the engine's
kernels choose by the step's rows (models/kernels.compute_by_rows: int8 dot products in the
low-bit GEMVs, bf16 or fp32 dense GEMMs above the few-row limit): a prefill on bf16 GEMMs
measured against the fp32 peak would read over 100%.

Bytes are counted for the weights *as executed* (`weight_bytes`: e.g. float32 tensors
dequantised from a Q4_1 GGUF), not the bytes of the file on disk. The KV cache dtype is
the engine dtype. See the cost model for what is (not) counted.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from duetserve.config import ConfigError, ModelConfig
from duetserve.metrics.cost_model import COMPUTE_DTYPE_OF, normalise_dtype, step_work
from duetserve.metrics.hardware import HardwareProfile, get_hardware, local_profile
from duetserve.outputs import PHASES, StepStats
from duetserve.outputs import step_phase as classify_phase


@dataclass(frozen=True, slots=True)
class StepAccount:
    """The accounting of one step. Rates are 0.0 when the step took no measurable time."""

    phase: str                  # "prefill" | "decode" | "mixed"
    start_time: float           # time.time() when the step began
    seconds: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_logits: int
    flops: int
    bytes: float
    flops_per_s: float
    bytes_per_s: float
    mfu: float
    mbu: float
    compute: str = ""           # the compute dtype whose peak `mfu` is against

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def ai(self) -> float:
        """Arithmetic intensity (FLOP/byte) of the step; 0.0 when no bytes moved."""
        return self.flops / self.bytes if self.bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Return the fields plus `ai` and `num_tokens` as a JSON-serialisable dict."""
        out = asdict(self)
        out["ai"] = self.ai
        out["num_tokens"] = self.num_tokens
        return out


@dataclass(slots=True)
class _PhaseTotals:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    sum_mfu: float = 0.0
    sum_mbu: float = 0.0
    peak_seconds: float = 0.0   # sum of FLOPs / the step's peak: seconds at peak

    def add(self, acc: StepAccount) -> None:
        self.steps += 1
        self.tokens += acc.num_tokens
        self.seconds += acc.seconds
        self.flops += acc.flops
        self.bytes += acc.bytes
        self.sum_mfu += acc.mfu
        self.sum_mbu += acc.mbu
        self.peak_seconds += acc.mfu * acc.seconds


class StepAccountant:
    """Accounts every step it observes; keeps running per-phase totals.

    Use as a step observer: `engine.add_step_observer(accountant.observe)`. `last` is the
    StepAccount of the latest observed step (None before the first). Thread-safe: `observe`
    may run on the engine thread while `summary()` is called from another.
    """

    def __init__(self, model_config: ModelConfig, weight_bytes: float, kv_dtype: str,
                 hardware: HardwareProfile | str | None = None,
                 compute_dtype: str | None = None,
                 compute_of: Callable[[int], str] | None = None) -> None:
        """weight_bytes: bytes of all weights as executed (engine.loaded.weight_bytes).
        kv_dtype: the engine dtype ("float32", "bfloat16", "float16", or short names).
        hardware: profile or name; default the local CPU profile (`local_profile()`).
        compute_dtype: key of the hardware peak table; default from kv_dtype (fp32 for
        float32). compute_of: a step's rows (tokens through the linear layers) -> the key
        its MFU is against (the engine's kernels, module docstring); default compute_dtype
        for every step."""
        if weight_bytes <= 0:
            raise ConfigError(f"weight_bytes must be > 0, got {weight_bytes}")
        self.model_config = model_config
        self.weight_bytes = float(weight_bytes)
        self.kv_dtype = normalise_dtype(kv_dtype)
        if hardware is None:
            hardware = local_profile()
        self.hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
        self.compute_dtype = compute_dtype or COMPUTE_DTYPE_OF.get(self.kv_dtype,
                                                              self.hardware.default_compute)
        self.peak_flops = self.hardware.peak(self.compute_dtype)
        self.compute_of = compute_of
        self._computes: set[str] = set()   # compute dtypes of the observed steps
        self.mem_bandwidth = self.hardware.mem_bandwidth
        self.last: StepAccount | None = None
        self.last_stats: StepStats | None = None   # the stats `last` was computed from
        self._totals: dict[str, _PhaseTotals] = {p: _PhaseTotals() for p in PHASES}
        self._lock = threading.Lock()

    def account(self, stats: StepStats, num_logits: int | None = None) -> StepAccount:
        """Return the StepAccount of `stats` without recording it (pure).

        num_logits: positions that needed logits; default one per scheduled item (decode items + prefill items; a prefill chunk that
        does not reach the end of the prompt needs none, so this slightly over-counts).
        """
        step = [(s.num_new_tokens, s.num_computed_before) for s in stats.items
                if s.num_new_tokens > 0]
        num_prefill, num_decode = stats.num_prefill_tokens, stats.num_decode_tokens
        if step:
            cost = step_work(self.model_config, step, num_logits=num_logits,
                             kv_dtype=self.kv_dtype, weight_bytes=self.weight_bytes)
            flops, nbytes, n_logits = cost.flops, cost.bytes, cost.num_logits
        else:
            flops, nbytes, n_logits = 0, 0.0, 0
        seconds = float(stats.step_seconds)
        fps = flops / seconds if seconds > 0 else 0.0
        bps = nbytes / seconds if seconds > 0 else 0.0
        compute = self.compute_of(sum(n for n, _ in step)) if self.compute_of and step \
            else self.compute_dtype
        return StepAccount(
            phase=classify_phase(num_prefill, num_decode),
            start_time=float(stats.start_time), seconds=seconds,
            num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            num_logits=n_logits, flops=flops, bytes=nbytes, flops_per_s=fps,
            bytes_per_s=bps, mfu=fps / self.hardware.peak(compute),
            mbu=bps / self.mem_bandwidth, compute=compute)

    def observe(self, stats: StepStats, num_logits: int | None = None) -> StepAccount:
        """Account `stats`, add it to the per-phase totals, set `last`; return the account."""
        acc = self.account(stats, num_logits)
        with self._lock:
            self._totals[acc.phase].add(acc)
            self._computes.add(acc.compute)
            self.last = acc
            self.last_stats = stats
        return acc

    __call__ = observe

    def account_for(self, stats: StepStats) -> StepAccount:
        """Return `last` if it was computed from this very `stats` object, else `account()`.

        Lets a second observer (the trace writer) reuse the figures without counting twice,
        whatever the order the observers were registered in."""
        with self._lock:
            if self.last_stats is stats and self.last is not None:
                return self.last
        return self.account(stats)

    def reset(self) -> None:
        """Forget all totals and `last`."""
        with self._lock:
            self._totals = {p: _PhaseTotals() for p in PHASES}
            self._computes = set()
            self.last = None
            self.last_stats = None

    def peaks(self) -> dict[str, float]:
        """The peak FLOP/s of each compute dtype the observed steps ran in (the default
        compute's alone before any step)."""
        with self._lock:
            computes = set(self._computes) or {self.compute_dtype}
        return {c: self.hardware.peak(c) for c in sorted(computes)}

    def summary(self) -> dict[str, Any]:
        """Return per-phase and overall totals as a JSON-serialisable dict.

        Keys: "hardware", "compute_dtype", "peak_flops" (the default compute's),
        "mem_bandwidth", "peaks" (the compute dtypes the steps ran in -> the peak FLOP/s
        their MFU is against), and one dict per phase in PHASES plus "all", each with
        steps, tokens, seconds, flops, bytes, mean_mfu / mean_mbu (plain mean over steps) and
        time_weighted_mfu / time_weighted_mbu (the seconds the steps' FLOPs take at their
        peaks, or their bytes at the bandwidth, over the steps' seconds: the utilisation of
        the wall time spent in that phase's steps).
        """
        with self._lock:
            totals = {p: _PhaseTotals(**asdict(t)) for p, t in self._totals.items()}
        overall = _PhaseTotals()
        for t in totals.values():
            for name in ("steps", "tokens", "seconds", "flops", "bytes", "sum_mfu", "sum_mbu",
                         "peak_seconds"):
                setattr(overall, name, getattr(overall, name) + getattr(t, name))
        totals["all"] = overall
        out: dict[str, Any] = {"hardware": self.hardware.name,
                               "compute_dtype": self.compute_dtype,
                               "peak_flops": self.peak_flops,
                               "mem_bandwidth": self.mem_bandwidth,
                               "peaks": self.peaks()}
        for phase, t in totals.items():
            out[phase] = {
                "steps": t.steps, "tokens": t.tokens, "seconds": t.seconds,
                "flops": t.flops, "bytes": t.bytes,
                "mean_mfu": t.sum_mfu / t.steps if t.steps else 0.0,
                "mean_mbu": t.sum_mbu / t.steps if t.steps else 0.0,
                "time_weighted_mfu": t.peak_seconds / t.seconds if t.seconds > 0 else 0.0,
                "time_weighted_mbu": (t.bytes / t.seconds / self.mem_bandwidth
                                      if t.seconds > 0 else 0.0)}
        return out

    def format_summary(self) -> str:
        """Return a small text table of `summary()` (one row per phase with steps)."""
        s = self.summary()
        lines = [f"phase accounting on {s['hardware']} ({format_peaks(s['peaks'])}, "
                 f"{s['mem_bandwidth'] / 1e9:.1f} GB/s)",
                 f"{'phase':8} {'steps':>6} {'tokens':>7} {'seconds':>8} {'MFU':>7} "
                 f"{'MBU':>7} {'MFU(t)':>7} {'MBU(t)':>7}"]
        for phase in (*PHASES, "all"):
            p = s[phase]
            if not p["steps"]:
                continue
            lines.append(f"{phase:8} {p['steps']:6d} {p['tokens']:7d} {p['seconds']:8.3f} "
                         f"{p['mean_mfu']:7.2%} {p['mean_mbu']:7.2%} "
                         f"{p['time_weighted_mfu']:7.2%} {p['time_weighted_mbu']:7.2%}")
        return "\n".join(lines)


def format_peaks(peaks: dict[str, float]) -> str:
    """"peak fp32 210, int8 1,874 GFLOP/s": the peaks MFU figures are against."""
    return "peak " + ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in peaks.items()) + " GFLOP/s"


__all__ = ["PHASES", "StepAccount", "StepAccountant", "classify_phase", "format_peaks"]
