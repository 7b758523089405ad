"""Run a loaded model directly over a paged cache (no scheduler) for logit comparisons."""
from __future__ import annotations

import torch

from duetserve.worker.batch import SeqWork, build_step_batch
from duetserve.worker.kv_cache import allocate_kv_cache


class PagedModel:
    """Owns a KV cache; sequences get contiguous fresh blocks."""

    def __init__(self, loaded, num_blocks: int = 128, block_size: int = 4,
                 paged_decode: bool = False) -> None:
        self.loaded = loaded
        self.block_size = block_size
        # one block table per KV group, interleaved (worker/batch.py)
        self.windows = tuple(g.window for g in loaded.config.kv_groups())
        self.kv = allocate_kv_cache(loaded.config, num_blocks, block_size, torch.float32, "cpu")
        self.paged_decode = paged_decode
        self.next_block = 0

    def blocks(self, num_tokens: int) -> list[int]:
        n = (num_tokens + self.block_size - 1) // self.block_size * len(self.windows)
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    @torch.inference_mode()
    def step(self, work: list[SeqWork]) -> dict[str, torch.Tensor]:
        """Run one flat batch; returns the last-position logits of each request."""
        batch = build_step_batch(work, self.block_size, paged_decode=self.paged_decode,
                                 windows=self.windows)
        hidden = self.loaded.model(batch.input_ids, batch.positions, self.kv, batch.meta)
        logits = self.loaded.model.compute_logits(hidden[batch.logits_indices])
        return dict(zip(batch.logits_req_ids, logits))

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        w = SeqWork("x", token_ids, 0, self.blocks(len(token_ids)), True)
        return self.step([w])["x"]

    def greedy(self, token_ids: list[int], n: int, suppress: tuple[int, ...] = ()) -> list[int]:
        """n greedy tokens; `suppress`: ids never chosen (transformers' min_new_tokens
        masks the EOS ids the same way)."""
        blocks = self.blocks(len(token_ids) + n)
        out = []
        logits = self.step([SeqWork("g", token_ids, 0, blocks, True)])["g"]
        pos = len(token_ids)
        for _ in range(n):
            if suppress:
                logits = logits.clone()
                logits[list(suppress)] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            logits = self.step([SeqWork("g", [tok], pos, blocks, True)])["g"]
            pos += 1
        return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def paged_and_grouped_steps(cache: tuple[torch.Tensor, torch.Tensor], heads: int, hd: int,
                            bs: int, g: torch.Generator) -> tuple[list, list]:
    """One mixed step (two decode tokens, a fresh prompt chunk, a chunk after 6 cached
    tokens) through TorchAttention over copies of `cache` ([KVH, blocks, bs, row] each),
    once with the paged decode kernel's metadata and once without: (outputs, caches)."""
    from duetserve.models.attention import TorchAttention
    kvh = cache[0].shape[0]
    work = [SeqWork("a", [5], 9, [3, 7, 11], True), SeqWork("b", [6], 2, [20], True),
            SeqWork("c", [1, 2, 3], 0, [30], True),
            SeqWork("d", [4, 5, 6, 7, 8], 6, [12, 13, 14], False)]   # after 6 cached
    q = torch.randn(10, heads, hd, generator=g)
    k = torch.randn(10, kvh, hd, generator=g)
    v = torch.randn(10, kvh, hd, generator=g)
    backend = TorchAttention(heads, kvh, hd)
    outs, caches = [], []
    for paged in (True, False):
        c = (cache[0].clone(), cache[1].clone())
        meta = build_step_batch(work, bs, paged_decode=paged).meta
        assert (meta.decode_block_tables is not None) == paged
        assert len(meta.prefills) == (0 if paged else 2)
        outs.append(backend.forward(q, k, v, c, meta))
        caches.append(c)
    return outs, caches
