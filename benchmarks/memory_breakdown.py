"""Where the resident memory of a served model goes, measured in one process.

    .venv/bin/python benchmarks/memory_breakdown.py --model FILE.gguf [--requests 8]

Builds the engine the way `duet serve` does (default flags: --quantization auto,
--kv-cache-memory 2 GiB, prefix caching on), then runs the same requests as
benchmarks/serve_memory.py (one at a time, 128 prompt tokens, 32 output tokens). At each
stage it reads the process's memory from /proc/self/smaps and attributes resident pages to
the tensors it knows, with mincore(2) over each tensor's bytes (only pages actually
touched count: the KV cache is allocated lazily):

- weights by form (int4 / int8 packed, with the embedding and lm_head apart), the resident
  dense copies for many-row steps, the dense parameters (norms, biases), rotary tables;
- the KV cache (its touched pages; its full size is reported too);
- the GGUF file's memory map (page-cache pages still mapped into the process);
- the rest: the Python interpreter, torch and the other libraries' code and data, the
  allocator's cached free memory and whatever transient buffers are still held; of it,
  Python's small-object arenas (`pymalloc_arenas`, with `pymalloc_live` the bytes of the
  objects alive in them: the difference is arenas pinned by a few survivors) and glibc's
  heap in use / free but held (`malloc_in_use`, `malloc_free_held`).

Run it with `DUET_CACHE_DIR` pointing at a folder without step_time.json to see a first
start, which measures the step time (engine/step_probe.py) before serving.

Prints one JSON line per stage (MiB).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")   # as the engine sets it, before torch

import torch  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2 ** 20
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def resident_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of [ptr, ptr + nbytes) whose pages are resident (mincore), page-rounded."""
    if nbytes <= 0:
        return 0
    start = ptr - ptr % PAGE
    length = ptr + nbytes - start
    npages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * npages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return -1
    return sum(v & 1 for v in vec) * PAGE


def smaps(model_path: str) -> dict[str, float]:
    """Process totals (MiB): Rss, anonymous, anonymous on huge pages, file-backed, and the
    part of the file-backed that is the model file's mapping."""
    tot = {"rss": 0, "anon": 0, "anon_huge": 0, "file": 0, "model_file": 0}
    real = os.path.realpath(model_path)
    cur_path = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and not parts[0].endswith(":"):
                cur_path = parts[5] if len(parts) > 5 else ""
                continue
            key, kb = parts[0], int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            if key == "Rss:":
                tot["rss"] += kb
                if cur_path.startswith("/"):
                    tot["file"] += kb
                    if cur_path == real:
                        tot["model_file"] += kb
            elif key == "Anonymous:":
                tot["anon"] += kb
            elif key == "AnonHugePages:":
                tot["anon_huge"] += kb
    return {k: round(v / 1024, 1) for k, v in tot.items()}


def tensor_groups(engine) -> dict[str, list[torch.Tensor]]:
    """The engine's large tensors by kind (each storage once)."""
    from duetserve.models.quant import Int8Weight, QuantEmbedding, QuantLinear, StackedWeight

    model = engine.loaded.model
    groups: dict[str, list[torch.Tensor]] = {}
    seen: set[int] = set()

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.device.type != "cpu":
            return
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        groups.setdefault(kind, []).append(t)

    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    for name, mod in model.named_modules():
        if isinstance(mod, (QuantLinear, QuantEmbedding)):
            qw = mod.qweight
            if mod is embed or (isinstance(mod, QuantLinear) and embed is not None
                                and isinstance(embed, QuantEmbedding) and qw is embed.qweight):
                kind = "embedding (tied lm_head)" if head is not None and \
                    getattr(head, "qweight", None) is qw else "embedding"
            elif mod is head:
                kind = "lm_head"
            else:
                kind = f"int{qw.bits} linears"
            # a StackedWeight (a fused q/k/v or gate/up whose parts differ in type) holds
            # its parts' packings
            for part in qw.parts if isinstance(qw, StackedWeight) else [qw]:
                add(f"packed: {kind}", part.packed)
                if isinstance(part, Int8Weight):
                    add(f"packed: {kind}", part.scale)
                    add(f"packed: {kind}", part.scale32)
            if isinstance(mod, QuantLinear):
                add("dense copies (many-row path)", mod.dense)
                add("dense params (norms, biases)", mod.bias)
    for p in list(model.parameters()) + list(model.buffers()):
        add("dense params (norms, biases)", p)
    rot = model.rotary
    add("rotary tables", rot.cos)
    add("rotary tables", rot.sin)
    k0 = engine.runner.kv_caches[0][0]
    add("kv cache", k0)
    return groups


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def malloc_stats() -> dict[str, float]:
    """glibc malloc over all arenas (MiB): bytes in use (heap + mmapped chunks) and free
    bytes it holds (part of which may be resident)."""
    try:
        fn = _libc.mallinfo2
    except AttributeError:
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"malloc_in_use": round((m.uordblks + m.hblkhd) / MiB, 1),
            "malloc_free_held": round(m.fordblks / MiB, 1)}


def pymalloc_stats() -> dict[str, float]:
    """Python's small-object allocator (MiB): its arenas (1 MiB each, returned to the OS
    only when wholly empty) and the bytes of live objects in them, parsed from
    sys._debugmallocstats (which writes to the C stderr)."""
    import re
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    arenas = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", text)
    live = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text)
    size = re.search(r"(\d[\d,]*) arenas \* (\d+) bytes/arena", text)
    if not (arenas and live and size):
        return {}
    n = int(arenas.group(1).replace(",", ""))
    return {"pymalloc_arenas": round(n * int(size.group(2)) / MiB, 1),
            "pymalloc_live": round(int(live.group(1).replace(",", "")) / MiB, 1)}


def measure(stage: str, engine, model_path: str, trim: bool = False) -> dict:
    out = {"stage": stage, **smaps(model_path), **malloc_stats(), **pymalloc_stats()}
    if engine is not None:
        accounted = 0.0
        for kind, ts in tensor_groups(engine).items():
            full = sum(t.untyped_storage().nbytes() for t in ts)
            res = sum(resident_bytes(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                      for t in ts)
            out[kind] = round(res / MiB, 1)
            if full != res:
                out[kind + " (allocated)"] = round(full / MiB, 1)
            accounted += res / MiB
        out["rest (runtime, allocator, transients)"] = round(
            out["rss"] - out["model_file"] - accounted, 1)
    if trim:
        _libc.malloc_trim(0)
        out["rss_after_malloc_trim"] = smaps(model_path)["rss"]
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=None,
                    help="GiB (default: the engine's default)")
    args = ap.parse_args()
    from duetserve import LLM, SamplingParams

    measure("python + torch imported", None, args.model)
    opts = {"num_threads": args.threads}
    if args.kv_cache_memory is not None:
        opts["kv_cache_memory"] = args.kv_cache_memory
    llm = LLM(args.model, **opts)
    measure("after load", llm.engine, args.model)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i in range(args.requests):
        llm.generate([[100 + (i * 31 + j) % 5000 for j in range(128)]], sp)
    measure(f"after {args.requests} requests", llm.engine, args.model, trim=True)
    print(json.dumps({"model": os.path.basename(args.model),
                      "file_mib": round(os.path.getsize(args.model) / MiB, 1),
                      "kv_cache_allocated_mib": round(
                          llm.engine.runner.kv_caches[0][0].untyped_storage().nbytes() / MiB, 1),
                      "describe": llm.engine.loaded.describe()}), file=sys.stdout)


if __name__ == "__main__":
    main()
