"""The disk tier of the prefix cache: full KV blocks as files, keyed by their chain hash,
that survive a restart (no torch: a block's bytes are opaque, whatever the KV dtype).

    DIR/<fingerprint>/fingerprint.json       what the fingerprint stands for (readable)
    DIR/<fingerprint>/<h[:2]>/<h>.kvb        one block: header, token ids, payload

    block file:  MAGIC | header (struct HEADER) | token ids (int64) | payload
                 header = version, num tokens, payload bytes, block hash, parent hash,
                          blake2b-256 of (header fields, token ids, payload)

A fingerprint (KVStoreKey.digest) names everything that decides a block's bytes: the model
file's identity, the compute dtype, the weight quantization, the KV dtype, block size and
layout (its planes and KV groups), the kernels that wrote it. A different model or layout
never reads another's blocks: it looks in another subdirectory.

A hit is verified as BlockPool.get_cached_block verifies an in-memory one: the file's
block hash, parent hash and token ids must equal the request's, its payload the expected
length and its checksum right. Anything else (a torn file, a bad checksum, an unreadable
header) is a miss and the file is deleted: never wrong output.

Writes: the step loop enqueues (put: a bounded queue, a full queue drops the write and
counts it); one writer thread writes each block to a unique temporary name in the same
directory and renames it over the final name (os.replace, atomic). No fsync: a process
crash (kill -9) leaves either no file or a whole one; a power cut may leave a renamed file
with missing bytes, which the checksum turns into a miss.

Two servers sharing a directory: safe, by the same two rules (unique temporary names
with host and pid, atomic renames; both write identical bytes for one key). Each keeps
its own index and enforces the size cap on what it knows; a file another server evicts
is a miss here (its index entry is dropped when the read fails). Temporary files of dead
processes of this host are removed at start-up.

Eviction: least recently used beyond max_bytes, in index order; a hit moves the entry to
the back and touches the file's mtime, so the index rebuilt at start-up (files sorted by
mtime) keeps the order across restarts.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import socket
import struct
import threading
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("duetserve.kv_store")

MAGIC = b"DUETKVB1"
VERSION = 1
# version, num tokens, payload bytes, block hash, has parent, parent hash
FIELDS = struct.Struct("<IIQ16s?16s")
DIGEST = 32
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
# The writer's queue holds at most this many bytes of block copies (a full queue drops).
MAX_QUEUED_BYTES = 256 << 20


def _checksum(fields: bytes, tokens: bytes, payload) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST)
    h.update(fields)
    h.update(tokens)
    h.update(payload)
    return h.digest()


def encode_block(block_hash: bytes, parent: bytes | None, token_ids: Sequence[int],
                 payload) -> list:
    """The parts of a block file, in order (`payload`: any bytes-like object)."""
    tokens = array("q", token_ids).tobytes()
    fields = FIELDS.pack(VERSION, len(token_ids), len(memoryview(payload).cast("B")),
                         block_hash, parent is not None, parent or bytes(16))
    return [MAGIC, fields, _checksum(fields, tokens, payload), tokens, payload]


def decode_block(data: bytes, block_hash: bytes, parent: bytes | None,
                 token_ids: Sequence[int], payload_bytes: int) -> bytes | None:
    """The payload of a block file's bytes when they hold exactly this block (same hash,
    parent, tokens, payload length, right checksum); None otherwise."""
    head = len(MAGIC) + FIELDS.size
    if len(data) < head + DIGEST or data[:len(MAGIC)] != MAGIC:
        return None
    fields = data[len(MAGIC):head]
    version, n, nbytes, h, has_parent, par = FIELDS.unpack(fields)
    if version != VERSION or h != block_hash or nbytes != payload_bytes \
            or (par if has_parent else None) != parent or n != len(token_ids):
        return None
    start = head + DIGEST
    tokens, payload = data[start:start + 8 * n], data[start + 8 * n:]
    if len(payload) != nbytes or array("q", tokens).tolist() != list(token_ids):
        return None
    if _checksum(fields, tokens, payload) != data[head:start]:
        return None
    return payload


def fingerprint_digest(fields: dict) -> str:
    """16 hex digits naming a fingerprint (its fields as sorted JSON)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def file_identity(path: str) -> list:
    """The identity of a model file or folder: (real path, size, mtime in ns) of each
    file of it (a folder's files in name order). Not its contents: hashing a multi-GB
    file costs seconds at every start, and a header hash would confuse two models whose
    headers agree; rewriting the file (a new download, a re-quantization) changes its
    mtime, so a rewritten model starts with an empty store, never another's blocks."""
    real = os.path.realpath(path)
    names = [real] if not os.path.isdir(real) else sorted(
        os.path.join(real, n) for n in os.listdir(real)
        if os.path.isfile(os.path.join(real, n)))
    out = []
    for name in names:
        st = os.stat(name)
        out.append([name, st.st_size, st.st_mtime_ns])
    return out


@dataclass
class StoreStats:
    """Cumulative, except files and bytes (what is on disk now, in this store's index)."""

    files: int = 0
    bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    writes_dropped: int = 0     # the queue was full
    write_errors: int = 0
    hits: int = 0               # blocks read and verified
    hit_bytes: int = 0
    misses: int = 0             # in the index but gone or not verified
    corrupt: int = 0            # failed verification (deleted)
    evictions: int = 0


