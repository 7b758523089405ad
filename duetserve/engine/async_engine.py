"""AsyncEngine: EngineCore stepped by one background thread, with one asyncio stream of
delta RequestOutputs per request (each holds only that step's new tokens, text and
logprobs; `OutputAccumulator` assembles the cumulative view where one is needed).

    event loop(s)                         engine thread (owns the EngineCore)
    ─────────────                         ───────────────────────────────────
    add_request() ──("add", ...)──┐       wait on `_cv` while no commands and no work
    abort()       ──("abort", id)─┼─> _commands ──> engine.add_request / abort_request
                                  │       engine.step_deltas() -> [RequestOutput]
    RequestStream <─call_soon_threadsafe──  deliver the deltas, one wake-up per loop

NOTE: only the engine thread calls EngineCore methods. The event loop only queues
commands; results and errors come back through `loop.call_soon_threadsafe`. A delta is
never mutated after the step that made it, so it crosses threads without a copy.
The thread blocks on a threading.Condition when there is nothing to do (no polling).

`AsyncEngine.build(factory)` also constructs the EngineCore on the engine thread, so the
loading (weights, kernel calibration) and every step run in one thread. That matters for
speed: torch's OpenMP runtime (libgomp) keeps one pool of worker threads per thread that
has run a parallel region, and once the process holds more pool threads than CPUs it stops
spinning between parallel regions. A model loaded on the main thread and stepped on another
thus paid a sleeping worker's wake-up at every one of a decode step's ~150 parallel
regions: SmolLM2 Q4_1 at batch 1 decoded at 11.5 ms a token instead of 4.5 (2 cores).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from duetserve.engine.engine_core import EngineCore
from duetserve.errors import RequestFailedError
from duetserve.outputs import RequestOutput, StepStats
from duetserve.request import LoRARequest
from duetserve.sampling_params import SamplingParams

log = logging.getLogger("duetserve.async_engine")

# fn(last_output_or_None, reason) on the engine thread when a request ends (finished,
# aborted or failed). `last_output` is the engine's last delta RequestOutput for it (None
# when it was aborted before producing anything); its `metrics` hold the totals.
FinishObserver = Callable[[RequestOutput | None, str], None]
# fn(stats) on the engine thread after commands changed the cache without a step (aborts).
IdleStatsObserver = Callable[[StepStats], None]


class EngineStepError(RuntimeError):
    """The engine failed while running a step that included this request."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (client gone, or the engine shut down)."""


__all__ = ["AsyncEngine", "EngineStepError", "RequestAbortedError", "RequestFailedError",
           "RequestStream"]


