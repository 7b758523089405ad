"""Low-bit weights kept low-bit, and the linear layer that picks its kernel by rows.

Two packed forms. Decode steps run duetserve's own kernels on them (csrc/lowbit_gemv.cpp:
activations quantized to int8 per group of 32 at each call, integer dot products with
AVX512-VNNI, one float scale per group), else plain torch:

- `Int4Weight`: GGUF Q4_1's groups, 32 along K, `w = d * q + m`, q in 0..15, 16 bytes
  of nibbles + float16 d and m per group (0.625 bytes per weight), packed in blocks of 16
  rows x 1 group so the decode kernel reads one sequential stream and each lane of its
  dot products is one weight row (layout in csrc/lowbit_gemv.cpp). GGUF Q4_0 and Q4_1
  map onto it losslessly; so does a float checkpoint under `--quantization int4`.
- `Int4KWeight`: GGUF Q4_K kept exactly, `w = d * sc * q - dmin * mn` with the file's
  6-bit sc and mn per 32 and float16 d, dmin per 256: the file's 0.5625 bytes per weight,
  reordered (Int4Weight's float16 scale and minimum per group, which Q4_K used to be
  widened to, took 0.625 and rounded them).
- `Int6Weight`: GGUF Q6_K kept exactly, `w = d * sc * (q - 32)`, q in 0..63, an int8 sc
  per 16 weights and a float16 d per 128 (0.828 bytes per weight against the file's
  0.820), in blocks of 16 rows x 128 columns (layout in csrc/lowbit_gemv.cpp).
  The four block forms share the 16-row blocks (`_BlockWeight.ROWS`).
- `Int8GWeight`: GGUF Q8_0, Q5_0 and Q5_1 kept exactly, `w = d * u + m` per group of 32
  along K, u in 0..255 (Q8_0: its int8 code + 128 with m = -128 d; Q5_x: the 5-bit code),
  float16 d and m: units of 16 rows x 1 group, 576 bytes (1.125 bytes per weight; Q8_0's
  file has 1.0625, Q5_0's 0.6875: one byte a weight keeps a single kernel for the three).
- `Int8Weight`: one scale per output row, symmetric. Float checkpoints under
  `--quantization int8` are quantized into it (and GGUF types with no exact form under
  `--quantization int8`): |error| <= scale / 2 = max|w_row| / 254 per weight (+ the
  bfloat16 rounding of the scale, 2^-8 relative).

The int8 activations add their own error to a product: per group, |x - dx xq| <= dx / 2
with dx = max|x_g| / 127 (what llama.cpp's Q8_0 activations do; accuracy against the
float32 path is measured by benchmarks/quant_accuracy.py).

`QuantLinear.forward` picks per call: rows <= `policy.lowbit_max_rows` run the low-bit
kernel, which reads 4 or 8 bits per weight (decode steps; and prefill chunks where it
measured faster than the dense path: `UNBOUNDED_ROWS`, every step, when it won at every
row count measured, models/kernels.py); more rows run AMX bf16 tiles where the policy chose
them (`policy.many_rows`, `amx_matmul`: the weights dequantized a chunk at a time in cache),
else a dense GEMM in `policy.dense_dtype` on a resident dense copy when one was kept, else on
weights dequantized for the call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from duetserve.models.native import ops as _native_ops

_NATIVE = _native_ops()   # compiled kernels (q4/q8 GEMV, q4 dequant) or None: plain torch
GROUP = 32
_DEQUANT_ROWS = 2048   # rows dequantized at a time on the many-row path without a dense copy
# the native dequantization's output dtypes (csrc/lowbit_gemv.cpp: NAME_bf16, NAME_f32)
_DEQUANT_SUFFIX = {torch.bfloat16: "_bf16", torch.float32: "_f32"}
# K tiles: a 4-row block of a long row (K = 8960: 20-30 KB) streamed whole pushes the
# activations (9-12 KB) out of L1 before the next block reuses them, so the packed forms
# store K in tiles of at most this many columns, tile after tile (csrc/lowbit_gemv.cpp).
TILE_COLS = 2048


@dataclass
class KernelPolicy:
    """Shared by every QuantLinear of a model; set once at load (see models/kernels.py)."""

    lowbit_max_rows: int = 8       # rows <= this: low-bit kernels (UNBOUNDED_ROWS: always)
    many_rows: str = "dense"       # more rows: "amx" (AMX bf16 tiles, weights that have
                                   # them: amx_matmul) or "dense" (the dense GEMM)
    dense_dtype: torch.dtype = torch.float32
    reason: str = ""


def _block_rows(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of a weight packed in blocks of 4 rows: blocks [N/4, chunks, 4, bytes]
    -> [n, chunks, bytes] (the row's bytes of every chunk, in order)."""
    return blocks[ids // 4, :, ids % 4]


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [nb * 16, ng * 32] values 0..15 -> [nb, ng, 256] bytes in the q4 kernels' order:
    per block of 16 rows and group, 4 vectors of 64 bytes; vector v, dword r, byte j holds
    element 8v + j of row r low and 8v + 4 + j high (csrc/lowbit_gemv.cpp)."""
    v = q.to(torch.uint8).view(q.shape[0] // 16, 16, q.shape[1] // GROUP, 4, 2, 4)
    b = v[..., 0, :] | (v[..., 1, :] << 4)                          # b, r, g, v, j
    return b.permute(0, 2, 3, 1, 4).reshape(q.shape[0] // 16, -1, 256)


def _unpack_nibbles(nib: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Row r[i] of each block's groups nib [n, ng, 256] -> q [n, ng, 32]."""
    b = nib.reshape(nib.shape[0], -1, 4, 16, 4)[torch.arange(nib.shape[0]), :, :, r]
    return torch.stack([b & 15, b >> 4], dim=-2).reshape(nib.shape[0], -1, GROUP)


def _pad_rows(t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """t [n, ...] as dtype with zero rows appended up to `rows` (a whole number of blocks)."""
    out = torch.zeros(rows, *t.shape[1:], dtype=dtype)
    out[:t.shape[0]] = t
    return out


class _BlockWeight:
    """A weight packed in blocks of ROWS rows, `units` column units of COLS a row, in one
    uint8 tensor `packed` [tiles, ceil(N/ROWS), TU, BLOCK]: K in tiles of TU units (the last
    one padded with zero units), each tile holding every row block's TU units in turn
    (`_tiled`). A native GEMV and bf16 / float32 dequantization (csrc/lowbit_gemv.cpp,
    named by _GEMV and _DEQUANT + _DEQUANT_SUFFIX) and plain-torch fallbacks. Subclasses define _unpack(ids) (rows
    `ids` unpacked) and _decode(*unpacked, dtype) (-> dense rows)."""

    _GEMV = _DEQUANT = ""
    COLS = 128
    ROWS = 16
    shape: tuple[int, int]
    packed: torch.Tensor

    @classmethod
    def _tiled(cls, blocks: torch.Tensor) -> torch.Tensor:
        """[NB, units, BLOCK] (every row block's units in order) -> [tiles, NB, TU, BLOCK]
        with TU * COLS <= TILE_COLS where units allow, tiles as even as whole units make
        them (K = 8960: 5 tiles of 1792 columns)."""
        nb, units, block = blocks.shape
        tiles = -(-units // max(1, TILE_COLS // cls.COLS))
        tu = -(-units // tiles)
        if tiles == 1:
            # the same storage, not a view: a view keeps its base tensor alive, and with it
            # this storage after the loader moves the weight into its 2 MiB pages
            b = blocks.contiguous()
            return torch.empty(0, dtype=b.dtype).set_(b.untyped_storage(), b.storage_offset(),
                                                     (1, nb, units, block))
        padded = torch.zeros(nb, tiles * tu, block, dtype=blocks.dtype)
        padded[:, :units] = blocks
        # set_ again (not a view): canonical strides also where nb == 1, whose size-1 dim
        # contiguous() leaves with the transposed stride the kernels' checks refuse
        t = padded.view(nb, tiles, tu, block).transpose(0, 1).contiguous()
        return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (tiles, nb, tu, block))

    @classmethod
    def from_row_chunks(cls, n: int, k: int, chunks) -> "_BlockWeight":
        """The weight of `n` rows of `k` columns from `chunks`: weights of this class over
        consecutive rows, each a whole number of ROWS-row blocks but the last, copied into
        one packed tensor as they come, so packing a big matrix (a tied embedding) holds one
        chunk's intermediates at a time, not the whole matrix's."""
        out, b0 = None, 0
        for w in chunks:
            if out is None:
                tiles, _, tu, block = w.packed.shape
                out = torch.empty(tiles, -(-n // cls.ROWS), tu, block, dtype=w.packed.dtype)
            nb = w.packed.shape[1]
            out[:, b0:b0 + nb] = w.packed
            b0 += nb
        assert out is not None and b0 == out.shape[1], (n, b0)
        weight = object.__new__(cls)
        weight.shape, weight.packed = (n, k), out
        return weight

    def _row_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks holding rows `ids` [n]: [n, units, BLOCK] (a copy of those only)."""
        tiles, _, tu, block = self.packed.shape
        units = -(-self.shape[1] // self.COLS)
        b = self.packed[:, ids // self.ROWS]                            # [tiles, n, TU, B]
        return b.transpose(0, 1).reshape(len(ids), tiles * tu, block)[:, :units]

    def _unpack(self, ids: torch.Tensor) -> tuple:
        raise NotImplementedError

    @staticmethod
    def _decode(*parts) -> torch.Tensor:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] float32: the native int8-activation kernel when built, else
        a float32 product on the dequantized weight."""
        if _NATIVE is not None:
            return getattr(_NATIVE, self._GEMV)(x.float(), self.packed, self.shape[0])
        return F.linear(x.float(), self.dequantize())

    amx = True        # amx_matmul runs (where the native kernels have AMX)

    def amx_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] float32 on AMX bf16 tiles (many rows; the weights dequantized
        to bf16 a chunk at a time in cache, csrc/lowbit_gemv.cpp: amx_gemm)."""
        return _NATIVE.amx_gemm(x, [self.packed], [self.shape[0]])

    def dequantize(self, dtype: torch.dtype = torch.float32, a: int = 0,
                   b: int | None = None) -> torch.Tensor:
        """Rows [a, b) as a dense [b - a, K] tensor."""
        b = self.shape[0] if b is None else b
        suffix = _DEQUANT_SUFFIX.get(dtype)
        if _NATIVE is not None and suffix:
            return getattr(_NATIVE, self._DEQUANT + suffix)(self.packed, self.shape[1], a, b)
        return self._decode(*self._unpack(torch.arange(a, b)), dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` [n] -> [n, K] float32 (embedding lookup)."""
        return self._decode(*self._unpack(ids.reshape(-1)), torch.float32).view(*ids.shape, -1)

    def prefix(self, n: int):
        """Rows [0, n) as a weight sharing this one's storage (the packed blocks up to
        row n; a last partial block's other rows are computed and dropped)."""
        if not 0 < n <= self.shape[0]:
            raise ValueError(f"row prefix {n} outside 1..{self.shape[0]}")
        out = object.__new__(type(self))
        out.shape = (n, self.shape[1])
        out.packed = self.packed[:, :-(-n // self.ROWS)]
        return out

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class Int4Weight(_BlockWeight):
    """Units of one group (32 columns) of 16 rows, 320 bytes: the rows' nibbles as 4
    vectors of 64 bytes (vector v, dword r, byte j: element 8v + j of row r low, 8v + 4 + j
    high), then d [16 rows] and m [16] as float16; w = d * q + m. Padding is zero. Blocks
    of 16 rows let the kernel's dot products take their activations as 4-byte broadcasts
    (csrc/lowbit_gemv.cpp)."""

    bits = 4
    COLS = 32
    BLOCK = 16 * 16 + 2 * 32
    _GEMV, _DEQUANT = "q4_gemv", "q4_dequant"

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """q: [N, K] uint8 in 0..15; d, m: [N, K/32] float (w = d * q + m)."""
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"int4 groups need K % {GROUP} == 0, got K = {k}")
        self.shape = (n, k)
        ng, nb = k // GROUP, -(-n // 16)
        dm = torch.stack([_pad_rows(d, nb * 16, torch.float16),
                          _pad_rows(m, nb * 16, torch.float16)])           # 2, R, g
        dm = dm.view(2, nb, 16, ng).permute(1, 3, 0, 2).contiguous()       # b, g, 2, r
        self.packed = self._tiled(torch.cat([_pack_nibbles(_pad_rows(q, nb * 16, torch.uint8)),
                                             dm.view(torch.uint8).reshape(nb, ng, 64)], dim=-1))

    def groups(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `ids` [n] unpacked: (q [n, K/32, 32] uint8 values, d, m [n, K/32] float16)."""
        blk, r, n = self._row_blocks(ids), ids % self.ROWS, len(ids)
        dm = blk[..., 256:].contiguous().view(torch.float16).view(n, -1, 2, 16)
        dm = dm[torch.arange(n), :, :, r]
        return _unpack_nibbles(blk[..., :256], r), dm[..., 0], dm[..., 1]

    @staticmethod
    def _decode(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Unpacked rows (q [rows, K/32, 32] values) -> dense [rows, K] in dtype."""
        w = q.to(dtype) * d.to(dtype)[..., None] + m.to(dtype)[..., None]
        return w.reshape(q.shape[0], -1)

    _unpack = groups


class Int4KWeight(_BlockWeight):
    """Units of 256 columns of 16 rows, 2304 bytes (the file's 16 x 144, reordered): the 8
    groups' nibbles as Int4Weight's units (256 bytes each), then the 6-bit codes as 4 x 16
    little-endian 24-bit words (192 bytes; word 16 g + r = sc0 | sc1 << 6 | mn0 << 12 |
    mn1 << 18, the codes of row r's groups g and 4 + g), then d [16 rows] and dmin [16] as
    float16 (32 + 32); w = d * sc * q - dmin * mn. Padding rows are zero."""

    bits = 4
    COLS = 256
    BLOCK = 8 * 256 + 4 * 48 + 2 * 32
    _GEMV, _DEQUANT = "q4k_gemv", "q4k_dequant"

    def __init__(self, q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
                 d: torch.Tensor, dmin: torch.Tensor) -> None:
        """q: [N, K] uint8 in 0..15; sc, mn: [N, K/32] uint8 in 0..63; d, dmin: [N, K/256]
        float16 (GGUFTensor.q4_k_parts)."""
        q, sc, mn, d, dmin = (torch.as_tensor(t) for t in (q, sc, mn, d, dmin))
        n, k = q.shape
        if k % 256:
            raise ValueError(f"Q4_K blocks need K % 256 == 0, got K = {k}")
        if sc.numel() and max(int(sc.max()), int(mn.max())) > 63:
            raise ValueError("Q4_K scale and minimum codes are 6-bit (0..63)")
        self.shape = (n, k)
        nb, ns = -(-n // 16), k // 256
        rows = nb * 16

        def halves(t: torch.Tensor) -> torch.Tensor:        # [nb, row, ns, half, g]
            return _pad_rows(t, rows, torch.uint8).view(nb, 16, ns, 2, 4).to(torch.int32)

        s2, m2 = halves(sc), halves(mn)
        word = s2[:, :, :, 0] | s2[:, :, :, 1] << 6 | m2[:, :, :, 0] << 12 | m2[:, :, :, 1] << 18
        codes = torch.stack([(word >> (8 * i)) & 255 for i in range(3)], dim=-1)
        codes = codes.permute(0, 2, 3, 1, 4).reshape(nb, ns, 192)       # [nb, ns, g, row, 3]

        def per_row(t: torch.Tensor) -> torch.Tensor:       # [row] float16 -> 32 bytes
            t = _pad_rows(t, rows, torch.float16).view(nb, 16, ns)
            return t.permute(0, 2, 1).contiguous().view(torch.uint8)
        self.packed = self._tiled(torch.cat([
            _pack_nibbles(_pad_rows(q, rows, torch.uint8)).view(nb, ns, 2048),
            codes.to(torch.uint8), per_row(d), per_row(dmin)], dim=-1))

    def groups(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `ids` [n] unpacked as Int4Weight.groups: (q [n, K/32, 32] uint8, d, m
        [n, K/32] float32 with d = d * sc and m = -dmin * mn, exact)."""
        blk, r = self._row_blocks(ids), ids % self.ROWS
        n, ns, ng, ar = len(ids), blk.shape[1], self.shape[1] // GROUP, torch.arange(len(ids))
        b = blk[..., 2048:2240].reshape(n, ns, 4, 16, 3).to(torch.int32)  # [.., g, row, byte]
        word = (b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16)[ar, :, :, r]  # [n, ns, g]
        codes = torch.stack([(word >> s) & 63 for s in (0, 6, 12, 18)], dim=2).float()
        codes = codes.view(n, ns, 2, 2, 4)                              # [.., sc|mn, h, g]
        scales = blk[..., 2240:].contiguous().view(torch.float16).view(n, ns, 2, 16)
        scales = scales[ar, :, :, r].float()                           # [n, ns, 2]
        d = scales[:, :, 0, None, None] * codes[:, :, 0]
        m = -scales[:, :, 1, None, None] * codes[:, :, 1]
        return (_unpack_nibbles(blk[..., :2048].reshape(n, ns * 8, 256), r),
                d.reshape(n, ng), m.reshape(n, ng))

    _unpack = groups
    _decode = staticmethod(Int4Weight._decode)


class Int6Weight(_BlockWeight):
    """Units of 128 columns of 16 rows, 1696 bytes: per group of 32 columns the rows' low 4
    bits in Int4Weight's order (256 bytes), their top two bits (128 bytes: vector u, dword
    r, byte j, bits 2k..2k+1 hold element 16u + 4k + j of row r) and sc int8 [half][row]
    (32 bytes), then d [16 rows] float16; w = d * sc * (q - 32). Padding rows are zero
    (sc = 0)."""

    bits = 6
    BLOCK = 4 * (256 + 128 + 32) + 32
    _GEMV, _DEQUANT = "q6_gemv", "q6_dequant"

    def __init__(self, q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> None:
        """q: [N, K] uint8 in 0..63; sc: [N, K/16] int8; d: [N, K/128] float16."""
        n, k = q.shape
        if k % 128:
            raise ValueError(f"6-bit blocks need K % 128 == 0, got K = {k}")
        self.shape = (n, k)
        nb, nch, ng = -(-n // 16), k // 128, k // GROUP
        rows = nb * 16
        qp = _pad_rows(q, rows, torch.uint8)
        top = (qp >> 4).view(nb, 16, ng, 2, 4, 4)                      # b, r, g, u, k, j
        tb = top[..., 0, :] | top[..., 1, :] << 2 | top[..., 2, :] << 4 | top[..., 3, :] << 6
        scp = _pad_rows(sc, rows, torch.int8).view(nb, 16, ng, 2)      # b, r, g, half
        groups = torch.cat([_pack_nibbles(qp & 15),
                            tb.permute(0, 2, 3, 1, 4).reshape(nb, ng, 128),
                            scp.permute(0, 2, 3, 1).contiguous().view(torch.uint8)
                               .reshape(nb, ng, 32)], dim=-1)
        dp = _pad_rows(d, rows, torch.float16).view(nb, 16, nch).permute(0, 2, 1)
        self.packed = self._tiled(torch.cat([
            groups.reshape(nb, nch, 4 * 416),
            dp.contiguous().view(torch.uint8).reshape(nb, nch, 32)], dim=-1))

    @classmethod
    def from_q6_k(cls, q, sc, d) -> "Int6Weight":
        """From GGUF Q6_K's numbers (GGUFTensor.q6_k_parts: d per 256, here per 128)."""
        return cls(torch.as_tensor(q), torch.as_tensor(sc),
                   torch.as_tensor(d).repeat_interleave(2, dim=1))

    def parts(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `ids` [n] unpacked: (q [n, K] uint8, sc [n, K/16] int8, d [n, K/128] f16)."""
        blk, r = self._row_blocks(ids), ids % self.ROWS
        n, nch, ar = len(ids), blk.shape[1], torch.arange(len(ids))
        g = blk[..., :1664].reshape(n, nch * 4, 416)
        low = _unpack_nibbles(g[..., :256], r)                               # [n, ng, 32]
        tb = g[..., 256:384].reshape(n, nch * 4, 2, 16, 4)[ar, :, :, r]      # [n, ng, u, j]
        top = torch.stack([(tb >> (2 * k)) & 3 for k in range(4)], dim=-2)  # [n, ng, u, k, j]
        q = low | (top.reshape(n, -1, GROUP) << 4)
        sc = g[..., 384:].contiguous().view(torch.int8).reshape(n, nch * 4, 2, 16)[ar, :, :, r]
        d = blk[..., 1664:].contiguous().view(torch.float16).view(n, nch, 16)[ar, :, r]
        return q.reshape(n, -1), sc.reshape(n, -1), d

    @staticmethod
    def _decode(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Unpacked rows -> dense [rows, K] in dtype: (d * sc) * (q - 32) in float32, as
        GGUF's own dequantization computes it."""
        n = q.shape[0]
        scale = d.float().repeat_interleave(8, dim=1) * sc.float()             # [n, K/16]
        w = scale[..., None] * (q.view(n, -1, 16).float() - 32.0)
        return w.reshape(n, -1).to(dtype)

    _unpack = parts


class Int8GWeight(_BlockWeight):
    """Units of one group (32 columns) of 16 rows, 576 bytes: the rows' bytes as 8 vectors
    of 64 (vector v, dword r, byte j: element 4v + j of row r), then d [16 rows] and m [16]
    as float16; w = d * u + m, u in 0..255 (GGUF Q8_0: u = q + 128, m = -128 d; Q5_0:
    u = q, m = -16 d; Q5_1: u = q and the file's m; all exact). Padding is zero."""

    bits = 8
    COLS = 32
    BLOCK = 8 * 64 + 2 * 32
    _GEMV, _DEQUANT = "q8g_gemv", "q8g_dequant"

    def __init__(self, u, d, m) -> None:
        """u: [N, K] uint8; d, m: [N, K/32] float values that float16 holds exactly."""
        u, d, m = (torch.as_tensor(t) for t in (u, d, m))
        n, k = u.shape
        if k % GROUP:
            raise ValueError(f"int8 groups need K % {GROUP} == 0, got K = {k}")
        self.shape = (n, k)
        ng, nb = k // GROUP, -(-n // 16)
        codes = _pad_rows(u, nb * 16, torch.uint8).view(nb, 16, ng, 8, 4)   # b, r, g, v, j
        codes = codes.permute(0, 2, 3, 1, 4).reshape(nb, ng, 512)
        dm = torch.stack([_pad_rows(d, nb * 16, torch.float16),
                          _pad_rows(m, nb * 16, torch.float16)])           # 2, R, g
        dm = dm.view(2, nb, 16, ng).permute(1, 3, 0, 2).contiguous()       # b, g, 2, r
        self.packed = self._tiled(torch.cat([codes, dm.view(torch.uint8).reshape(nb, ng, 64)],
                                            dim=-1))

    def groups(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `ids` [n] unpacked: (u [n, K/32, 32] uint8, d, m [n, K/32] float16)."""
        blk, r, n = self._row_blocks(ids), ids % self.ROWS, len(ids)
        ar = torch.arange(n)
        u = blk[..., :512].reshape(n, -1, 8, 16, 4)[ar, :, :, r].reshape(n, -1, GROUP)
        dm = blk[..., 512:].contiguous().view(torch.float16).view(n, -1, 2, 16)[ar, :, :, r]
        return u, dm[..., 0], dm[..., 1]

    _unpack = groups
    _decode = staticmethod(Int4Weight._decode)


class Int8Weight:
    """int8 [N, K] + one bfloat16 scale per row, packed like `Int4Weight` for streaming:
    `packed` [ceil(N/4), ceil(K/64), 256] int8, per block of 4 rows 64 columns of each row
    in turn; padding is zero."""

    bits = 8
    amx = False       # no AMX kernel for this form: many-row steps take the dense path

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """q: int8 [N, K]; scale: [N] (see `quantize_int8`)."""
        n, k = q.shape
        nb, npairs = -(-n // 4), -(-k // 64)
        padded = torch.zeros(nb * 4, npairs * 64, dtype=torch.int8)
        padded[:n, :k] = q
        self.packed = padded.view(nb, 4, npairs, 64).permute(0, 2, 1, 3).reshape(
            nb, npairs, 256).contiguous()
        self.scale = scale.to(torch.bfloat16)
        self.scale32 = self.scale.float()     # the native kernel's operand (N floats)
        self.shape = (n, k)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Weight":
        return cls(*quantize_int8(w))

    def int8_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] unpacked: int8 [n, K]."""
        nb, npairs, _ = self.packed.shape
        q = _block_rows(self.packed.view(nb, npairs, 4, 64), ids)          # [n, npairs, 64]
        return q.reshape(len(ids), -1)[:, : self.shape[1]]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] float32: the native int8-activation kernel when built, else
        a float32 product on the dequantized weight."""
        if _NATIVE is not None:
            return _NATIVE.q8_gemv(x.float(), self.packed, self.scale32)
        return F.linear(x.float(), self.dequantize())

    def dequantize(self, dtype: torch.dtype = torch.float32, a: int = 0,
                   b: int | None = None) -> torch.Tensor:
        b = self.shape[0] if b is None else b
        return self.int8_rows(torch.arange(a, b)).to(dtype) * self.scale[a:b].to(dtype)[:, None]

    def prefix(self, n: int) -> "Int8Weight":
        """Rows [0, n) as a weight sharing this one's storage (see Int4Weight.prefix)."""
        if not 0 < n <= self.shape[0]:
            raise ValueError(f"row prefix {n} outside 1..{self.shape[0]}")
        out = object.__new__(Int8Weight)
        out.shape = (n, self.shape[1])
        out.packed = self.packed[:-(-n // 4)]
        out.scale, out.scale32 = self.scale[:n], self.scale32[:n]
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        w = self.int8_rows(flat).float() * self.scale[flat].float()[:, None]
        return w.view(*ids.shape, -1)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * 2


class StackedWeight:
    """Block-packed weights stacked along N, each part in its own form: a stacked qkv whose
    parts differ in GGUF type (Q4_K q and k beside a Q6_K v: `StackedWeight([Int4KWeight,
    Int6Weight])`) keeps every part exact instead of widening the whole target to int8
    (~1.3 MB less a layer on the 1.5B). One native call runs all parts (csrc/lowbit_gemv.cpp:
    stacked_gemv); the parts' packed bytes share one storage, in order."""

    def __init__(self, parts: list[_BlockWeight]) -> None:
        if len(parts) < 2 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("a stacked weight needs two or more parts of the same K")
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.bits = "/".join(str(p.bits) + ("k" if isinstance(p, Int4KWeight) else "")
                             for p in parts)
        # one storage for all parts (one stream in 2 MiB pages, loader/huge_pages.py); set_,
        # not views: a view's base would keep this storage alive once the loader moves it
        sizes = [-(-p.packed.numel() // 64) * 64 for p in parts]
        storage = torch.empty(sum(sizes), dtype=torch.uint8).untyped_storage()
        at = 0
        for p, size in zip(parts, sizes):
            packed = torch.empty(0, dtype=torch.uint8).set_(storage, at, p.packed.shape)
            packed.copy_(p.packed)
            p.packed = packed
            at += size
        self._n = [p.shape[0] for p in parts]

    def _spans(self, a: int, b: int):
        """(part, a', b') for the parts' rows within [a, b)."""
        lo = 0
        for p in self.parts:
            hi = lo + p.shape[0]
            if a < hi and b > lo:
                yield p, max(a, lo) - lo, min(b, hi) - lo
            lo = hi

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] float32: every part's own kernel, in one native call."""
        if _NATIVE is not None:
            return _NATIVE.stacked_gemv(x.float(), [p.packed for p in self.parts], self._n)
        return torch.cat([p.matmul(x) for p in self.parts], dim=1)

    amx = True

    def amx_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] float32: every part on AMX bf16 tiles, in one native call."""
        return _NATIVE.amx_gemm(x, [p.packed for p in self.parts], self._n)

    def dequantize(self, dtype: torch.dtype = torch.float32, a: int = 0,
                   b: int | None = None) -> torch.Tensor:
        b = self.shape[0] if b is None else b
        return torch.cat([p.dequantize(dtype, pa, pb) for p, pa, pb in self._spans(a, b)])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def prefix(self, n: int) -> "StackedWeight":
        raise NotImplementedError("a stacked weight is a layer's projection, not a head")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


QuantWeight = Int4Weight | Int4KWeight | Int6Weight | Int8GWeight | Int8Weight | StackedWeight


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of float w [N, K] -> (q int8 [N, K], scale bfloat16 [N]),
    w ~= q * scale. Rows are independent, so a tensor may be quantized in row chunks."""
    w = w.float()
    scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int4_groups_from_float(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 over groups of 32 of float w [N, K] -> (q uint8 [N, K],
    d [N, K/32], m [N, K/32]) with w ~= d * q + m (for `--quantization int4` of a
    checkpoint that is not already 4-bit; lossy: |error| <= d / 2)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(n, k), scale, lo


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W low-bit."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None,
                 policy: KernelPolicy, dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = qweight
        self.out_features, self.in_features = qweight.shape
        self.bias = None if bias is None else bias.float()
        self.policy = policy
        self.dense = dense            # resident dense copy in policy.dense_dtype, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 -> [M, N] in the kernel's output dtype (bfloat16
        for the low-bit kernels and bf16 GEMMs). Consumers widen it for free: the residual
        add, the rotary tables and the bias are float32, so type promotion does the cast
        inside an op the model runs anyway (one op per linear saved at decode)."""
        if x.shape[0] <= self.policy.lowbit_max_rows:
            y = self.qweight.matmul(x)
        elif self.policy.many_rows == "amx" and self.qweight.amx:
            y = self.qweight.amx_matmul(x)
        elif self.dense is not None:
            y = F.linear(x.to(self.dense.dtype), self.dense)
        else:
            y = self._dequantized_gemm(x.to(self.policy.dense_dtype))
        return y if self.bias is None else y + self.bias

    def _dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows, no resident dense copy: dequantize _DEQUANT_ROWS output rows at a
        time and multiply, so the transient stays small (a few MiB, not the whole
        dense matrix)."""
        n = self.out_features
        if n <= _DEQUANT_ROWS:
            return F.linear(x, self.qweight.dequantize(x.dtype))
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        for a in range(0, n, _DEQUANT_ROWS):
            b = min(n, a + _DEQUANT_ROWS)
            torch.matmul(x, self.qweight.dequantize(x.dtype, a, b).t(), out=y[:, a:b])
        return y

    def prefix(self, n: int) -> "QuantLinear":
        """The first n output rows as a QuantLinear sharing this one's weights (a reduced
        LM head: logits of token ids [0, n) only)."""
        return QuantLinear(self.qweight.prefix(n), None if self.bias is None else self.bias[:n],
                           self.policy, None if self.dense is None else self.dense[:n])

    @property
    def nbytes(self) -> int:
        dense = 0 if self.dense is None else self.dense.numel() * self.dense.element_size()
        return self.qweight.nbytes + dense

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, int{self.qweight.bits}, "
                f"dense={'none' if self.dense is None else self.dense.dtype}")


class QuantEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the rows it is asked for."""

    def __init__(self, qweight: QuantWeight) -> None:
        super().__init__()
        self.qweight = qweight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids)


class FileEmbedding(nn.Module):
    """Embedding lookup that decodes the rows it is asked for from a source that is not
    kept resident (the checkpoint's memory map): a step touches only its tokens' rows,
    so the table costs the pages of the tokens seen, not the whole vocabulary.
    `rows(ids ndarray int64 [n]) -> float32 ndarray [n, dim]`."""

    def __init__(self, rows, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self._rows = rows
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(self._rows(ids.reshape(-1).cpu().numpy()))
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the file"
