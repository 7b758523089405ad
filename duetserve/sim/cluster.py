"""What is being simulated: instances (colocated, or P prefill + D decode), the router,
and the links that carry KV between prefill and decode instances.

Link figures (per direction, per GPU, nominal; `duet simulate --link` or
`--link-bandwidth-gbs` to change):

  nvlink       450 GB/s   NVLink 4 (H100 SXM: 900 GB/s bidirectional)
  pcie5        64 GB/s    PCIe 5.0 x16
  ib-ndr       50 GB/s    InfiniBand NDR 400 Gb/s, one NIC per GPU
  ib-hdr       25 GB/s    InfiniBand HDR 200 Gb/s
  ethernet-100 12.5 GB/s  100 GbE
  ethernet-25  3.125 GB/s 25 GbE

A transfer of b bytes on a link takes latency + b / bandwidth; each prefill instance has
one egress link, used by one transfer at a time (FIFO).
"""
from __future__ import annotations

from dataclasses import dataclass

from duetserve.config import ConfigError

# name -> (bytes/s, latency s)
LINKS: dict[str, tuple[float, float]] = {
    "nvlink": (450e9, 5e-6),
    "pcie5": (64e9, 10e-6),
    "ib-ndr": (50e9, 10e-6),
    "ib-hdr": (25e9, 10e-6),
    "ethernet-100": (12.5e9, 50e-6),
    "ethernet-25": (3.125e9, 50e-6),
}
ROUTERS = ("round_robin", "least_loaded")


@dataclass(frozen=True)
class ClusterSpec:
    """num_instances colocated instances, or (num_prefill, num_decode) > 0 for P/D."""

    num_instances: int = 1
    num_prefill: int = 0
    num_decode: int = 0
    router: str = "round_robin"
    link: str = "nvlink"
    link_bandwidth: float | None = None     # bytes/s; overrides the link's figure
    kv_bytes_per_token: float = 0.0         # what one prompt token's KV weighs in transit

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"unknown router {self.router!r}; known: {', '.join(ROUTERS)}")
        if self.link not in LINKS:
            raise ConfigError(f"unknown link {self.link!r}; known: {', '.join(LINKS)}")
        if (self.num_prefill > 0) != (self.num_decode > 0):
            raise ConfigError("disaggregation needs at least one prefill and one decode "
                              f"instance, got {self.num_prefill}P{self.num_decode}D")
        if not self.disaggregated and self.num_instances < 1:
            raise ConfigError(f"need at least one instance, got {self.num_instances}")
        if self.link_bandwidth is not None and self.link_bandwidth <= 0:
            raise ConfigError(f"link bandwidth must be > 0, got {self.link_bandwidth}")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_gpus(self) -> int:
        return self.num_prefill + self.num_decode if self.disaggregated else self.num_instances

    @property
    def bandwidth(self) -> float:
        return self.link_bandwidth or LINKS[self.link][0]

    @property
    def latency(self) -> float:
        return LINKS[self.link][1]

    def describe(self) -> str:
        if self.disaggregated:
            return (f"{self.num_prefill}P{self.num_decode}D, {self.router}, KV over "
                    f"{self.link} ({self.bandwidth / 1e9:g} GB/s)")
        return f"{self.num_instances} colocated instance(s), {self.router}"


class Router:
    """Picks an instance for each request. Mutates its round-robin counter."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._next = 0

    def pick(self, instances: list) -> object:
        if len(instances) == 1:
            return instances[0]
        if self.policy == "least_loaded":
            return min(instances, key=lambda inst: (inst.num_outstanding, inst.index))
        inst = instances[self._next % len(instances)]
        self._next += 1
        return inst


class Link:
    """One egress link: transfers go one at a time, in order. Mutates free_at."""

    def __init__(self, bandwidth: float, latency: float) -> None:
        self.bandwidth = bandwidth
        self.latency = latency
        self.free_at = 0.0
        self.bytes_sent = 0.0
        self.busy_seconds = 0.0

    def transfer(self, now: float, num_bytes: float) -> float:
        """Start a transfer at `now` (or when the link frees up); return its arrival time."""
        start = max(now, self.free_at)
        seconds = num_bytes / self.bandwidth
        self.free_at = start + seconds
        self.bytes_sent += num_bytes
        self.busy_seconds += seconds
        return self.free_at + self.latency