class RequestStream:
    """Async iterator of one request's delta RequestOutputs. Ends after the finished
    one; raises EngineStepError / RequestAbortedError / RequestFailedError."""

    def __init__(self, req_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.req_id = req_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item


@dataclass
class _Entry:
    """Engine-thread bookkeeping of one live request."""

    stream: RequestStream
    last: RequestOutput | None = None


@dataclass
class _Command:
    kind: str                       # "add" | "abort" | "fail_all" | "release_lora"
    req_id: str
    token_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    prompt: str | None = None
    stream: RequestStream | None = None
    done: asyncio.Future | None = None
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None


class AsyncEngine:
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._cv = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._entries: dict[str, _Entry] = {}     # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.finish_observers: list[FinishObserver] = []
        self.idle_stats_observers: list[IdleStatsObserver] = []
        self.num_step_errors = 0
        if engine.kv_roles is not None:     # transfers end on other threads: wake us
            engine.kv_roles.connector.wake = self._wake
        if getattr(engine, "disk_cache", None) is not None:   # disk loads, likewise
            engine.disk_cache.on_wake = self._wake
        lora = getattr(getattr(engine, "runner", None), "lora", None)
        if lora is not None:                                  # LoRA adapter reads too
            lora.on_read = self._wake

    # -- lifecycle -----------------------------------------------------------------------
    @classmethod
    def build(cls, factory: Callable[[], EngineCore]) -> AsyncEngine:
        """Start the engine thread, construct the EngineCore there with `factory()` and
        keep stepping it on that thread (see the module docstring for why). Returns once
        the engine is built and running; re-raises what `factory` raised."""
        built: list = []
        ready = threading.Event()

        def body() -> None:
            try:
                built.append(cls(factory()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                built.append(e)
                return
            finally:
                ready.set()
            built[0]._run()

        thread = threading.Thread(target=body, name="duet-engine", daemon=True)
        thread.start()
        ready.wait()
        if isinstance(built[0], BaseException):
            thread.join()
            raise built[0]
        engine: AsyncEngine = built[0]
        engine._thread = thread
        return engine

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="duet-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- event-loop side API -------------------------------------------------------------
    async def add_request(self, req_id: str, token_ids: list[int], params: SamplingParams,
                          prompt: str | None = None, arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises the
        engine's RequestError / SamplingParamsError (ValueErrors) for a bad request and
        EngineOverloadedError when its waiting queue is full. `arrival_time`
        (time.time()): when the request reached the server; latencies count from it."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(req_id, loop)
        done = loop.create_future()
        self._submit(_Command("add", req_id, list(token_ids), params, prompt, stream, done,
                              arrival_time, lora_request))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(req_id)      # the caller is gone; drop the request if it was added
            raise
        return stream

    def abort(self, req_id: str) -> None:
        """Abort at the next engine iteration (its KV blocks are freed then); a no-op
        for requests that already finished. Safe from any thread."""
        self._submit(_Command("abort", req_id))

    def fail_all(self, message: str) -> None:
        """End every live request's stream with RequestAbortedError(message) and free its
        blocks, at the next engine iteration (graceful shutdown past its timeout)."""
        self._submit(_Command("fail_all", message))

    def release_lora(self, lora_int_id: int) -> None:
        """Free a LoRA adapter's resident weights at the next engine iteration, unless a
        running request uses it (EngineCore.release_lora). Safe from any thread."""
        self._submit(_Command("release_lora", str(lora_int_id)))

    def _wake(self) -> None:
        """Any thread: make the engine thread look for work."""
        with self._cv:
            self._cv.notify()

    def _submit(self, cmd: _Command) -> None:
        if not self.is_running:
            raise RuntimeError("the engine loop is not running")
        with self._cv:
            self._commands.append(cmd)
            self._cv.notify()

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._stopping and not self._commands \
                        and not engine.has_work_now():
                    # NOTE: waits for commands, wake-ups (a KV transfer ended) or the
                    # next transfer deadline; requests loading KV are not work.
                    self._cv.wait(engine.seconds_to_next_deadline())
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            if commands:
                self._handle_commands(commands)
            if engine.has_work_now():
                self._step()
        self._fail_all(RequestAbortedError("the engine is shutting down"), drain_commands=True)

    def _handle_commands(self, commands: list[_Command]) -> None:
        aborted = False
        for cmd in commands:
            if cmd.kind == "add":
                self._handle_add(cmd)
            elif cmd.kind == "release_lora":
                self.engine.release_lora(int(cmd.req_id))
            elif cmd.kind == "fail_all":
                aborted = aborted or bool(self._entries)
                self._fail_all(RequestAbortedError(cmd.req_id))
            elif cmd.kind == "abort":
                entry = self._entries.pop(cmd.req_id, None)
                if entry is None:
                    continue            # finished already (or never added)
                self._safe_abort(cmd.req_id)
                aborted = True
                self._notify_finish(entry.last, "abort")
                self._deliver(entry.stream, RequestAbortedError(f"request {cmd.req_id} aborted"))
        if aborted:
            self._publish_idle_stats()

    def _handle_add(self, cmd: _Command) -> None:
        assert cmd.stream is not None and cmd.done is not None
        extra = {} if cmd.lora_request is None else {"lora_request": cmd.lora_request}
        if cmd.arrival_time is not None:
            extra["arrival_time"] = cmd.arrival_time
        try:
            self.engine.add_request(cmd.req_id, cmd.token_ids, cmd.params,
                                    prompt=cmd.prompt, **extra)
        except Exception as e:  # noqa: BLE001 - every error goes back to the caller
            self._resolve(cmd.stream.loop, cmd.done, e)
            return
        self._entries[cmd.req_id] = _Entry(cmd.stream)
        self._resolve(cmd.stream.loop, cmd.done, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step_deltas()
        except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
            self.num_step_errors += 1
            log.exception("engine step failed; failing %d request(s)", len(self._entries))
            self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            self._publish_idle_stats()
            return
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._entries.get(out.request_id)
            if entry is None:
                continue
            entry.last = out
            item: RequestOutput | BaseException = out
            if out.error is not None:   # this request failed alone; the step went on
                item = RequestFailedError(out.error, out.error_param)
            per_loop.setdefault(entry.stream.loop, []).append((entry.stream, item))
            if out.finished:
                del self._entries[out.request_id]
                reason = "error" if out.error is not None else next(
                    (o.finish_reason for o in out.outputs if o.finish_reason), "stop")
                self._notify_finish(out, reason)
        for loop, items in per_loop.items():   # one wake-up per loop per step
            self._call(loop, _put_many, items)
        if not self.engine.last_step.items:
            # A step that ran no tokens: it applied KV releases, transfer timeouts or
            # finished loads (a prefill instance frees its held blocks only in such
            # steps). Step observers only see steps that ran tokens, so without this the
            # KV gauges kept the last token step's count (issue 63).
            self._publish_idle_stats()

    def _fail_all(self, error: BaseException, drain_commands: bool = False) -> None:
        """Abort every live request and end its stream with `error`; on shutdown also
        fail the adds still queued (a step error leaves those to the next iteration)."""
        for req_id, entry in list(self._entries.items()):
            self._safe_abort(req_id)
            self._notify_finish(entry.last, "error")
            self._deliver(entry.stream, error)
        self._entries.clear()
        if not drain_commands:
            return
        with self._cv:
            pending, self._commands = list(self._commands), deque()
        for cmd in pending:
            if cmd.kind == "add" and cmd.done is not None and cmd.stream is not None:
                self._resolve(cmd.stream.loop, cmd.done, RequestAbortedError(str(error)))

    def _safe_abort(self, req_id: str) -> None:
        try:
            self.engine.abort_request(req_id)
        except Exception:  # noqa: BLE001
            log.exception("abort of %s failed", req_id)

    def _notify_finish(self, last: RequestOutput | None, reason: str) -> None:
        for fn in self.finish_observers:
            try:
                fn(last, reason)
            except Exception:  # noqa: BLE001
                log.exception("finish observer failed")

    def _publish_idle_stats(self) -> None:
        """Stats after aborts (no step ran, but blocks were freed) or after a step that
        ran no tokens (KV released, timed out or loaded)."""
        if not self.idle_stats_observers:
            return
        try:
            stats = self.engine.make_stats()
        except Exception:  # noqa: BLE001
            return
        for fn in self.idle_stats_observers:
            try:
                fn(stats)
            except Exception:  # noqa: BLE001
                log.exception("idle stats observer failed")

    def _deliver(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        self._call(stream.loop, _put_many, [(stream, item)])

    def _resolve(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future,
                 error: BaseException | None) -> None:
        def set_result() -> None:
            if fut.done():
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
        self._call(loop, set_result)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:    # the loop is closed: nobody is listening any more
            pass


def _put_many(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
