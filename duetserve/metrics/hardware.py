"""Hardware profiles for the roofline: peak dense FLOP/s per compute dtype and memory bandwidth.

GPU figures are dense (no 2:4 sparsity) from NVIDIA's public datasheets, named per profile.
The local machine ("cpu", alias "local") is measured by `duet roofline --measure` and cached
as JSON in `$DUET_CACHE_DIR/hardware.json` (default `~/.cache/duetserve/`); until then it
falls back to CPU_FALLBACK: figures of a 2-vCPU cloud VM (an example, not this machine).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from duetserve.config import ConfigError, cache_dir

COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")

T, G = 1e12, 1e9


@dataclass(frozen=True)
class HardwareProfile:
    """One device: `peak_flops` as (compute dtype, FLOP/s) pairs, `mem_bandwidth` in bytes/s."""

    name: str
    description: str
    peak_flops: tuple[tuple[str, float], ...]
    mem_bandwidth: float
    memory_bytes: float
    default_compute: str = "bf16"   # compute dtype for quantised weights (dequantised to it)
    source: str = ""
    measured: bool = False

    def peak(self, compute_dtype: str) -> float:
        """Return the peak dense FLOP/s for `compute_dtype`; ConfigError if the device lacks it."""
        table = dict(self.peak_flops)
        if compute_dtype not in table:
            raise ConfigError(f"hardware {self.name!r} has no {compute_dtype} peak; "
                              f"it has: {', '.join(table)}")
        return table[compute_dtype]

    def ridge_point(self, compute_dtype: str | None = None) -> float:
        """Return the ridge point in FLOP/byte: peak FLOP/s / bandwidth."""
        return self.peak(compute_dtype or self.default_compute) / self.mem_bandwidth


def _gpu(name: str, description: str, bf16: float, fp8: float | None, tf32: float, fp32: float,
         bw: float, mem_gb: float, source: str) -> HardwareProfile:
    peaks = [("bf16", bf16 * T), ("fp16", bf16 * T), ("tf32", tf32 * T), ("fp32", fp32 * T)]
    if fp8 is not None:
        peaks.append(("fp8", fp8 * T))
    return HardwareProfile(name, description, tuple(peaks), bw * T, mem_gb * G, "bf16", source)


# TFLOP/s dense (the datasheets quote 2x "with sparsity"), TB/s, GB.
GPU_PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    # Source: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column).
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB HBM3", 989, 1979, 494.5, 67, 3.35, 80,
         "NVIDIA H100 Tensor Core GPU datasheet, SXM"),
    # Source: NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column, 2.0 TB/s HBM2e).
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB HBM2e", 756, 1513, 378, 51, 2.0, 80,
         "NVIDIA H100 Tensor Core GPU datasheet, PCIe"),
    # Source: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: H100 compute, 141 GB HBM3e).
    _gpu("h200", "NVIDIA H200 SXM 141GB HBM3e", 989, 1979, 494.5, 67, 4.8, 141,
         "NVIDIA H200 Tensor Core GPU datasheet, SXM"),
    # Source: NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM: 1,555 GB/s).
    _gpu("a100-40gb", "NVIDIA A100 40GB HBM2", 312, None, 156, 19.5, 1.555, 40,
         "NVIDIA A100 Tensor Core GPU datasheet, 40GB SXM"),
    # Source: NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: 2,039 GB/s).
    _gpu("a100-80gb", "NVIDIA A100 80GB HBM2e SXM", 312, None, 156, 19.5, 2.039, 80,
         "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM"),
    # Source: NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe: 1,935 GB/s).
    _gpu("a100-80gb-pcie", "NVIDIA A100 80GB HBM2e PCIe", 312, None, 156, 19.5, 1.935, 80,
         "NVIDIA A100 Tensor Core GPU datasheet, 80GB PCIe"),
    # The rounded figure commonly used for A100 roofline examples: 312 TFLOP/s / 2.0 TB/s
    # = 156 FLOP/byte. Not a datasheet SKU; kept so that reference reproduces exactly.
    _gpu("a100", "NVIDIA A100 (rounded reference: 312 TFLOP/s, 2.0 TB/s)", 312, None, 156,
         19.5, 2.0, 80, "rounded reference figures (A100 datasheet: 1.935-2.039 TB/s)"),
    # Source: NVIDIA L40S datasheet (362.05 TFLOP/s bf16 dense, 864 GB/s GDDR6, 48 GB).
    _gpu("l40s", "NVIDIA L40S 48GB GDDR6", 362.05, 733, 183, 91.6, 0.864, 48,
         "NVIDIA L40S GPU datasheet"),
)}

# This machine before `duet roofline --measure`: figures of the 2-vCPU VMs duetserve was
# developed on (GEMM and DRAM read medians at 2 threads), an example until measured. "int8"
# is int8 x int8 -> int32 products (2 ops a multiply-add, as FLOPs count them): what the
# low-bit GEMVs run on (models/kernels.compute_by_rows).
CPU_FALLBACK = HardwareProfile(
    name="cpu", description="this machine (not measured yet: example figures of a 2-vCPU "
                            "VM; run `duet roofline --measure`)",
    peak_flops=(("fp32", 310 * G), ("bf16", 886 * G), ("fp16", 2 * G), ("int8", 1874 * G)),
    mem_bandwidth=30 * G, memory_bytes=23 * G, default_compute="fp32",
    source="example 2-vCPU VMs (an AMD EPYC Zen 4: fp32 GEMM 308 GFLOP/s, DRAM read ~30 "
           "GB/s; a Zen 5: bf16 GEMM 886 GFLOP/s, int8 GEMM 1,874 G op/s)")

LOCAL_NAMES = ("cpu", "local")


def cache_path() -> Path:
    """Return the JSON file that caches the measured local profile."""
    return Path(cache_dir()) / "hardware.json"


def save_measured(fp32_flops: float, mem_bandwidth: float, details: dict | None = None,
                  peaks: dict[str, float] | None = None) -> Path:
    """Write measured local figures to `cache_path()` (`peaks`: other compute dtypes'
    measured peaks, e.g. {"bf16": ..., "int8": ...}); return the path."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"fp32_flops": fp32_flops, "mem_bandwidth": mem_bandwidth, "peaks": peaks or {},
            "details": details or {}}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def local_profile() -> HardwareProfile:
    """Return the measured local profile from the cache, or CPU_FALLBACK when not measured.

    fp32 and whatever other peaks the cache holds (bf16, int8) are measured; the rest keep
    CPU_FALLBACK's figures.
    """
    path = cache_path()
    try:
        data = json.loads(path.read_text())
        flops, bw = float(data["fp32_flops"]), float(data["mem_bandwidth"])
        measured = {str(k): float(v) for k, v in data.get("peaks", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return CPU_FALLBACK
    peaks = dict(CPU_FALLBACK.peak_flops)
    peaks.update(measured, fp32=flops)
    return HardwareProfile(
        name="cpu", description=f"this machine (measured, cached in {path})",
        peak_flops=tuple(peaks.items()), mem_bandwidth=bw,
        memory_bytes=CPU_FALLBACK.memory_bytes, default_compute="fp32",
        source=f"duet roofline --measure ({path})", measured=True)


def hardware_names() -> list[str]:
    """Return every accepted hardware name (GPU profiles, then the local aliases)."""
    return list(GPU_PROFILES) + list(LOCAL_NAMES)


def get_hardware(name: str) -> HardwareProfile:
    """Return the profile called `name` (case-insensitive); ConfigError naming the known ones."""
    key = name.strip().lower()
    if key in LOCAL_NAMES:
        return local_profile()
    if key not in GPU_PROFILES:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}")
    return GPU_PROFILES[key]
