"""The worker's resident LoRA adapters: `max_loras` slots, least recently used first out.

The scheduler admits a request only while the running requests use at most max_loras
distinct adapters (core/scheduler.py), so when a new request's adapter is not resident a
slot is free or holds an adapter no running request uses: that one is evicted (the least
recently activated). A step's rows carry their request's slot (worker/batch.py SeqWork),
and `step_batch` groups them for the model (models/lora.py LoRABatch).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from duetserve.config import ModelConfig
from duetserve.models.lora import LoRAAdapter, LoRABatch, load_adapter
from duetserve.request import LoRARequest


class LoRASlots:
    def __init__(self, model_config: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.config = model_config
        self.dtype = dtype                                  # the weights' (--lora-dtype)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._slot: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self._paths: dict[int, str] = {}                   # lora_int_id -> its folder
        self.num_loads = 0

    def check(self, lora: LoRARequest) -> None:
        """Raises LoRAError naming the problem when the adapter cannot be used (files,
        rank, targets, shapes against the model; its header only, no weights read).
        Mutates nothing: any thread may call it."""
        load_adapter(lora.lora_path, self.config, self.max_lora_rank, weights=False)

    def activate(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The slot of `lora`, loading it (evicting the least recently used adapter whose id
        is not in `in_use`) when it is not resident. Mutates the slots."""
        slot = self._slot.get(lora.lora_int_id)
        if slot is not None and self._paths[lora.lora_int_id] == lora.lora_path:
            self._slot.move_to_end(lora.lora_int_id)
            return slot
        if slot is not None:                 # the same id, another folder: reload it
            self.evict(lora.lora_int_id)
        adapter = load_adapter(lora.lora_path, self.config, self.max_lora_rank,
                               dtype=self.dtype)
        slot = self._free_slot(in_use)
        self.adapters[slot] = adapter
        self._slot[lora.lora_int_id] = slot
        self._paths[lora.lora_int_id] = lora.lora_path
        self.num_loads += 1
        return slot

    def _free_slot(self, in_use: set[int]) -> int:
        free = [i for i, a in enumerate(self.adapters) if a is None]
        if free:
            return free[0]
        victim = next((i for i in self._slot if i not in in_use), None)
        if victim is None:
            raise RuntimeError(f"all {self.max_loras} LoRA slots (max_loras) hold adapters "
                               "running requests use; the scheduler admits no more")
        return self.evict(victim)

    def evict(self, lora_int_id: int) -> int | None:
        """Drop an adapter from its slot (its weights freed). Returns the slot, or None
        when it was not resident. Mutates the slots."""
        slot = self._slot.pop(lora_int_id, None)
        self._paths.pop(lora_int_id, None)
        if slot is not None:
            self.adapters[slot] = None
        return slot

    def slot_of(self, lora_int_id: int) -> int:
        """The slot of a resident adapter; -1 for 0 (no adapter)."""
        return -1 if not lora_int_id else self._slot[lora_int_id]

    def resident(self) -> list[int]:
        """The resident adapters' ids, least recently used first."""
        return list(self._slot)

    def step_batch(self, row_slots: list[int] | None) -> LoRABatch | None:
        """The LoRABatch of a step whose row i uses slot row_slots[i] (-1: none); None
        when no row uses an adapter."""
        return None if row_slots is None else LoRABatch.from_rows(row_slots, self.adapters)
