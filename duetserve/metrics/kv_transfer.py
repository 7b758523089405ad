"""Prometheus series of prefill/decode disaggregation, on the server's registry.

    duet:kv_transfer_bytes_total{backend}      bytes of KV read by this decode instance
    duet:kv_transfer_time_seconds_total{backend}  seconds those reads took
    duet:kv_transfers_total{backend,status}    transfers ended: done | failed (a prefill
                                               instance counts backend "held": blocks it
                                               held, released or timed out)
    duet:kv_transfer_duration_seconds{backend} histogram of one transfer's seconds
    duet:ttft_split_seconds{phase}             TTFT by phase: queue and prefill (prefill
                                               instance), transfer and first_decode
                                               (decode instance)

The observers are duck-typed (a Transfer from kv_transfer/state.py, a RequestOutput), so
metrics imports nothing above layer 0.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from duetserve.kv_transfer.state import Transfer
from duetserve.outputs import RequestOutput

SECONDS_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                   10.0, 30.0, 60.0]


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, role: str,
                 lock: threading.Lock) -> None:
        self.role, self._model, self._lock = role, model_name, lock
        lbl = ["model_name", "backend"]
        self.bytes = Counter("duet:kv_transfer_bytes", "Bytes of KV transferred.", lbl,
                             registry=registry)
        self.seconds = Counter("duet:kv_transfer_time_seconds", "Seconds spent "
                               "transferring KV.", lbl, registry=registry)
        self.transfers = Counter("duet:kv_transfers", "KV transfers ended, by status.",
                                 lbl + ["status"], registry=registry)
        self.hist = Histogram("duet:kv_transfer_duration_seconds", "Seconds of one KV transfer.",
                              lbl, buckets=SECONDS_BUCKETS, registry=registry)
        self.split = Histogram("duet:ttft_split_seconds", "Time to first token by phase "
                               "(queue, prefill: prefill instance; transfer, first_decode: "
                               "decode instance).", ["model_name", "phase"],
                               buckets=SECONDS_BUCKETS, registry=registry)

    def observe_transfer(self, t: Transfer, backend: str) -> None:
        """Engine thread: one transfer ended (Transfer from kv_transfer/state.py)."""
        with self._lock:
            status = t.status.value
            self.transfers.labels(self._model, backend, status).inc()
            if backend == "held" or status != "done":
                return
            seconds = t.seconds if t.seconds is not None else \
                max(0.0, (t.finished or 0.0) - (t.started or 0.0))
            self.bytes.labels(self._model, backend).inc(t.nbytes)
            self.seconds.labels(self._model, backend).inc(seconds)
            self.hist.labels(self._model, backend).observe(seconds)

    def observe_finished(self, out: RequestOutput | None, reason: str) -> None:
        """Engine thread: a request ended (None: it ended without an output)."""
        m = None if out is None else out.metrics
        if m is None or m.first_scheduled_time is None:
            return
        with self._lock:
            phases = {}
            if self.role == "prefill" and m.first_token_time is not None:
                phases = {"queue": m.queue_time,
                          "prefill": m.first_token_time - m.first_scheduled_time}
            elif self.role == "decode" and m.first_token_time is not None:
                phases = {"transfer": m.first_scheduled_time - m.arrival_time,
                          "first_decode": m.first_token_time - m.first_scheduled_time}
            for phase, value in phases.items():
                if value is not None:
                    self.split.labels(self._model, phase).observe(max(0.0, value))
