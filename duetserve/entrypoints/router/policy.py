"""Which instance gets a request.

    round_robin    the next healthy instance in turn
    least_loaded   the lowest Instance.score (in flight + queue + KV usage)
    prefix         (prefill) the instance that last served the longest prefix of this
                   prompt, unless it is much busier than the least loaded one; else least
                   loaded. The prompt text is cut into blocks of PREFIX_BLOCK_CHARS and
                   chain-hashed, so two prompts sharing a prefix share the leading hashes
                   (the router does not tokenize: characters stand in for tokens).
"""
from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict

from duetserve.entrypoints.router.pool import Instance

POLICIES = ("round_robin", "least_loaded", "prefix")
PREFIX_BLOCK_CHARS = 64
MAX_PREFIX_ENTRIES = 100_000
PREFIX_SLACK = 4.0        # a prefix holder may be this much busier than the least loaded


class NoInstanceError(RuntimeError):
    """No healthy instance of a kind."""


def _healthy(instances: list[Instance], exclude: set[str]) -> list[Instance]:
    ok = [i for i in instances if i.available and i.url not in exclude]
    if not ok:
        kind = instances[0].kind if instances else "?"
        raise NoInstanceError(f"no healthy {kind} instance (of {len(instances)}"
                              f"{', some already tried' if exclude else ''})")
    return ok


class Policy:
    def __init__(self, name: str) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self._turn = itertools.count()
        self._prefixes: OrderedDict[bytes, str] = OrderedDict()   # block hash -> url

    def pick(self, instances: list[Instance], prompt_key: str = "",
             exclude: set[str] = frozenset()) -> Instance:
        """An instance for a request (raises NoInstanceError). Mutates the turn counter
        and, for `prefix`, the prefix table (the pick is recorded for the prompt)."""
        ok = _healthy(instances, set(exclude))
        if self.name == "round_robin":
            return ok[next(self._turn) % len(ok)]
        start = next(self._turn) % len(ok)          # ties go round robin
        least = min(ok[start:] + ok[:start], key=lambda i: i.score)
        if self.name == "least_loaded":
            return least
        hashes = _block_hashes(prompt_key)
        chosen = least
        by_url = {i.url: i for i in ok}
        for h in reversed(hashes):             # the longest known prefix first
            holder = by_url.get(self._prefixes.get(h, ""))
            if holder is not None:
                if holder.score <= least.score + PREFIX_SLACK:
                    chosen = holder
                break
        for h in hashes:
            self._prefixes[h] = chosen.url
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > MAX_PREFIX_ENTRIES:
            self._prefixes.popitem(last=False)
        return chosen


def _block_hashes(text: str) -> list[bytes]:
    out, prev = [], b""
    for start in range(0, len(text) - PREFIX_BLOCK_CHARS + 1, PREFIX_BLOCK_CHARS):
        prev = hashlib.blake2b(prev + text[start:start + PREFIX_BLOCK_CHARS].encode(),
                               digest_size=16).digest()
        out.append(prev)
    return out
