"""Chain hashes of full KV blocks, the keys of the prefix cache.

    block_hashes[i] = hash_block_tokens(block_hashes[i - 1], tokens[i*B : (i+1)*B])

so a block's hash names its whole prefix, not only its own B tokens. Only FULL blocks are
hashed; the partial tail block of a request has no hash until it fills up.

NOTE: the hash alone never decides a hit. BlockPool also compares the cached block's
token ids and its parent block (see BlockPool.get_cached_block), so a collision can only
cost a miss, never return the wrong KV. Callers use `hashing.hash_block_tokens` through
the module attribute so tests can replace it with a colliding function.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from duetserve.request import LoRARequest, Request

BlockHash = bytes

_ROOT = b"duetserve-root"


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """128-bit blake2b of (parent hash, token ids). Pure; deterministic across processes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_ROOT if parent_hash is None else parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def root_hash(lora: LoRARequest | None) -> BlockHash | None:
    """The parent of a request's first block: None (the base model's root) or one that
    names its LoRA adapter (id, name and folder), so KV computed under one adapter is never
    a prefix hit for another adapter or the base."""
    if lora is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update(_ROOT + b"\0lora\0")
    h.update(repr((lora.lora_int_id, lora.lora_name, lora.lora_path)).encode())
    return h.digest()


def update_block_hashes(request: Request, block_size: int) -> int:
    """Extend request.block_hashes to cover every full block of request.all_token_ids.

    Mutates: request.block_hashes (appends only; existing hashes never change because
    tokens are only ever appended). Returns the number of hashes added.
    """
    tokens = request.all_token_ids
    hashes = request.block_hashes
    num_full = len(tokens) // block_size
    start = len(hashes)
    parent = hashes[-1] if hashes else root_hash(request.lora_request)
    for i in range(start, num_full):
        # Looked up at call time through the module globals: a test may monkeypatch it.
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return num_full - start if num_full > start else 0