class DiskKVStore:
    """One fingerprint's directory: index, reads (any thread), a writer thread."""

    def __init__(self, root: str, fingerprint: dict, max_bytes: int,
                 payload_bytes: int) -> None:
        self.fingerprint = fingerprint_digest(fingerprint)
        self.dir = os.path.join(os.path.abspath(root), self.fingerprint)
        self.max_bytes = max_bytes
        self.payload_bytes = payload_bytes
        os.makedirs(self.dir, exist_ok=True)
        self._write_fingerprint(fingerprint)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()   # hash -> file bytes, LRU
        self._pending: set[bytes] = set()                      # queued, not written yet
        self.stats = StoreStats()
        self._tmp_tag = f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-"
        self._rebuild_index()
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer",
                                        daemon=True)
        self._writer.start()
        atexit.register(self.close)     # a normal exit finishes the queued writes

    # -- start-up ------------------------------------------------------------------------
    def _write_fingerprint(self, fingerprint: dict) -> None:
        path = os.path.join(self.dir, "fingerprint.json")
        if not os.path.exists(path):
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "w") as f:
                json.dump(fingerprint, f, indent=1, sort_keys=True, default=str)
            os.replace(tmp, path)

    def _rebuild_index(self) -> None:
        """The index from the directory: every block file, oldest mtime first; temporary
        files of dead processes of this host removed. Reads no file's contents."""
        found = []
        host = f"{TMP_PREFIX}{socket.gethostname()}-"
        for sub in os.scandir(self.dir):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if name.startswith(host) and not _alive(name[len(host):].split("-")[0]):
                    _unlink(entry.path)
                elif name.endswith(SUFFIX) and len(name) == 32 + len(SUFFIX):
                    try:
                        st = entry.stat()
                        found.append((st.st_mtime_ns, bytes.fromhex(name[:32]), st.st_size))
                    except (OSError, ValueError):
                        continue
        for _, h, size in sorted(found):
            self._index[h] = size
        self.stats.files, self.stats.bytes = len(self._index), sum(self._index.values())
        self._evict_over_cap()

    # -- lookups ---------------------------------------------------------------------------
    def path_of(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        """Whether the index holds the block (a hit still needs read() to verify it)."""
        return block_hash in self._index

    def read(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int]
             ) -> bytes | None:
        """The block's payload, verified; None (a miss) otherwise: a file that fails
        verification is deleted. A hit moves it to the back of the LRU order and touches
        its mtime. Any thread."""
        path = self.path_of(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self._drop(block_hash, corrupt=False)
            return None
        payload = decode_block(data, block_hash, parent, token_ids, self.payload_bytes)
        if payload is None:
            log.warning("KV store: %s failed verification (torn or foreign): deleted", path)
            _unlink(path)
            self._drop(block_hash, corrupt=True)
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            self.stats.hits += 1
            self.stats.hit_bytes += len(payload)
        return payload

    def _drop(self, block_hash: bytes, corrupt: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.files -= 1
                self.stats.bytes -= size
            self.stats.misses += 1
            self.stats.corrupt += int(corrupt)

    # -- writes ----------------------------------------------------------------------------
    def put(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int],
            payload) -> bool:
        """Queue a block for writing (`payload`: bytes-like, owned by the store from now
        on). False when it is already stored or queued, or dropped (queue full)."""
        nbytes = len(memoryview(payload).cast("B"))
        if nbytes != self.payload_bytes:
            raise ValueError(f"a block payload must be {self.payload_bytes} bytes, got "
                             f"{nbytes}")
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return False
            if self._queued_bytes + nbytes > MAX_QUEUED_BYTES:
                self.stats.writes_dropped += 1
                return False
            self._pending.add(block_hash)
            self._queued_bytes += nbytes
        self._queue.put((block_hash, parent, tuple(token_ids), payload))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            block_hash, parent, token_ids, payload = item
            try:
                size = self._write_file(block_hash, parent, token_ids, payload)
            except OSError as e:
                log.warning("KV store: writing a block failed: %s", e)
                size = None
            with self._lock:
                self._pending.discard(block_hash)
                self._queued_bytes -= self.payload_bytes
                if size is None:
                    self.stats.write_errors += 1
                else:
                    old = self._index.pop(block_hash, 0)
                    self._index[block_hash] = size
                    self.stats.files += 0 if old else 1
                    self.stats.bytes += size - old
                    self.stats.writes += 1
                    self.stats.write_bytes += size
                    self._evict_over_cap()
            self._queue.task_done()

    def _write_file(self, block_hash: bytes, parent: bytes | None,
                    token_ids: Sequence[int], payload) -> int:
        """Writer thread: temp file, then an atomic rename. Returns the file's bytes."""
        final = self.path_of(block_hash)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), self._tmp_tag + uuid.uuid4().hex)
        size = 0
        try:
            with open(tmp, "wb") as f:
                for part in encode_block(block_hash, parent, token_ids, payload):
                    size += f.write(part)
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        return size

    def _evict_over_cap(self) -> None:
        """Delete least-recently-used files until the index fits max_bytes. Caller holds
        the lock (or runs before the writer starts)."""
        while self.stats.bytes > self.max_bytes and self._index:
            h, size = self._index.popitem(last=False)
            _unlink(self.path_of(h))
            self.stats.files -= 1
            self.stats.bytes -= size
            self.stats.evictions += 1

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer. Idempotent."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def snapshot(self) -> StoreStats:
        with self._lock:
            return StoreStats(**vars(self.stats))


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ValueError:
        return True            # not ours to judge
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
