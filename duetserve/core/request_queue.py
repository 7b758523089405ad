"""RequestQueue: the waiting queue, ordered by (priority, position).

Policy (one policy for all requests): a smaller `priority` integer is served first (like
vLLM); within a priority, requests are served in the order they were pushed (FCFS by
arrival, since the engine adds requests as they arrive), or, given an `order` key (the
goodput-first scheduler's TTFT deadline, core/slo.py), by that key and then push order.
`push_front` (preemption) puts a request ahead of every request of its priority, so with
all priorities 0 and no key this is exactly a FCFS deque with "preempted requests go to
the front".

NOTE: removal from the middle (abort) is O(n); everything else is O(log n).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from duetserve.request import Request


# heap entries: (priority, 0 for push_front / 1 for push, key, position, request)
_Entry = tuple[int, int, float, int, Request]


class RequestQueue:
    def __init__(self, order: Callable[[Request], float] | None = None) -> None:
        """`order`: the key that orders pushed requests within a priority (smaller
        first, read once at push); None: push order."""
        self._heap: list[_Entry] = []
        self._order = order
        self._back = itertools.count(0)       # push: 0, 1, 2, ...
        self._front = itertools.count(-1, -1)  # push_front: -1, -2, ... (latest first)
        self._ids: set[str] = set()

    def push(self, request: Request) -> None:
        """Insert behind every request of the same priority with a key no larger (with
        no key: behind every one). Mutates: the queue."""
        position = next(self._back)
        key = float(position) if self._order is None else self._order(request)
        self._insert((request.priority, 1, key, position, request))

    def push_front(self, request: Request) -> None:
        """Insert ahead of every request of the same priority. Mutates: the queue."""
        position = next(self._front)
        self._insert((request.priority, 0, float(position), position, request))

    def _insert(self, entry: _Entry) -> None:
        request = entry[4]
        if request.req_id in self._ids:
            raise ValueError(f"request {request.req_id!r} is already waiting")
        self._ids.add(request.req_id)
        heapq.heappush(self._heap, entry)

    def peek(self) -> Request:
        """The next request to admit (IndexError when empty). Pure."""
        return self._heap[0][4]

    def pop(self) -> Request:
        """Remove and return the next request. Mutates: the queue."""
        request = heapq.heappop(self._heap)[4]
        self._ids.discard(request.req_id)
        return request

    def remove(self, req_id: str) -> Request | None:
        """Remove a request by id; returns it, or None if it is not waiting."""
        if req_id not in self._ids:
            return None
        for i, entry in enumerate(self._heap):
            if entry[4].req_id == req_id:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                self._ids.discard(req_id)
                return entry[4]
        raise AssertionError(f"queue index out of sync for {req_id!r}")

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._ids

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in service order (sorted copy)."""
        return (entry[4] for entry in sorted(self._heap, key=lambda e: e[:4]))
