"""duetserve's own C++ kernels (duetserve/csrc), compiled on first use for this CPU.

Built with torch's cpp_extension (ninja + the system C++ compiler, -O3 -march=native)
into ~/.cache/duetserve/ext/<cpu>, once per machine (about 30 s); later processes load
the built library. If the build fails, or DUET_NATIVE=0, `ops()` returns None and the
callers use their plain-torch paths (same results, slower): the reason is logged once.

Kernels:
- paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale): decode
  attention reading the paged cache in place (see csrc/paged_attention.cpp).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading

log = logging.getLogger("duetserve")
_SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
_lock = threading.Lock()
_state: dict = {}


def _build():
    import torch
    from torch.utils import cpp_extension

    from duetserve.models.kernels import cpu_name

    sources = [os.path.join(_SRC, "paged_attention.cpp")]
    digest = hashlib.sha1()
    for path in sources:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(f"{cpu_name()}|{torch.__version__}".encode())
    tag = digest.hexdigest()[:12]
    build_dir = os.path.join(os.path.expanduser(os.environ.get("DUET_CACHE",
                                                               "~/.cache/duetserve")),
                             "ext", tag)
    os.makedirs(build_dir, exist_ok=True)
    return cpp_extension.load(name=f"duet_native_{tag}", sources=sources,
                              build_directory=build_dir,
                              extra_cflags=["-O3", "-march=native", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)


def ops():
    """The compiled module, or None (plain-torch fallbacks apply)."""
    with _lock:
        if "mod" not in _state:
            mod = None
            if os.environ.get("DUET_NATIVE", "1") == "0":
                log.info("native kernels off (DUET_NATIVE=0)")
            else:
                try:
                    mod = _build()
                except Exception as e:   # compiler missing, build error: fall back
                    log.warning("native kernels unavailable, using torch fallbacks: %s",
                                str(e).splitlines()[0] if str(e) else type(e).__name__)
            _state["mod"] = mod
        return _state["mod"]
