"""KV cache sizing and allocation.

One tensor for all layers: [slots, 2 (k, v), kv_heads, num_blocks, block_size, head_dim]
where a block holds `slots` layers (config.ModelConfig.kv_groups): every layer for a
full-attention model (slot i = layer i), g layers of one KV group for a hybrid one (Gemma
3: a block id belongs to one group at a time, and slot s of it holds that group's s-th
layer). Layer i uses (cache[s, 0], cache[s, 1]) for its slot s, each [kv_heads,
num_blocks, block_size, head_dim], indexed by its group's block ids.

Quantized caches (`--kv-cache-dtype int8 | int4`, storage dtype torch.int8 | torch.uint8):
the last dimension is a packed row of config.kv_row_bytes bytes (the values, then their
float16 scales; models/kv_quant.py), so every block keeps its scales beside its values and
whatever moves blocks (prefix caching, PD transfer) moves both.

NOTE: heads first (not [num_blocks, block_size, kv_heads, head_dim]) so that gathering a
sequence's blocks yields, per KV head, a contiguous [context, head_dim] matrix: attention
reads the cache with one gather and no transpose copy.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import torch

from duetserve.config import ModelConfig, kv_row_bytes

GiB = 1 << 30

# --kv-cache-dtype of a quantized cache -> its storage dtype (and back)
QUANT_KV_DTYPES = {"int8": torch.int8, "int4": torch.uint8}
_QUANT_NAMES = {v: k for k, v in QUANT_KV_DTYPES.items()}


def kv_storage_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for --kv-cache-dtype `name` (auto: the activations')."""
    if name == "auto":
        return activations
    return QUANT_KV_DTYPES.get(name) or getattr(torch, name)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype name of a cache's storage dtype ("int4" for torch.uint8)."""
    return _QUANT_NAMES.get(dtype) or str(dtype).replace("torch.", "")


def kv_row_elems(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension: head_dim, or a quantized row's bytes."""
    name = _QUANT_NAMES.get(dtype)
    return head_dim if name is None else kv_row_bytes(name, head_dim)


def _bytes_per_element(cfg: ModelConfig, dtype: torch.dtype) -> float:
    """Bytes per K or V value, scales included (exact: a row's bytes / head_dim)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return kv_row_elems(cfg.head_dim, dtype) * elem / cfg.head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes per token of full attention in a `dtype` cache (ModelConfig's
    formula), exact."""
    return int(cfg.kv_bytes_per_token(_bytes_per_element(cfg, dtype)))


def kv_block_bytes(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one KV block (ModelConfig.kv_block_bytes), exact."""
    return int(cfg.kv_block_bytes(block_size, _bytes_per_element(cfg, dtype)))


def num_blocks_for_memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int,
                          memory_gib: float) -> int:
    return max(1, int(memory_gib * GiB) // kv_block_bytes(cfg, dtype, block_size))


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = False) -> torch.Tensor:
    """Zeroed CPU tensor whose pages are mapped on first touch, in 4 KiB pages (`huge`:
    in 2 MiB pages where the kernel has them, for a cache written whole at once).

    An anonymous mapping reads as zeros and costs no resident memory until written, so
    an idle KV cache is free (torch.zeros would write every byte). Zeroed so that padded
    slots read by masked attention (the gather fallback) hold finite values.

    NOTE: huge pages are refused (MADV_NOHUGEPAGE). In the [layer, k/v, head, block]
    layout one new block writes 4 KiB into each of layers x 2 x kv_heads planes; with
    transparent huge pages (numpy madvises them for large arrays) each of those writes
    faulted, zeroed and possibly compacted a whole 2 MiB page: a decode step that opened
    a block took 40-60 ms instead of 17 (SmolLM2: 180 huge pages, 360 MiB zeroed) and
    an idle engine held hundreds of MiB it had not used. A prefaulted cache pays that once,
    at start, and then gains from them: a serving pool's blocks end up scattered, and the
    decode attention's reads of scattered blocks took a TLB miss per 2 KiB block in 4 KiB
    pages (measured: 12 streams 1.17-1.32x the in-order step in 4 KiB
    pages, 1.08-1.09x in 2 MiB ones)."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, int(np.prod(shape)) * elem)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    elif hasattr(mmap, "MADV_NOHUGEPAGE"):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor holds the mapping's buffer, so the mapping lives as long as the tensor
    return torch.frombuffer(area, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def maps_lazily(device: str | torch.device, buffer: torch.Tensor | None, prefault: bool
                ) -> bool:
    """Whether allocate_kv_cache maps the cache page by page on first touch (and so
    release_pages may hand its pages back): a CPU cache of its own, not prefaulted."""
    return buffer is None and str(device) == "cpu" and not prefault


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: str | torch.device,
                      buffer: torch.Tensor | None = None, prefault: bool = False
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v) views of one cache tensor; `buffer` (zeroed uint8 CPU memory of
    exactly the cache's bytes) is used in place when given. `prefault`: write the lazily
    mapped CPU cache once (zeros over zeros) so that every page is mapped now rather than
    on the first use of its block, in 2 MiB pages where the kernel gives them (2 GiB:
    engine start 1.8-2.9 s, 1.2-1.5 s in 4 KiB pages, on the 2-core EPYC); a given `buffer` is
    left as it is (its owner maps it)."""
    shape = (cfg.kv_layers_per_block, 2, cfg.num_key_value_heads, num_blocks, block_size,
             kv_row_elems(cfg.head_dim, dtype))
    if buffer is not None:
        cache = buffer.view(dtype).view(shape)
    elif maps_lazily(device, buffer, prefault):
        cache = _lazy_zeros(shape, dtype)
    elif str(device) == "cpu":
        cache = _lazy_zeros(shape, dtype, huge=True)
        cache.zero_()
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    slot = {i: s for g in cfg.kv_groups() for s, i in enumerate(g.layer_ids)}
    return [(cache[slot[i], 0], cache[slot[i], 1]) for i in range(cfg.num_hidden_layers)]


def release_pages(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Hand the pages of a lazily mapped CPU cache (`maps_lazily`) back to the OS: they
    read as zeros again and hold no memory until written, as at allocation. Only while no
    request's KV is in the cache (the start-up probes write blocks of it,
    engine/step_probe.py). OSError when the kernel refuses."""
    storage = caches[0][0].untyped_storage()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(storage.data_ptr(), storage.nbytes(), mmap.MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of the KV cache: {os.strerror(err)}")
