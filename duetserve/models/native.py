"""duetserve's own C++ kernels (duetserve/csrc), compiled on first use for this CPU.

Built with torch's cpp_extension (ninja + the system C++ compiler, -O3 -march=native)
into $DUET_CACHE_DIR (~/.cache/duetserve)/ext/<digest>, once per machine (about 30 s);
later processes load the built library. If the build fails, or the engine was configured
without them (`set_enabled(False)`, `--no-native-kernels`), `ops()` returns None and the
callers use their plain-torch paths (same results, slower): the reason is logged once.

Kernels:
- paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale): decode
  attention reading the paged cache in place (see csrc/paged_attention.cpp).
- q4_gemv(x, packed, N), q8_gemv(x, q, scale): low-bit weight x activation products for
  decode steps (csrc/lowbit_gemv.cpp): activations quantized to int8 per group of 32,
  AVX512-VNNI integer dot products where the CPU has them, plain loops otherwise;
  q4_dequant_bf16 / q4_dequant_f32(packed, K, a, b) for the many-row path;
  amx_gemm(x, [packed...], [n...]) for many-row steps on AMX bf16 tiles where
  amx_available() (built with AMX and the tile state granted by the kernel).
- rms_norm(x, w, eps), silu_mul(gate_up): one-pass row ops for small steps.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading

from duetserve.config import cache_dir

log = logging.getLogger("duetserve")
_SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
_lock = threading.Lock()
_state: dict = {}


def set_enabled(enabled: bool) -> None:
    """Use the native kernels (the default) or not (EngineConfig.native_kernels). Process-
    wide, as the compiled module is: call it before the model is built. Mutates the
    module's state."""
    with _lock:
        if _state.get("enabled", True) != enabled:
            _state.pop("mod", None)
        _state["enabled"] = enabled


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@contextlib.contextmanager
def _build_guard(build_dir: str):
    """Held around a build of build_dir: an exclusive flock on `build.flock` there, which
    the OS releases when its holder exits, however it dies. torch's cpp_extension guards a
    build with a `lock` file instead, which a killed build leaves behind, and every later
    load then waits on it forever; under the flock no build of ours is running, so such a
    file is stale and is removed (logged). Mutates build_dir."""
    with open(os.path.join(build_dir, "build.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        lock = os.path.join(build_dir, "lock")
        if os.path.exists(lock):
            os.remove(lock)
            log.warning("removed a native-build lock left by an interrupted build: %s", lock)
        yield


def _build():
    import torch
    from torch.utils import cpp_extension

    sources = [os.path.join(_SRC, f) for f in ("bindings.cpp", "paged_attention.cpp",
                                                "prefill_attention.cpp", "lowbit_gemv.cpp",
                                                "elementwise.cpp", "decode_stack.cpp", "lora.cpp")]
    digest = hashlib.sha1()
    headers = [os.path.join(_SRC, h) for h in ("ops.h", "simd_exp.h", "simd_sum.h", "kv_rows.h")]
    for path in sources + headers:
        with open(path, "rb") as f:
            digest.update(f.read())
    # the source directory too: the build file records absolute source paths, so two
    # checkouts sharing one build folder would rebuild it in turn and wait on each other
    digest.update(f"{cpu_name()}|{torch.__version__}|{os.path.abspath(_SRC)}".encode())
    tag = digest.hexdigest()[:12]
    build_dir = os.path.join(cache_dir(), "ext", tag)
    os.makedirs(build_dir, exist_ok=True)
    with _build_guard(build_dir):
        return cpp_extension.load(name=f"duet_native_{tag}", sources=sources,
                                  build_directory=build_dir,
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)


def ops():
    """The compiled module, or None (plain-torch fallbacks apply)."""
    with _lock:
        if "mod" not in _state:
            mod = None
            if not _state.get("enabled", True):
                log.info("native kernels off (--no-native-kernels)")
            else:
                try:
                    mod = _build()
                except Exception as e:   # compiler missing, build error: fall back
                    log.warning("native kernels unavailable, using torch fallbacks: %s",
                                str(e).splitlines()[0] if str(e) else type(e).__name__)
            _state["mod"] = mod
        return _state["mod"]
