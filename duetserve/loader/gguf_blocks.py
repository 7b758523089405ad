"""GGUF tensors read lazily, by rows, straight from the memory map.

`GGUFTensor` wraps one tensor's raw blocks (`[rows, bytes_per_row]` uint8, never copied
whole) and decodes a range of rows at a time, so a whole model never exists in float32:

- `dequantize(a, b)`: float32 rows, exact (through `gguf.quants`).
- `rows(ids)`: float32 rows at any ids, exact (the embedding lookup that reads the file:
  with positioned reads, not through the map, so the rows read never count in the
  process's resident memory; a mapped page would, and the kernel maps a file's cached
  pages 64 KiB around each one touched).
- `int4_groups(a, b)`: for Q4_0 / Q4_1 / Q4_K, the *exact* group-of-32 form
  `w = d * q + m` with `q` in 0..15 (d and m in float32), which models/quant.py packs.
  Other formats return None (they are not 4-bit).
- `int8_groups(a, b)`: for Q8_0 / Q5_0 / Q5_1 (and the 4-bit group formats), the exact
  form `w = d * u + m` with `u` in 0..255 and float16 d and m (models/quant.py: Int8GWeight).

Block layouts (ggml's, little-endian, `d`/`m`/`dmin` are float16):
  Q4_0  [d | 16 bytes]:           x_j = qs[j] & 15, x_{j+16} = qs[j] >> 4;  w = d * (x - 8)
  Q4_1  [d | m | 16 bytes]:       same nibbles;                            w = d * x + m
  Q4_K  [d | dmin | 12 | 128]:    8 sub-blocks of 32 with 6-bit (sc, mn) pairs;
                                  w = d * sc * x - dmin * mn; in each 32-byte run of qs the
                                  low nibbles are sub-block 2i, the high ones 2i + 1.
  Q5_0  [d | qh 4 | 16 bytes]:    x_j = (qs[j] & 15) | bit j of qh << 4, x_{j+16} =
                                  (qs[j] >> 4) | bit j + 16 of qh << 4;   w = d * (x - 16)
  Q5_1  [d | m | qh 4 | 16]:      same 5-bit values;                       w = d * x + m
  Q8_0  [d | 32 int8]:            w = d * q
"""
from __future__ import annotations

import mmap
import os

import numpy as np

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# types with an exact group-of-32 byte form (int8_groups)
INT8G_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")
GROUP = 32


