"""Model weights in 2 MiB pages (transparent huge pages).

A decode step reads every weight once, as long sequential streams. In 4 KiB pages such a
stream crosses a page every 4 KiB: a TLB miss and page walk each time, and the hardware
prefetcher, which does not run across pages, restarts. Measured on the AMD EPYC (Zen 4),
2 threads, SmolLM2-135M's float32 layer linears (425 MB, 120 GEMVs): 15.6-15.9 ms in 4 KiB
pages, 13.0-13.9 ms in 2 MiB pages (27 -> 31-33 GB/s; `torch.sum` over 512 MiB 32.4-33.3
-> 33.9-35.1 GB/s).

Linux backs anonymous memory with huge pages where the process asks (madvise mode, the
usual default) or everywhere (always mode); torch's allocator does not ask. So after
loading, `place_weights` copies the storages of the model's weights into one anonymous
mapping aligned to 2 MiB and advised MADV_HUGEPAGE, and points every tensor that viewed
them at the copy (`Tensor.set_`, in place: modules, packed low-bit weights and views that
shared a storage keep sharing it, and the old storage is freed). The KV cache is not
placed here: it asks for small pages on purpose (worker/kv_cache.py).

`--no-huge-pages` (EngineConfig.huge_pages) leaves the weights where the loader put them
(to compare).
"""
from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MIN_STORAGE_BYTES = 1 << 20     # smaller storages stay where they are (norms, biases)
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode: always, madvise, never or unavailable."""
    try:
        with open(_THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def _weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers, and tensors inside
    duetserve's own weight objects (packed low-bit weights, dense copies), once each."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(v) -> None:
        if isinstance(v, torch.Tensor):
            found.setdefault(id(v), v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif (not isinstance(v, (nn.Module, type)) and hasattr(v, "__dict__")
              and type(v).__module__.startswith("duetserve.") and id(v) not in seen):
            seen.add(id(v))
            for x in vars(v).values():
                visit(x)

    for module in model.modules():
        for v in vars(module).values():
            visit(v)
    return list(found.values())


def release_free_memory() -> None:
    """glibc keeps freed heap pages; hand them back so RSS reflects what is kept."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# glibc's M_MMAP_THRESHOLD (mallopt): blocks of at least this many bytes are mapped on
# their own and unmapped when freed. While loading, 1 MiB: the packing's big temporaries
# then leave no holes in the heap (a later big buffer, such as a many-row step's logits,
# would fill a hole, and the hole's pages stay resident after it is freed, until the next
# trim: ~170-250 MiB after the start-up step-time probes on the 1.5B). After loading,
# 32 MiB (glibc's own ceiling for its sliding threshold, fixed): steps reuse the heap for
# everything smaller, and the rare bigger buffer is handed back when freed. A fixed
# threshold also fixes the heap's trim threshold (free() shrinks the heap top past it),
# which glibc would otherwise slide to twice the mmap threshold: set so, or every step
# would shrink and regrow the heap (page faults each step).
LOAD_MMAP_THRESHOLD = 2**20
SERVE_MMAP_THRESHOLD = 32 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def set_mmap_threshold(nbytes: int) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes) and mallopt(M_TRIM_THRESHOLD, 2 nbytes); False
    where the C library has no mallopt."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes))) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * int(nbytes)))
    except (OSError, AttributeError):
        return False


TRIM_EVERY = 32 * 2**20     # place_weights hands freed heap back after this many bytes


def place_weights(model: nn.Module, enabled: bool = True) -> str:
    """Move the model's weight storages of at least MIN_STORAGE_BYTES into one 2 MiB-page
    mapping. Mutates the tensors in place (their storage). Returns where the weights are
    and why, for the start-up log ("in 2 MiB pages (...)")."""
    return place_tensors(_weight_tensors(model), enabled, MIN_STORAGE_BYTES)


def place_tensors(tensors: list[torch.Tensor], enabled: bool = True,
                  min_bytes: int = 0) -> str:
    """Move the storages (of at least `min_bytes`) of `tensors` into one 2 MiB-page
    mapping, freed when the last tensor viewing it goes (a LoRA adapter's weights,
    worker/lora_slots.py). Mutates the tensors in place (their storage). Returns where
    they are and why."""
    mode = thp_mode()
    if not enabled:
        return "in the allocator's pages (--no-huge-pages)"
    if mode not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"in 4 KiB pages (transparent huge pages: {mode})"
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or t.dtype == torch.bool:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() < min_bytes:
            continue
        groups.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    if not groups:
        return f"in 4 KiB pages (no storage of {min_bytes} bytes or more)"
    sizes = {k: -(-s.nbytes() // 64) * 64 for k, (s, _) in groups.items()}
    total = -(-sum(sizes.values()) // HUGE_PAGE) * HUGE_PAGE
    area = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)      # holds the mapping alive
    base = (-raw.data_ptr()) % HUGE_PAGE
    area.madvise(mmap.MADV_HUGEPAGE, base, total)
    arena = raw.untyped_storage()
    cursor = base
    placed, moved = len(groups), 0
    with torch.no_grad():
        # popped one by one and dropped once moved: each old storage is freed as soon as
        # its tensors point into the arena, so the peak is the arena plus one storage
        while groups:
            key, (storage, tensors) = groups.popitem()
            n = storage.nbytes()
            src = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,))
            raw[cursor:cursor + n].copy_(src)
            for t in tensors:
                es = t.element_size()
                t.set_(arena, cursor // es + t.storage_offset(), t.size(), t.stride())
            cursor += sizes[key]
            del src, storage, tensors
            moved += n
            if moved >= TRIM_EVERY:        # freed storages sit in glibc's heap until trimmed
                release_free_memory()
                moved = 0
    return (f"in 2 MiB pages ({(cursor - base) / 2**20:.0f} MiB in "
            f"{placed} storages; transparent huge pages: {mode})")
