"""Where a block's bytes live in a paged KV cache, as offsets (no torch).

The cache is one buffer [layers, 2 (k, v), kv_heads, num_blocks, block_size, head_dim]
(worker/kv_cache.py; a quantized cache, dtype "int8" or "int4", holds rows of
config.kv_row_bytes bytes instead of head_dim values: values and scales move together, as
stored). For one (layer, k|v, head) plane, block b occupies
`block_bytes` contiguous bytes at `plane_offset + b * block_bytes`; consecutive block ids
are consecutive in memory, so a run of them is one segment:

    plane (l, kv, h):  | b0 | b1 | b2 | b3 | ... | b_{num_blocks-1} |
    src ids 7 8 9 -> dst ids 2 3 4:  one segment of 3 * block_bytes per plane
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from duetserve.config import kv_row_bytes

# float caches, and compress.py's staging ("int8_raw": head_dim int8 values a row)
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8_raw": 1}
QUANTIZED = {"int8": "int8", "int4": "uint8"}      # quantized caches: their torch dtype


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    num_blocks: int
    block_size: int
    head_dim: int
    dtype: str            # "float32" | "bfloat16" | "float16" | "int8" | "int4"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES and self.dtype not in QUANTIZED:
            raise ValueError(f"KV dtype must be one of {sorted(DTYPE_SIZES | QUANTIZED)}, "
                             f"got {self.dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED

    @property
    def storage_dtype(self) -> str:
        """The torch dtype name of the cache's elements."""
        return QUANTIZED.get(self.dtype, self.dtype.replace("_raw", ""))

    @property
    def row_width(self) -> int:
        """Elements of one (token, head) row: head_dim, or a quantized row's bytes."""
        return kv_row_bytes(self.dtype, self.head_dim) if self.quantized else self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one (layer, k|v, head) plane."""
        if self.quantized:
            return self.block_size * self.row_width
        return self.block_size * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def num_planes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads

    @property
    def nbytes(self) -> int:
        return self.num_planes * self.num_blocks * self.block_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id covers across every plane (what a transfer moves per block)."""
        return self.num_planes * self.block_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        try:
            return cls(**{k: d[k] for k in ("num_layers", "num_kv_heads", "num_blocks",
                                            "block_size", "head_dim", "dtype")})
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed KV layout {d!r}: {e}") from None

    def check_compatible(self, other: "KVLayout") -> None:
        """Raises ValueError naming the first field (other than num_blocks) that differs:
        both caches must hold the same model with the same block size and dtype."""
        for name in ("num_layers", "num_kv_heads", "block_size", "head_dim", "dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise ValueError(f"KV layouts differ in {name}: {a} here, {b} at the peer "
                                 "(both instances must serve the same model, block size "
                                 "and KV cache dtype)")


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Pairs of block ids coalesced into (src_start, dst_start, count) runs where both
    sides are consecutive."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def segments(src: KVLayout, dst: KVLayout, src_ids: list[int], dst_ids: list[int]
             ) -> list[tuple[int, int, int]]:
    """(src_offset, dst_offset, nbytes) byte segments copying blocks src_ids -> dst_ids in
    every plane. Raises ValueError for incompatible layouts or out-of-range ids."""
    src.check_compatible(dst)
    for ids, layout, side in ((src_ids, src, "source"), (dst_ids, dst, "destination")):
        bad = next((b for b in ids if not 0 <= b < layout.num_blocks), None)
        if bad is not None:
            raise ValueError(f"{side} block id {bad} out of range [0, {layout.num_blocks})")
    bb = src.block_bytes
    runs = block_runs(src_ids, dst_ids)
    out = []
    for plane in range(src.num_planes):
        s_base, d_base = plane * src.num_blocks * bb, plane * dst.num_blocks * bb
        for s, d, n in runs:
            out.append((s_base + s * bb, d_base + d * bb, n * bb))
    return out
