"""The engine's part in prefill/decode disaggregation: turns a request's
`kv_transfer_params` into scheduler state and connector calls, on the engine thread.

    prefill instance (producer)               decode instance (consumer)
    add: kv_hold, max_tokens = 1              add: first token appended, its text and
    first token, finish "length": held            logprobs seeded in the output,
      -> connector.hold() publishes the           num_external_tokens = prompt length
         block ids (no text flush: the          schedule: blocks allocated -> start_load
         decode instance continues it)          poll: load done -> runs from the first
    poll: released / timed out -> free_held         token; failed -> error output

The server hands each request's params over with `expect(req_id, params)` before adding
it (a thread-safe dict), so the engine's add_request signature does not change.
"""
from __future__ import annotations

import logging
import socket

import torch

from duetserve.errors import RequestError
from duetserve.kv_transfer.config import KVTransferConfig
from duetserve.kv_transfer.connector import KVConnector, LoadResult
from duetserve.kv_transfer.layout import KVLayout
from duetserve.kv_transfer.memory import SharedKVMemory
from duetserve.kv_transfer.params import PARAM, KVRequestParams
from duetserve.request import Request
from duetserve.worker.kv_cache import kv_dtype_name

log = logging.getLogger("duetserve.kv_transfer")


def make_shared_kv(config: KVTransferConfig, num_layers: int, num_kv_heads: int,
                   num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype
                   ) -> tuple[KVLayout, SharedKVMemory]:
    layout = KVLayout(num_layers, num_kv_heads, num_blocks, block_size, head_dim,
                      kv_dtype_name(dtype))
    # a decode instance's cache is written by transfers: populated at start (memory.py)
    return layout, SharedKVMemory(layout.nbytes, populate=config.role == "decode")


class KVRoles:
    """Owned by EngineCore when its role is prefill or decode."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, memory: SharedKVMemory,
                 scheduler, max_model_len: int) -> None:
        self.config = config
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.connector = KVConnector(config, layout, memory, socket.gethostname())
        self._expected: dict[str, KVRequestParams] = {}
        self._consumers: dict[str, KVRequestParams] = {}  # loading: req_id -> params
        self._start_failures: list[str] = []

    # -- admission -----------------------------------------------------------------------
    def expect(self, req_id: str, params: KVRequestParams | None) -> None:
        """Any thread, before add_request(req_id): the request's transfer params."""
        if params is not None:
            self._expected[req_id] = params

    def check(self, req_id: str, num_prompt_tokens: int, n: int,
              max_tokens: int | None) -> KVRequestParams | None:
        """The params expected for req_id (taken), validated against the request.
        Raises RequestError(param="kv_transfer_params")."""
        params = self._expected.pop(req_id, None)
        if params is None:
            return None
        if n != 1:
            raise RequestError(f"{PARAM} needs n=1 (the router sends each sample of n>1 "
                               f"as its own request), got n={n}", "n")
        remote = params.remote_prefill
        if remote is not None:
            if remote.num_tokens != num_prompt_tokens:
                raise RequestError(f"{PARAM}: the prefill holds KV of {remote.num_tokens} "
                                   f"tokens but the prompt has {num_prompt_tokens}", PARAM)
            if max_tokens is not None and max_tokens < 2:
                raise RequestError(f"{PARAM}.remote_prefill continues after the first "
                                   "token: max_tokens must be >= 2", "max_tokens")
            try:
                remote.source.layout.check_compatible(self.connector.layout)
            except ValueError as e:
                raise RequestError(f"{PARAM}: {e}", PARAM) from None
        return params

    def prepare(self, req: Request, params: KVRequestParams) -> int | None:
        """Set a child's disaggregation fields before it is queued (see request.py).
        Returns the first token id a consumer starts from, else None."""
        if params.do_remote_decode:
            if req.max_tokens is None or req.max_tokens > 1:
                req.kv_hold, req.max_tokens = True, 1
            return None
        remote = params.remote_prefill
        self._consumers[req.req_id] = params
        req.append_output_token_ids(remote.first_token_id)
        req.num_external_tokens = remote.num_tokens
        return remote.first_token_id

    def first_logprobs(self, req_id: str):
        p = self._consumers.get(req_id)
        return None if p is None or p.remote_prefill is None else p.remote_prefill.first_logprobs

    # -- after a step ----------------------------------------------------------------------
    def producer_finished(self, req: Request, stop_matched: bool, first_logprobs) -> bool:
        """A producer child finished (engine thread). Publishes its blocks and returns
        True when a decode instance is to continue it; otherwise frees them (EOS, stop
        string, context full) and returns False."""
        if req.req_id not in self.scheduler.remote.held:
            return False
        if stop_matched or req.num_tokens >= self.max_model_len:
            self.scheduler.free_held(req.req_id)
            return False
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req.req_id)
        self.connector.hold(req.req_id, block_ids, req.num_prompt_tokens,
                            req.output_token_ids[0], first_logprobs)
        return True

    def forget(self, req_id: str) -> None:
        """An aborted request: its params are no longer needed."""
        self._consumers.pop(req_id, None)

    # -- each step -------------------------------------------------------------------------
    def poll(self) -> list[tuple[Request, str]]:
        """Free what transfers released or timed out, apply finished loads. Returns the
        consumer requests whose load failed, with the error."""
        free, loads = self.connector.poll()
        for req_id in free:
            self.scheduler.free_held(req_id)
        loads += [LoadResult(r, False, "its transfer parameters were lost")
                  for r in self._start_failures]
        self._start_failures.clear()
        failed = []
        for res in loads:
            self._consumers.pop(res.req_id, None)
            req = self.scheduler.finish_load(res.req_id, res.ok)
            if req is not None:
                failed.append((req, f"KV transfer failed: {res.error}"))
        return failed

    def start_loads(self) -> None:
        """Start a reader for each consumer the scheduler admitted this step."""
        for req_id, block_ids, num_hit in self.scheduler.remote.take_new_loads():
            params = self._consumers.get(req_id)
            if params is None:      # NOTE: cannot happen (aborts come between steps)
                log.error("no transfer parameters for %s", req_id)
                self._start_failures.append(req_id)
                continue
            kv = self.scheduler.kv_cache_manager
            # block ids interleave the KV groups' tables: a hit of n blocks is n entries
            # of each group; released sliding entries (the null block) are never copied
            self.connector.start_load(req_id, params.remote_prefill, block_ids,
                                      num_hit // self.scheduler.block_size * kv.num_groups,
                                      None if kv.null_block is None else
                                      kv.null_block.block_id)

    def has_work_now(self) -> bool:
        wait = self.connector.seconds_to_next_deadline()
        return self.connector.has_pending_results or (wait is not None and wait <= 0)

    def seconds_to_next_deadline(self) -> float | None:
        return self.connector.seconds_to_next_deadline()


__all__ = ["KVRoles", "LoadResult", "make_shared_kv"]
