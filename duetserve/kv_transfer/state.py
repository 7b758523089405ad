"""Per-request transfer state (torch-free), owned by the connector on the engine thread.

    PENDING ──start()──> TRANSFERRING ──finish()──> DONE
       │                      │
       └──── expire() / fail() ┴──────────────────> FAILED

A producer's transfer is PENDING from the first token until a decode instance starts
reading (TRANSFERRING) and ends when it reports (DONE) or the deadline passes (FAILED,
blocks freed). A consumer's is TRANSFERRING while its reader thread runs.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass


class TransferStatus(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True)
class Transfer:
    transfer_id: str
    req_id: str
    deadline: float                  # time.monotonic()
    status: TransferStatus = TransferStatus.PENDING
    created: float = 0.0             # time.time()
    started: float | None = None     # time.time()
    finished: float | None = None    # time.time()
    nbytes: int = 0
    error: str | None = None
    seconds: float | None = None     # the byte copy alone (reader thread), when measured

    @property
    def is_live(self) -> bool:
        return self.status in (TransferStatus.PENDING, TransferStatus.TRANSFERRING)


class TransferTable:
    """Live transfers by id. Every method mutates only the table and the records."""

    def __init__(self) -> None:
        self.live: dict[str, Transfer] = {}

    def add(self, transfer_id: str, req_id: str, timeout_s: float) -> Transfer:
        if transfer_id in self.live:
            raise ValueError(f"transfer {transfer_id!r} already exists")
        t = Transfer(transfer_id, req_id, time.monotonic() + timeout_s, created=time.time())
        self.live[transfer_id] = t
        return t

    def start(self, transfer_id: str) -> Transfer | None:
        """PENDING -> TRANSFERRING; None when unknown or already over."""
        t = self.live.get(transfer_id)
        if t is None:
            return None
        if t.status is TransferStatus.PENDING:
            t.status, t.started = TransferStatus.TRANSFERRING, time.time()
        return t

    def finish(self, transfer_id: str, ok: bool, nbytes: int = 0,
               error: str | None = None, seconds: float | None = None) -> Transfer | None:
        """-> DONE (ok) or FAILED; removes it. None when unknown (expired already)."""
        t = self.live.pop(transfer_id, None)
        if t is None:
            return None
        t.status = TransferStatus.DONE if ok else TransferStatus.FAILED
        t.finished, t.nbytes, t.error, t.seconds = time.time(), nbytes, error, seconds
        if t.started is None:
            t.started = t.finished
        return t

    def expire(self, now: float | None = None) -> list[Transfer]:
        """Every live transfer past its deadline -> FAILED ("timed out"); removed."""
        now = time.monotonic() if now is None else now
        late = [t for t in self.live.values() if t.deadline <= now]
        for t in late:
            self.finish(t.transfer_id, False, error="timed out")
        return late

    def seconds_to_next_deadline(self) -> float | None:
        if not self.live:
            return None
        return max(0.0, min(t.deadline for t in self.live.values()) - time.monotonic())

    def __len__(self) -> int:
        return len(self.live)