class GGUFTensor:
    """One GGUF tensor, rows optionally permuted (llama.cpp's Q/K rotary order undone)."""

    def __init__(self, name: str, tensor, row_perm: np.ndarray | None = None) -> None:
        self.name = name
        self.type = tensor.tensor_type.name
        self._qtype = tensor.tensor_type
        self._data = tensor.data            # memory-mapped; [rows, bytes] or [rows, cols]
        self.row_perm = row_perm
        self._path = getattr(tensor, "path", None)      # rows() reads it with pread
        self._offset = int(tensor.data_offset)
        self._file = None                               # opened on the first rows()
        cols = int(tensor.shape[0])
        rows = int(np.prod([int(s) for s in tensor.shape[1:]])) if len(tensor.shape) > 1 else 1
        self.shape = (rows, cols) if len(tensor.shape) > 1 else (cols,)
        if self._data.ndim > 2:             # experts stacked: [experts, rows, ...] -> 2-D
            self._data = self._data.reshape(rows, -1)
        self._row0 = 0          # a part() of a stacked tensor: its first row in the file
        self._row_bytes = self._data.nbytes // rows

    def part(self, name: str, a: int, b: int) -> "GGUFTensor":
        """Rows [a, b) as a tensor of their own (one expert of a GGUF tensor that stacks
        a layer's experts, [experts * rows, cols]); nothing is read."""
        assert self.row_perm is None and len(self.shape) == 2 and 0 <= a < b <= self.shape[0]
        out = object.__new__(GGUFTensor)
        out.__dict__.update(self.__dict__)
        out.name, out.shape, out._row0, out._file = name, (b - a, self.shape[1]), \
            self._row0 + a, None
        return out

    def drop_pages(self) -> None:
        """Unmap this tensor's pages of the file from the process (they were decoded or
        repacked; a later read maps them again from the page cache). Loading a file
        much larger than free memory stays near the size of what is kept: each tensor's
        source pages leave the resident set once it is packed, not at the end."""
        mm = _file_map(self._data)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        offset, nbytes = self.file_span
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(mm), -(-(offset + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    @property
    def file_span(self) -> tuple[int, int]:
        """(offset, bytes) of this tensor's data in the file."""
        if len(self.shape) == 1:
            return self._offset, self._data.nbytes
        return self._offset + self._row0 * self._row_bytes, self.shape[0] * self._row_bytes

    @property
    def is_int4(self) -> bool:
        return self.type in INT4_TYPES

    def _raw(self, a: int, b: int) -> np.ndarray:
        data = self._data if self._data.ndim > 1 or len(self.shape) == 1 else \
            self._data.reshape(self.shape[0], -1)
        if self.row_perm is None:
            a, b = a + self._row0, b + self._row0
            return np.asarray(data[a:b])
        return np.asarray(data[self.row_perm[a:b]])

    def dequantize(self, a: int = 0, b: int | None = None) -> np.ndarray:
        """float32 rows [a, b) (the whole tensor for a 1-D one), exact."""
        if len(self.shape) == 1:
            arr = np.asarray(self._data, dtype=np.float32).reshape(self.shape)
            return (arr if self.row_perm is None else arr[self.row_perm]).copy()
        b = self.shape[0] if b is None else b
        return self._decode(self._raw(a, b))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 rows `ids` (int [n], any order, repeats allowed) -> [n, cols], exact:
        only those rows' bytes are read, with pread from the file when its path is known
        (else through the memory map). Opens the file on the first call."""
        uniq, inv = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= self.shape[0]):
            raise IndexError(f"row ids must be in [0, {self.shape[0]}) for {self.name}")
        src = uniq + self._row0 if self.row_perm is None else self.row_perm[uniq]
        if self._path is None or len(self.shape) != 2:
            data = self._data if self._data.ndim > 1 else \
                self._data.reshape(self.shape[0], -1)
            return self._decode(np.asarray(data[src]))[inv]
        return self._decode(self._pread_rows(src))[inv]

    def _pread_rows(self, src: np.ndarray) -> np.ndarray:
        """Raw rows `src` (as the map would give them: [n, row bytes] uint8, or the
        elements of a float tensor) read from the file, one read per run of consecutive
        rows."""
        row_bytes = self._row_bytes
        out = np.empty((len(src), row_bytes), np.uint8)
        if self._file is None:
            self._file = open(self._path, "rb", buffering=0)
        fd = self._file.fileno()
        starts = np.flatnonzero(np.diff(src, prepend=-2) != 1)
        for a, b in zip(starts.tolist(), starts[1:].tolist() + [len(src)]):
            view = memoryview(out[a:b]).cast("B")
            offset, done = self._offset + int(src[a]) * row_bytes, 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{self._path} ends inside tensor {self.name}")
                done += n
        return out.view(self._data.dtype).reshape(len(src), -1)

    def _decode(self, raw: np.ndarray) -> np.ndarray:
        """Raw rows (file bytes, or the values of a float tensor) -> float32 [n, cols]."""
        from gguf import quants

        if self.type == "F32":
            return np.array(raw, dtype=np.float32)
        if self.type in ("F16", "BF16") and raw.dtype != np.uint8:
            return raw.astype(np.float32)
        return quants.dequantize(raw, self._qtype).astype(np.float32, copy=False) \
            .reshape(raw.shape[0], self.shape[1])

    def int4_groups(self, a: int = 0, b: int | None = None):
        """(q uint8 [n, K] in 0..15, d f32 [n, K/32], m f32 [n, K/32]) for rows [a, b)
        with w = d * q + m exactly; None if not a 4-bit format."""
        if not self.is_int4:
            return None
        b = self.shape[0] if b is None else b
        return _DECODERS[self.type](self._raw(a, b), self.shape[1])

    def int8_groups(self, a: int = 0, b: int | None = None):
        """(u uint8 [n, K], d float16 [n, K/32], m float16 [n, K/32]) for rows [a, b) with
        w = d * u + m exactly, for the types in INT8G_TYPES."""
        assert self.type in INT8G_TYPES, self.type
        b = self.shape[0] if b is None else b
        raw, cols = self._raw(a, b), self.shape[1]
        if self.type in ("Q4_0", "Q4_1"):
            u, d, m = _DECODERS[self.type](raw, cols)
            return u, d.astype(np.float16), m.astype(np.float16)
        return _BYTE_GROUPS[self.type](raw, cols)

    def q4_k_parts(self, a: int = 0, b: int | None = None):
        """For a Q4_K tensor, rows [a, b) as the file's own numbers (q, sc, mn, d, dmin),
        see _q4_k_parts."""
        assert self.type == "Q4_K", self.type
        b = self.shape[0] if b is None else b
        return _q4_k_parts(self._raw(a, b), self.shape[1])

    def q6_k_parts(self, a: int = 0, b: int | None = None):
        """For a Q6_K tensor, rows [a, b) as (q uint8 [n, K] in 0..63, sc int8 [n, K/16],
        d float16 [n, K/256]) with w = d * sc * (q - 32) exactly (the file's own numbers)."""
        assert self.type == "Q6_K", self.type
        b = self.shape[0] if b is None else b
        return _q6_k(self._raw(a, b), self.shape[1])


def _file_map(arr: np.ndarray) -> mmap.mmap | None:
    """The mmap a numpy view of a memory-mapped file comes from (numpy.memmap keeps it as
    `_mmap` on the array the views derive from), or None."""
    while arr is not None:
        mm = getattr(arr, "_mmap", None)
        if isinstance(mm, mmap.mmap):
            return mm
        arr = getattr(arr, "base", None)
    return None


def _f16(raw: np.ndarray, off: int, n: int = 1) -> np.ndarray:
    return raw[:, off:off + 2 * n].copy().view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles first, then high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_0(raw: np.ndarray, cols: int):
    n = raw.shape[0]
    blocks = raw.reshape(n, cols // 32, 18)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    q = _nibbles32(blocks[..., 2:18]).reshape(n, cols)
    return q, d, -8.0 * d


def _q4_1(raw: np.ndarray, cols: int):
    n = raw.shape[0]
    blocks = raw.reshape(n, cols // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    q = _nibbles32(blocks[..., 4:20]).reshape(n, cols)
    return q, d, m


def _q4_k_parts(raw: np.ndarray, cols: int):
    """Q4_K blocks of 256 [d f16 | dmin f16 | 12 bytes of 6-bit (sc, mn) x 8 | 128 bytes of
    nibbles] -> (q uint8 [n, cols], sc, mn uint8 [n, cols/32], d, dmin float16
    [n, cols/256]): w = d * sc * q - dmin * mn."""
    n = raw.shape[0]
    nb = cols // 256
    blocks = raw.reshape(n, nb, 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                          # [n, nb]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    s = blocks[..., 4:16]                                                         # [n, nb, 12]
    # 6-bit scales and mins of the 8 sub-blocks, packed in 12 bytes.
    sc = np.empty((n, nb, 8), np.uint8)
    mn = np.empty((n, nb, 8), np.uint8)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:144].reshape(n, nb, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, cols)    # sub-blocks 2i, 2i+1
    return q, sc.reshape(n, nb * 8), mn.reshape(n, nb * 8), d, dmin


def _q4_k(raw: np.ndarray, cols: int):
    q, sc, mn, d, dmin = _q4_k_parts(raw, cols)
    d32 = np.repeat(d.astype(np.float32), 8, axis=1)
    dmin32 = np.repeat(dmin.astype(np.float32), 8, axis=1)
    return q, d32 * sc, -dmin32 * mn


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def _q6_k(raw: np.ndarray, cols: int):
    """Q6_K blocks of 256 [ql 128 | qh 64 | sc 16 int8 | d f16]: per half of 128, element
    l + 32 s (s = 0..3) has its low 4 bits in ql (byte l or l + 32 of the half, low nibble
    for s < 2) and its top 2 bits in bits 2 s of qh byte l."""
    n = raw.shape[0]
    nb = cols // 256
    blocks = raw.reshape(n, nb, 210)
    ql = blocks[..., :128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (ql & 15).reshape(n, nb, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    qh = (qh & 3).reshape(n, nb, 2, 4, 32)
    q = (ql | (qh << 4)).reshape(n, cols)
    sc = blocks[..., 192:208].copy().view(np.int8).reshape(n, nb * 16)
    d = blocks[..., 208:210].copy().view(np.float16).reshape(n, nb)
    return q, sc, d


def _q5(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5 blocks [n, groups, bytes] -> their 5-bit values [n, groups, 32] (qh: 4 bytes at
    qh_at, the 16 bytes of nibbles right after)."""
    qh = blocks[..., qh_at:qh_at + 4].copy().view(np.uint32)               # [n, g, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)    # [n, g, 32]
    return _nibbles32(blocks[..., qh_at + 4:qh_at + 20]) | (high << 4)


def _q5_0_bytes(raw: np.ndarray, cols: int):
    blocks = raw.reshape(raw.shape[0], cols // 32, 22)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    u = _q5(blocks, 2).reshape(raw.shape[0], cols)
    return u, d, (d.astype(np.float32) * -16.0).astype(np.float16)


def _q5_1_bytes(raw: np.ndarray, cols: int):
    blocks = raw.reshape(raw.shape[0], cols // 32, 24)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return _q5(blocks, 4).reshape(raw.shape[0], cols), d, m


def _q8_0_bytes(raw: np.ndarray, cols: int):
    blocks = raw.reshape(raw.shape[0], cols // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    u = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return u.reshape(raw.shape[0], cols), d, (d.astype(np.float32) * -128.0).astype(np.float16)


_BYTE_GROUPS = {"Q5_0": _q5_0_bytes, "Q5_1": _q5_1_bytes, "Q8_0": _q8_0_bytes}
