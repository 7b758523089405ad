"""The control messages of a transfer, as they travel in the OpenAI request and response
bodies under `kv_transfer_params`. Only ids, addresses and sizes; never KV bytes.

    router -> prefill   {"do_remote_decode": true}
    prefill -> router   {"transfer_id", "source": {...}, "block_ids", "num_tokens",
                         "first_token_id", "first_logprobs"}         (RemotePrefill)
    router -> decode    {"remote_prefill": <that, plus "release_url">}
    decode -> prefill   POST release_url {"transfer_id", "ok"}   when the read is over
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from duetserve.errors import RequestError
from duetserve.kv_transfer.layout import KVLayout
from duetserve.outputs import Logprob

PARAM = "kv_transfer_params"


class PeerRegion(NamedTuple):
    """One memory file of a peer: its fd (in the peer's process), address, size."""

    fd: int
    addr: int
    nbytes: int


@dataclass(frozen=True)
class KVSource:
    """Where a prefill instance's cache can be read: its process and memory file (same
    host, shared memory), its Mooncake session (any host) and the cache's base address
    and layout."""

    hostname: str
    pid: int
    fd: int
    base_addr: int
    layout: KVLayout
    mooncake_session: str | None = None
    staging: PeerRegion | None = None     # int8 staging memory (compress.py), if any

    @property
    def cache(self) -> PeerRegion:
        return PeerRegion(self.fd, self.base_addr, self.layout.nbytes)

    def to_dict(self) -> dict:
        return {"hostname": self.hostname, "pid": self.pid, "fd": self.fd,
                "base_addr": self.base_addr, "layout": self.layout.to_dict(),
                "mooncake_session": self.mooncake_session,
                "staging": None if self.staging is None else list(self.staging)}

    @classmethod
    def from_dict(cls, d: dict) -> "KVSource":
        st = d.get("staging")
        return cls(str(d["hostname"]), int(d["pid"]), int(d["fd"]), int(d["base_addr"]),
                   KVLayout.from_dict(d["layout"]), d.get("mooncake_session"),
                   None if st is None else PeerRegion(*(int(x) for x in st)))


@dataclass(frozen=True)
class RemotePrefill:
    """A prompt whose KV sits in a prefill instance's blocks, plus the first token."""

    transfer_id: str
    source: KVSource
    block_ids: list[int]
    num_tokens: int                  # prompt tokens whose KV the blocks hold
    first_token_id: int
    first_logprobs: dict[int, Logprob] | None = None
    release_url: str | None = None
    compression: str = "none"        # "int8": read the staging area (compress.py)

    def to_dict(self) -> dict:
        lps = None if self.first_logprobs is None else [
            [t, lp.logprob, lp.rank] for t, lp in self.first_logprobs.items()]
        d = {"transfer_id": self.transfer_id, "source": self.source.to_dict(),
             "block_ids": list(self.block_ids), "num_tokens": self.num_tokens,
             "first_token_id": self.first_token_id, "first_logprobs": lps,
             "compression": self.compression}
        if self.release_url:
            d["release_url"] = self.release_url
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RemotePrefill":
        lps = d.get("first_logprobs")
        first_lps = None if lps is None else {
            int(t): Logprob(float(lp), int(rank)) for t, lp, rank in lps}
        return cls(str(d["transfer_id"]), KVSource.from_dict(d["source"]),
                   [int(b) for b in d["block_ids"]], int(d["num_tokens"]),
                   int(d["first_token_id"]), first_lps, d.get("release_url"),
                   str(d.get("compression") or "none"))


@dataclass(frozen=True)
class KVRequestParams:
    """What a request asks of the connector: to hold its KV for a remote decode
    (producer), or to load it from a remote prefill (consumer)."""

    do_remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None


def parse_request_params(raw: dict | None, role: str) -> KVRequestParams | None:
    """Validate a body's `kv_transfer_params` against this instance's role. Raises
    RequestError(param="kv_transfer_params") naming the problem."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(f"{PARAM} must be an object", PARAM)
    unknown = sorted(set(raw) - {"do_remote_decode", "remote_prefill"})
    if unknown:
        raise RequestError(f"{PARAM}: unknown field(s) {unknown}", PARAM)
    if raw.get("do_remote_decode"):
        if role != "prefill":
            raise RequestError(f"{PARAM}.do_remote_decode needs a prefill instance; this "
                               f"one runs as {role!r} (duet serve --role prefill)", PARAM)
        return KVRequestParams(do_remote_decode=True)
    if raw.get("remote_prefill") is not None:
        if role != "decode":
            raise RequestError(f"{PARAM}.remote_prefill needs a decode instance; this one "
                               f"runs as {role!r} (duet serve --role decode)", PARAM)
        try:
            remote = RemotePrefill.from_dict(raw["remote_prefill"])
        except (KeyError, TypeError, ValueError) as e:
            raise RequestError(f"{PARAM}.remote_prefill is malformed: {e}", PARAM) from None
        return KVRequestParams(remote_prefill=remote)
    return None
