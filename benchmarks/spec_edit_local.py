"""The `edit-local` workload of benchmarks/spec_decode.py: local edits of whole files.

Why a second editing workload. Issue 13's n-gram target is about "an editing workload
(prompts that contain code the answer repeats)". The first one (`--workload edit`) asks
for edits that rewrite nearly every line of ~10-line snippets (type hints, a docstring per
function, renamed variables, a comment above each loop) with 128 tokens: most of each
answer is new text, so prompt lookup has little to copy (offline, on its own greedy
answers: 1.82 tokens per step at most even if verifying were free).

What editors and coding assistants send instead is a file of real length with one local
change, and they take the whole file back. This workload is that:

- four different files, 40-80 lines each (a rate limiter, an access-log parser, a
  downloader with retries, a batched database writer), none of them the `edit` snippets;
- one local edit each, of the usual kinds: fix one bug, rename one function and its call
  sites, add one parameter with a default, change one constant and one log message;
- "Reply with the whole modified code only", so the answer is the file again with the
  edit in place (most of it copied from the prompt);
- run with max-tokens large enough (512) that the answers are not cut mid-file: the
  1.5B's greedy answers are 400, 427, 448 and 441 tokens, each the whole file in one
  fenced block with the edit made (checked with speculation off).

The bug to fix is a wrong operator (multiply instead of divide). A first version asked for
a missing line (`self.updated = now`); Qwen2.5-Coder-1.5B returned that file unchanged under
three phrasings, which would have made the prompt a pure copy, so it was replaced before
any speedup was measured.

Designed and committed before any speedup was measured on it; the prompts are not to be
tuned after seeing speedups (docs/results.md reports both workloads).
"""
from __future__ import annotations

_RATE_LIMITER = '''import threading
import time


class TokenBucket:
    """Allows `rate` operations per second on average, with bursts up to `capacity`."""

    def __init__(self, rate, capacity):
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be positive")
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.updated = time.monotonic()
        self.lock = threading.Lock()

    def _refill(self):
        now = time.monotonic()
        elapsed = now - self.updated
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def try_acquire(self, cost=1):
        with self.lock:
            self._refill()
            if self.tokens >= cost:
                self.tokens -= cost
                return True
            return False

    def acquire(self, cost=1, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.try_acquire(cost):
                return True
            with self.lock:
                missing = cost - self.tokens
            wait = missing * self.rate
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                wait = min(wait, remaining)
            time.sleep(wait)


class RateLimitedClient:
    def __init__(self, client, rate=5.0, burst=10):
        self.client = client
        self.bucket = TokenBucket(rate, burst)

    def get(self, path, **kwargs):
        if not self.bucket.acquire(timeout=30.0):
            raise TimeoutError(f"rate limit: no token for GET {path} within 30 s")
        return self.client.get(path, **kwargs)
'''

_LOG_PARSER = '''import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime

LINE_RE = re.compile(
    r'(?P<ip>\\S+) \\S+ \\S+ \\[(?P<time>[^\\]]+)\\] '
    r'"(?P<method>[A-Z]+) (?P<path>\\S+) \\S+" (?P<status>\\d{3}) (?P<size>\\d+|-)'
)


@dataclass
class Hit:
    ip: str
    time: datetime
    method: str
    path: str
    status: int
    size: int


def parse_line(line):
    match = LINE_RE.match(line)
    if match is None:
        return None
    size = match.group("size")
    return Hit(
        ip=match.group("ip"),
        time=datetime.strptime(match.group("time"), "%d/%b/%Y:%H:%M:%S %z"),
        method=match.group("method"),
        path=match.group("path"),
        status=int(match.group("status")),
        size=0 if size == "-" else int(size),
    )


def read_hits(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            hit = parse_line(line)
            if hit is not None:
                yield hit


def top_paths(path, n=10):
    counts = Counter(hit.path for hit in read_hits(path))
    return counts.most_common(n)


def error_rate(path):
    total = errors = 0
    for hit in read_hits(path):
        total += 1
        if hit.status >= 500:
            errors += 1
    return errors / total if total else 0.0


def bytes_by_ip(lines):
    sizes = Counter()
    for line in lines:
        hit = parse_line(line)
        if hit is not None:
            sizes[hit.ip] += hit.size
    return dict(sizes)
'''

