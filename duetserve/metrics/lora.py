"""Prometheus series of the LoRA adapters (issue 65), on the server's registry:

    duet:lora_requests_total{lora_name}            ended requests run under each adapter
    duet:lora_prompt_tokens_total{lora_name}       their prompt tokens
    duet:lora_generation_tokens_total{lora_name}   their generated tokens
    duet:lora_resident_adapters                    adapters whose weights are in a slot now
    duet:lora_loads_total                          adapter weights read into a slot

Requests on the base model have no series here (ServerMetrics counts every request). The
adapter of an ended request is its RequestMetrics.lora_name; the slots (worker/
lora_slots.py LoRASlots) are read on the engine thread after each step.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge

from duetserve.outputs import RequestOutput, StepStats


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, slots: object,
                 lock: threading.Lock) -> None:
        """`slots`: the worker's LoRASlots (duck-typed: resident(), num_loads)."""
        self._slots, self._lock, self._model = slots, lock, model_name
        lbl = ["model_name", "lora_name"]
        self.requests = Counter("duet:lora_requests", "Ended requests run under each LoRA "
                                "adapter.", lbl, registry=registry)
        self.prompt_tokens = Counter("duet:lora_prompt_tokens", "Prompt tokens of ended "
                                     "requests, per LoRA adapter.", lbl, registry=registry)
        self.gen_tokens = Counter("duet:lora_generation_tokens", "Generated tokens of ended "
                                  "requests, per LoRA adapter.", lbl, registry=registry)
        self.resident = Gauge("duet:lora_resident_adapters", "LoRA adapters whose weights "
                              "are resident (at most --max-loras).", ["model_name"],
                              registry=registry).labels(model_name)
        self.loads = Counter("duet:lora_loads", "LoRA adapter weights read into a slot.",
                             ["model_name"], registry=registry).labels(model_name)
        self._last_loads = 0

    def observe_step(self, _: StepStats | None = None) -> None:
        """Engine thread: the slots as they are now."""
        loads = self._slots.num_loads
        with self._lock:
            self.resident.set(len(self._slots.resident()))
            if loads > self._last_loads:
                self.loads.inc(loads - self._last_loads)
            self._last_loads = loads

    def observe_finished(self, out: RequestOutput | None, reason: str) -> None:
        """An ended request (any reason): counted under its adapter, if it had one."""
        m = None if out is None else out.metrics
        if m is None or m.lora_name is None:
            return
        with self._lock:
            self.requests.labels(self._model, m.lora_name).inc()
            self.prompt_tokens.labels(self._model, m.lora_name).inc(m.num_prompt_tokens)
            self.gen_tokens.labels(self._model, m.lora_name).inc(m.num_generation_tokens)
