"""SharedKVMemory's mapping: huge pages refused (the kernel's VmFlags for it say "nh")."""
from __future__ import annotations

import mmap

import pytest
from proc_maps import vm_flags

from duetserve.kv_transfer.memory import SharedKVMemory


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="no MADV_NOHUGEPAGE")
@pytest.mark.parametrize("populate", [False, True])
def test_kv_memory_refuses_huge_pages(populate: bool) -> None:
    mem = SharedKVMemory(8 << 20, populate=populate)
    flags = vm_flags(mem.base_addr)
    assert "nh" in flags and "hg" not in flags
    assert "sh" in flags          # shared: a decode instance on this host maps the same pages
