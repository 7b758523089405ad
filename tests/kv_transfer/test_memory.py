"""SharedKVMemory's mapping: huge pages refused (the kernel's VmFlags for it say "nh")."""
from __future__ import annotations

import mmap

import pytest

from duetserve.kv_transfer.memory import SharedKVMemory


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping of this process that contains `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="no MADV_NOHUGEPAGE")
@pytest.mark.parametrize("populate", [False, True])
def test_kv_memory_refuses_huge_pages(populate: bool) -> None:
    mem = SharedKVMemory(8 << 20, populate=populate)
    flags = _vm_flags(mem.base_addr)
    assert "nh" in flags and "hg" not in flags
    assert "sh" in flags          # shared: a decode instance on this host maps the same pages