_DOWNLOADER = '''import hashlib
import logging
import os
import shutil
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)


def sha256_of(path, chunk_size=1 << 20):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(url, dest, retries=3, backoff=2.0):
    """Download `url` to `dest` atomically, retrying transient errors."""
    tmp = dest + ".part"
    for attempt in range(1, retries + 1):
        try:
            with urllib.request.urlopen(url) as response, open(tmp, "wb") as out:
                shutil.copyfileobj(response, out)
            os.replace(tmp, dest)
            return dest
        except (urllib.error.URLError, ConnectionError) as exc:
            log.warning("download of %s failed (attempt %d/%d): %s",
                        url, attempt, retries, exc)
            if attempt == retries:
                raise
            time.sleep(backoff ** attempt)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def download_all(items, folder, retries=3):
    """items: (url, filename, expected sha256 or None). Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for url, name, expected in items:
        dest = os.path.join(folder, name)
        if os.path.exists(dest) and expected and sha256_of(dest) == expected:
            log.info("%s is up to date", name)
            paths.append(dest)
            continue
        download(url, dest, retries=retries)
        if expected and sha256_of(dest) != expected:
            os.remove(dest)
            raise ValueError(f"checksum mismatch for {name}")
        paths.append(dest)
    return paths
'''

_BATCH_WRITER = '''import logging
import sqlite3
import time

log = logging.getLogger("ingest")

FLUSH_EVERY = 500
MAX_RETRIES = 3


class BatchWriter:
    """Buffers rows and inserts them into `table` in batches of FLUSH_EVERY."""

    def __init__(self, db_path, table, columns):
        self.conn = sqlite3.connect(db_path)
        self.table = table
        self.columns = list(columns)
        self.buffer = []
        self.written = 0
        placeholders = ", ".join("?" for _ in self.columns)
        self.sql = (f"INSERT INTO {table} ({', '.join(self.columns)}) "
                    f"VALUES ({placeholders})")

    def add(self, row):
        self.buffer.append(tuple(row[c] for c in self.columns))
        if len(self.buffer) >= FLUSH_EVERY:
            self.flush()

    def flush(self):
        if not self.buffer:
            return
        for attempt in range(MAX_RETRIES):
            try:
                with self.conn:
                    self.conn.executemany(self.sql, self.buffer)
                break
            except sqlite3.OperationalError as exc:
                if attempt == MAX_RETRIES - 1:
                    raise
                log.warning("insert failed, retrying: %s", exc)
                time.sleep(0.1 * (attempt + 1))
        self.written += len(self.buffer)
        log.info("flushed batch")
        self.buffer.clear()

    def close(self):
        self.flush()
        self.conn.close()
        log.info("closed writer, %d rows in total", self.written)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def ingest(db_path, rows):
    with BatchWriter(db_path, "events", ["ts", "user_id", "kind", "payload"]) as writer:
        for row in rows:
            writer.add(row)
    return writer.written
'''

_EDITS = [
    (_RATE_LIMITER, "Fix the bug in `TokenBucket.acquire`: it computes the time to wait for "
                    "the missing tokens by multiplying by the rate instead of dividing."),
    (_LOG_PARSER, "Rename the function `parse_line` to `parse_access_log_line` and update "
                  "all of its call sites."),
    (_DOWNLOADER, "Add a `timeout` parameter with a default of 30.0 seconds to `download`, "
                  "pass it to `urlopen`, and let `download_all` pass it through."),
    (_BATCH_WRITER, "Change FLUSH_EVERY to 1000, and make the log message in `flush` say how "
                    "many rows were written to which table."),
]

EDIT_LOCAL_PROMPTS = [[{"role": "user", "content": f"{edit} Reply with the whole modified "
                        f"code only.\n\n```python\n{code}```"}] for code, edit in _EDITS]
