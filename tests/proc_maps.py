"""This process's memory mappings as the kernel describes them (/proc/self/smaps)."""
from __future__ import annotations


def vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping of this process that contains `addr` ("hg": advised huge
    pages, "nh": huge pages refused). AssertionError when no mapping holds it."""
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
