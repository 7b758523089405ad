"""Turn one step's scheduled work into the flat varlen tensors the model consumes.

Pure function of the runner's per-request state; mutates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from duetserve.models.attention import AttentionMetadata, DecodeGroup, PrefillSeq

DECODE_GROUP_SIZE = 32
# With the in-place paged kernel, a prompt chunk of at most this many tokens is laid out
# as one decode row per token (context = its position + 1), as a verify slice is: per
# layer, SmolLM2's heads, 2 threads, the chunk's attention after 128 / 512 / 2,048 cached
# tokens took 10-151 / 37-515 / 132-1,995 us for 2-32 tokens this way against 92-228 /
# 265-805 / 1,268-4,122 us gathered and masked; fresh chunks 3-31 against 36-64 us; at 128
# tokens the two are even. And a step whose rows are all decode rows runs the native
# decode stack when it has few enough rows (models/decode_stack.py), with no per-layer
# Python: one decode beside a short chunk costs about the decode-only step plus the
# chunk's rows, where it cost ~4 ms more through the modules.
CHUNK_AS_DECODE_ROWS = 64


def chunk_rows(paged_decode: bool) -> int:
    """Prompt chunks of up to this many tokens become decode rows (0: none do)."""
    return CHUNK_AS_DECODE_ROWS if paged_decode else 0


@dataclass(slots=True)
class SeqWork:
    """One request's slice of the step."""

    req_id: str
    token_ids: list[int]       # the new tokens
    start_pos: int             # position of the first new token (= num_computed_tokens)
    block_ids: list[int]
    needs_logits: bool         # the slice reaches the end of the known tokens
    # Speculative decoding: the slice is a decode's token plus num_spec drafts. Each of its
    # k+1 positions is laid out as a decode row of its own (context = its position + 1:
    # the drafts' K/V are written before any read), all with logits. So a verify row runs
    # the very kernels a plain decode of that position runs.
    num_spec: int = 0
    lora_slot: int = -1        # the LoRA slot of the request's adapter (-1: none)


def _expand_verify(work: list[SeqWork]) -> list[SeqWork]:
    """Split each verify slice into one single-token decode per position."""
    out = []
    for w in work:
        if not w.num_spec:
            out.append(w)
            continue
        assert len(w.token_ids) == w.num_spec + 1, (w.req_id, len(w.token_ids), w.num_spec)
        out.extend(_as_rows(w, every_row_logits=True))
    return out


def _as_rows(w: SeqWork, every_row_logits: bool = False) -> list[SeqWork]:
    """A slice as one single-token row per position; logits on every row (a verify
    slice) or, for a prompt chunk, only on the last and only if the slice needs them."""
    last = len(w.token_ids) - 1
    return [SeqWork(w.req_id, [t], w.start_pos + j, w.block_ids,
                    every_row_logits or (w.needs_logits and j == last),
                    lora_slot=w.lora_slot)
            for j, t in enumerate(w.token_ids)]


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [N] rows of hidden states to compute logits for
    logits_req_ids: list[str]      # request of each logits row (k+1 rows for a verify
                                   # slice, in position order)
    order: list[str]               # request ids in flat-batch order (first row of each)
    lora_slots: list[int] | None = None  # each row's LoRA slot (-1: none); None: no row
                                         # uses an adapter


