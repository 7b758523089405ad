"""KVTransferConfig: the instance's role in prefill/decode disaggregation. Frozen."""
from __future__ import annotations

from dataclasses import dataclass

from duetserve.config import ConfigError, check_one_of

ROLES = ("both", "prefill", "decode")
BACKENDS = ("shm", "mooncake")
COMPRESSIONS = ("none", "int8")


@dataclass(frozen=True)
class KVTransferConfig:
    """`role`: both (colocated, no transfers), prefill (compute the prompt's KV and the
    first token, hold the blocks for a decode instance) or decode (receive KV, continue).
    `backend`: how a decode instance reads a prefill instance's blocks (shm: same host;
    mooncake: Mooncake Transfer Engine over TCP). A prefill instance serves both.
    `timeout_s`: a prefill instance frees held blocks this long after the first token if
    no decode instance has taken them; a decode instance fails a load that takes longer.
    `host`: the address Mooncake publishes for this instance (reachable by peers).
    `mooncake`: whether a prefill instance also registers its cache with Mooncake."""

    role: str = "both"
    backend: str = "shm"
    timeout_s: float = 30.0
    host: str = "127.0.0.1"
    mooncake: bool = True
    compression: str = "none"     # prefill: "int8" sends int8 blocks + scales (compress.py)

    def __post_init__(self) -> None:
        check_one_of("role", self.role, ROLES)
        check_one_of("kv transfer backend", self.backend, BACKENDS)
        check_one_of("kv transfer compression", self.compression, COMPRESSIONS)
        if not self.timeout_s > 0:
            raise ConfigError(f"kv_transfer_timeout must be > 0 s, got {self.timeout_s}")

    @property
    def is_disaggregated(self) -> bool:
        return self.role != "both"

    @property
    def uses_mooncake(self) -> bool:
        return (self.role == "prefill" and self.mooncake) or \
            (self.role == "decode" and self.backend == "mooncake")
