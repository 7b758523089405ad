"""The KV cache of a disaggregated instance lives in a memory file (memfd) so that a
decode instance on the same host can map it (`/proc/<pid>/fd/<fd>`) and Mooncake can
register it. The file has no name on disk: it disappears with the last process mapping
it, even after kill -9, so nothing leaks. Pages are mapped on first touch (sparse), like
worker/kv_cache.py's calloc'd buffer, unless `populate`: a decode instance populates its
cache at start, since a page touched for the first time by a transfer (a shared-memory
page fault costs ~2.5 us per 4 KiB here) made a read into fresh blocks 2-3x slower than
one into blocks used before (docs/results.md).

Huge pages are refused (MADV_NOHUGEPAGE) for the reason worker/kv_cache.py gives: one
new block writes a few KiB into every (layer, k|v, head) plane, and with huge pages each
write would fault and zero a whole 2 MiB page. memfd memory is shmem, whose huge pages
follow /sys/kernel/mm/transparent_hugepage/shmem_enabled ("never" on the benchmark host,
so there this changes nothing; "always" or "within_size" elsewhere would use them)."""
from __future__ import annotations

import ctypes
import mmap
import os

import torch

_MADV_POPULATE_WRITE = 23        # Linux >= 5.14: fault in every page, writable


class SharedKVMemory:
    """`nbytes` of zeroed shareable memory; `tensor` is a writable uint8 view of it.
    `populate`: map every page now (resident from the start) instead of on first use."""

    def __init__(self, nbytes: int, populate: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"shared KV memory needs > 0 bytes, got {nbytes}")
        self.nbytes = nbytes
        self.fd = os.memfd_create("duet-kv")
        os.ftruncate(self.fd, nbytes)
        self._mmap = mmap.mmap(self.fd, nbytes)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._mmap.madvise(mmap.MADV_NOHUGEPAGE)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.base_addr = self.tensor.data_ptr()
        self.pid = os.getpid()
        if populate:
            _populate(self.base_addr, nbytes, self.tensor)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The memory as a `dtype` tensor of `shape` (no copy)."""
        return self.tensor.view(dtype).view(shape)


def _populate(addr: int, nbytes: int, tensor: torch.Tensor) -> None:
    """Fault every page of the mapping in (madvise; writing zeros where unsupported)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(addr), nbytes, _MADV_POPULATE_WRITE) != 0:
        tensor.zero_()


def open_peer_memory(pid: int, fd: int, nbytes: int) -> mmap.mmap:
    """Map another process's KV memory file read-only. Raises OSError (no such process,
    not on this host, or not permitted)."""
    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
        return mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
