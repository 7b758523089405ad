"""The worker's resident LoRA adapters: `max_loras` slots, least recently used first out.

The scheduler admits a request only while the running requests use at most max_loras
distinct adapters (core/scheduler.py), so when a new request's adapter is not resident a
slot is free or holds an adapter no running request uses: that one is evicted (the least
recently activated). A step's rows carry their request's slot (worker/batch.py SeqWork),
and `step_batch` groups them for the model (models/lora.py LoRABatch).

Reading an adapter's files happens off the step loop: the scheduler asks `ready` for a
waiting request's adapter; when it is not resident, a loader thread reads it (at most
max_loras reads ahead at once) and the request waits while the others run; once read,
the next `ready` puts it in a slot and the request is admitted. `reads_done` is set (and
`on_read` called: the async engine's wake-up) when a read ends. `activate` still reads
synchronously when nothing was read ahead (a runner used without the scheduler's check).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

import torch

from duetserve.config import ModelConfig
from duetserve.errors import LoRAError
from duetserve.loader.huge_pages import place_tensors, release_free_memory
from duetserve.models.lora import LoRAAdapter, LoRABatch, load_adapter
from duetserve.request import LoRARequest

# (folder, ModelConfig, max rank) -> the adapter's weights; raises LoRAError
AdapterLoader = Callable[[str, ModelConfig, int], LoRAAdapter]


class LoRASlots:
    def __init__(self, model_config: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32, load: AdapterLoader | None = None,
                 huge_pages: bool = True) -> None:
        """`dtype`: the weights' (--lora-dtype); `load` reads an adapter (default:
        load_adapter in `dtype`, its weights then moved into 2 MiB pages unless
        `huge_pages` is off, as the model's are; tests hold it back: `self.load`)."""
        self.config = model_config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._slot: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self._paths: dict[int, str] = {}                   # lora_int_id -> its folder
        self.num_loads = 0                                 # adapters put in a slot
        self.load = load or partial(load_adapter_placed, dtype=dtype, huge_pages=huge_pages)
        # reads off the step loop, lora_int_id -> folder (reading) or (folder, adapter or
        # the LoRAError it raised) (read); the loader threads write them under the lock
        self._lock = threading.Lock()
        self._reading: dict[int, str] = {}
        self._read: dict[int, tuple[str, LoRAAdapter | LoRAError]] = {}
        self.reads_done = threading.Event()
        self.on_read: Callable[[], None] = lambda: None

    def check(self, lora: LoRARequest) -> None:
        """Raises LoRAError naming the problem when the adapter cannot be used (files,
        rank, targets, shapes against the model; its header only, no weights read).
        Mutates nothing: any thread may call it."""
        load_adapter(lora.lora_path, self.config, self.max_lora_rank, weights=False)

    def _resident(self, lora: LoRARequest) -> int | None:
        slot = self._slot.get(lora.lora_int_id)
        return slot if slot is not None and self._paths[lora.lora_int_id] == \
            lora.lora_path else None

    def ready(self, lora: LoRARequest, in_use: set[int]) -> bool:
        """Whether `lora` is resident now, putting it in a slot when a loader thread has
        read it (evicting the least recently used adapter not in `in_use`; the caller
        guarantees one: at most max_loras distinct adapters run). Otherwise starts
        reading it on a loader thread and returns False. A failed read counts as ready:
        `activate` raises its error. Engine thread; mutates the slots and reads."""
        if self._resident(lora) is not None:
            return True
        key, path = lora.lora_int_id, lora.lora_path
        with self._lock:
            read = self._read.get(key)
            if read is not None and read[0] == path:
                del self._read[key]
            elif self._reading.get(key) == path or \
                    len(self._reading) + len(self._read) >= self.max_loras:
                return False      # being read, or max_loras reads ahead already
            else:
                read, self._reading[key] = None, path
        if read is None:
            threading.Thread(target=self._read_ahead, args=(key, path), daemon=True,
                             name=f"duet-lora-read-{key}").start()
            return False
        if isinstance(read[1], LoRAError):
            with self._lock:
                self._read[key] = read    # activate raises it
            return True
        self._install(key, path, read[1], in_use)
        return True

    def _read_adapter(self, path: str) -> LoRAAdapter | LoRAError:
        """The adapter's weights, or the LoRAError its read raised (any error)."""
        try:
            return self.load(path, self.config, self.max_lora_rank)
        except LoRAError as e:
            return e
        except Exception as e:  # noqa: BLE001 - its requests fail, the engine goes on
            return LoRAError(f"LoRA adapter {path!r} could not be read: "
                             f"{type(e).__name__}: {e}")

    def _read_ahead(self, key: int, path: str) -> None:
        """Loader thread: read one adapter, hand it (or its LoRAError) to `ready`."""
        result = self._read_adapter(path)
        with self._lock:
            if self._reading.get(key) == path:      # not dropped meanwhile
                del self._reading[key]
                self._read[key] = (path, result)
        self.reads_done.set()
        self.on_read()

    def wait_for_read(self, timeout: float = 1.0) -> None:
        """An offline caller with nothing else to run: wait (bounded) for a read to end
        instead of stepping in a spin."""
        if self._reading:
            self.reads_done.wait(timeout)

    def drop_reads(self, keep: set[int]) -> None:
        """Forget reads (ended or not) of adapters not in `keep` (no request waits for
        them: aborted, unloaded). Mutates the reads."""
        with self._lock:
            for d in (self._reading, self._read):
                for key in [k for k in d if k not in keep]:
                    del d[key]

    def activate(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The slot of `lora`: resident (made most recently used), or put in a slot now
        from its read (`ready`), or read now. Raises the LoRAError of a failed read.
        Mutates the slots."""
        slot = self._resident(lora)
        if slot is not None:
            self._slot.move_to_end(lora.lora_int_id)
            return slot
        with self._lock:
            read = self._read.pop(lora.lora_int_id, None)
        if read is None or read[0] != lora.lora_path:
            read = (lora.lora_path, self._read_adapter(lora.lora_path))
        if isinstance(read[1], LoRAError):
            raise read[1]
        return self._install(lora.lora_int_id, lora.lora_path, read[1], in_use)

    def _install(self, key: int, path: str, adapter: LoRAAdapter, in_use: set[int]) -> int:
        if key in self._slot:              # the same id, another folder: replace it
            self.evict(key)
        slot = self._free_slot(in_use)
        self.adapters[slot] = adapter
        self._slot[key] = slot
        self._paths[key] = path
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
        when it was not resident. Mutates the slots (not the reads: drop_reads)."""
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


def load_adapter_placed(path: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                        huge_pages: bool) -> LoRAAdapter:
    """load_adapter, the weights then in one 2 MiB-page mapping (a step streams every
    adapter of its rows: in 4 KiB pages each page is a TLB miss and a prefetcher restart,
    loader/huge_pages.py), the freed heap handed back (else an unloaded adapter leaves
    ~30 MiB resident on SmolLM2: benchmarks/lora_churn.py)."""
    adapter = load_adapter(path, cfg, max_rank, dtype=dtype)
    place_tensors([t for layer in adapter.layers for w in layer.values() for t in w
                   if t is not None], huge_pages)
    release_free_memory()       # the reading's temporaries, back to the system
    return adapter