def _slots(block_ids: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def build_step_batch(work: list[SeqWork], block_size: int, device: torch.device | str = "cpu",
                     paged_decode: bool = False,
                     windows: tuple[int | None, ...] = (None,),
                     as_rows: int | None = None) -> StepBatch:
    """Decodes (one new token) first, then prefill chunks; see models/attention.py.
    `paged_decode`: the backend reads the cache in place, so decodes get one block table
    and context lengths instead of padded groups and masks, and chunks of up to
    CHUNK_AS_DECODE_ROWS tokens become decode rows (after the decodes, each chunk's rows
    contiguous and in position order). `windows`: the sliding window of each KV group
    (config.KVGroup.window; one None for a full-attention model); a SeqWork's block_ids
    interleave the groups' tables (entry i * G + g is group g's block i), and the
    metadata carries one view per group (AttentionMetadata.groups). `as_rows`: chunks of
    up to this many tokens become decode rows (None: chunk_rows(paged_decode); the runner
    passes its own, unbounded in deterministic mode)."""
    decodes, prefills = _order(work, paged_decode,
                               chunk_rows(paged_decode) if as_rows is None else as_rows)
    ordered = decodes + prefills
    ids: list[int] = []
    pos: list[int] = []
    for w in ordered:
        ids.extend(w.token_ids)
        pos.extend(range(w.start_pos, w.start_pos + len(w.token_ids)))
    num_groups = len(windows)
    views = []
    for g, window in enumerate(windows):
        def table(w: SeqWork, g=g) -> list[int]:
            return w.block_ids if num_groups == 1 else w.block_ids[g::num_groups]
        views.append(_group_meta(ordered, decodes, prefills, table, block_size, paged_decode))
        views[-1].window = window
    meta = views[0]
    if num_groups > 1:
        meta.groups = views
    logits_idx, logits_req = [], []
    offset = 0
    for w in ordered:
        offset += len(w.token_ids)
        if w.needs_logits:
            logits_idx.append(offset - 1)
            logits_req.append(w.req_id)
    lora_slots = None
    if any(w.lora_slot >= 0 for w in ordered):
        lora_slots = [w.lora_slot for w in ordered for _ in w.token_ids]
    return StepBatch(torch.tensor(ids, dtype=torch.long, device=device),
                     torch.tensor(pos, dtype=torch.long).to(device), meta,
                     torch.tensor(logits_idx, dtype=torch.long), logits_req,
                     list(dict.fromkeys(w.req_id for w in ordered)), lora_slots)


def _group_meta(ordered: list[SeqWork], decodes: list[SeqWork], prefills: list[SeqWork],
                table, block_size: int, paged_decode: bool) -> AttentionMetadata:
    """The step's attention metadata for one KV group, whose block table of a slice is
    table(slice): slots of the new tokens, decode block tables (or padded groups and
    masks without the paged kernel), prefill chunks' context slots and masks."""
    slots: list[int] = []
    for w in ordered:
        bids = table(w)
        slots.extend(bids[p // block_size] * block_size + p % block_size
                     for p in range(w.start_pos, w.start_pos + len(w.token_ids)))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long))
    meta.num_decodes = len(decodes)
    if paged_decode and decodes:
        tables = [table(w) for w in decodes]
        width = max(len(t) for t in tables)
        meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                dtype=torch.long)
        meta.decode_context_lens = torch.tensor([w.start_pos + 1 for w in decodes],
                                                dtype=torch.long)
    else:
        meta.decode_groups = _decode_groups(decodes, table, block_size)
    meta.prefills = _prefill_seqs(prefills, table, len(decodes), block_size)
    return meta


def _order(work: list[SeqWork], paged_decode: bool, as_rows: int
           ) -> tuple[list[SeqWork], list[SeqWork]]:
    """(decode rows, prefill slices) in batch order: verify slices split into rows,
    decodes sorted by context length (each group pads only to its own longest context),
    then the short chunks as rows when the decode kernel reads the cache in place."""
    work = _expand_verify(work)
    decodes = sorted((w for w in work if len(w.token_ids) == 1), key=lambda w: w.start_pos)
    prefills = [w for w in work if len(w.token_ids) > 1]
    if as_rows and paged_decode:
        decodes += [r for w in prefills if len(w.token_ids) <= as_rows for r in _as_rows(w)]
        prefills = [w for w in prefills if len(w.token_ids) > as_rows]
    return decodes, prefills


def _decode_groups(decodes: list[SeqWork], table, block_size: int) -> list[DecodeGroup]:
    """Decodes gathered in groups of DECODE_GROUP_SIZE (no in-place kernel): per group a
    block table padded to its longest context and the mask of each row's context."""
    groups = []
    for g0 in range(0, len(decodes), DECODE_GROUP_SIZE):
        group = decodes[g0:g0 + DECODE_GROUP_SIZE]
        ctx_lens = torch.tensor([w.start_pos + 1 for w in group])           # [G]
        num_blocks = (int(ctx_lens.max()) + block_size - 1) // block_size
        tab = torch.zeros(len(group), num_blocks, dtype=torch.long)
        for i, w in enumerate(group):
            bids = table(w)
            n = min(len(bids), num_blocks)
            tab[i, :n] = torch.tensor(bids[:n])
        ar = torch.arange(num_blocks * block_size)
        mask = (ar[None, :] < ctx_lens[:, None])[None, :, None, :]      # [1, G, 1, ctx]
        groups.append(DecodeGroup(g0, g0 + len(group), tab, mask))
    return groups


def _prefill_seqs(prefills: list[SeqWork], table, start: int, block_size: int
                  ) -> list[PrefillSeq]:
    """Each prefill slice's rows [start, start + n) of the flat batch; a chunk after
    cached context also gets its context's slots and its causal mask over them."""
    seqs = []
    for w in prefills:
        n = len(w.token_ids)
        if w.start_pos == 0:
            seq = PrefillSeq(start, start + n, torch.empty(0, dtype=torch.long), None)
        else:
            ctx = w.start_pos + n
            seq = PrefillSeq(start, start + n,
                             _slots(table(w), torch.arange(ctx), block_size),
                             torch.arange(ctx)[None, :] <= (w.start_pos + torch.arange(n))[:, None])
        seqs.append(seq)
        start += n
    return seqs
