"""The KV cache of a disaggregated instance lives in a memory file (memfd) so that a
decode instance on the same host can map it (`/proc/<pid>/fd/<fd>`) and Mooncake can
register it. The file has no name on disk: it disappears with the last process mapping
it, even after kill -9, so nothing leaks. Pages are mapped on first touch (sparse), so an
idle cache costs no resident memory, like worker/kv_cache.py's calloc'd buffer."""
from __future__ import annotations

import mmap
import os

import torch


class SharedKVMemory:
    """`nbytes` of zeroed shareable memory; `tensor` is a writable uint8 view of it."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"shared KV memory needs > 0 bytes, got {nbytes}")
        self.nbytes = nbytes
        self.fd = os.memfd_create("duet-kv")
        os.ftruncate(self.fd, nbytes)
        self._mmap = mmap.mmap(self.fd, nbytes)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.base_addr = self.tensor.data_ptr()
        self.pid = os.getpid()

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The memory as a `dtype` tensor of `shape` (no copy)."""
        return self.tensor.view(dtype).view(shape)


def open_peer_memory(pid: int, fd: int, nbytes: int) -> mmap.mmap:
    """Map another process's KV memory file read-only. Raises OSError (no such process,
    not on this host, or not permitted)."""
    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
        return mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
