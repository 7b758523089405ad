"""A lean GGUF reader: the metadata and the tensor index, a few Python objects per key.

`gguf.GGUFReader` keeps every element of every metadata array as its own numpy views (two
per string): for a 150k-token vocabulary with its merges and token types that is about a
million small objects, ~450 MiB at once, and once freed, the survivors allocated among
them (the model being built meanwhile) keep Python's half-empty arenas resident. This
reader walks the same format with the `gguf` library's constants and types and keeps, per
metadata key, its scalar value or where its array lies in the file. An array is decoded
when asked (`get`): strings into one list of str, numbers into one numpy array; nothing
of it is cached here, so the caller decides how long it lives.

Tensors are indexed as `gguf`'s are (`GGUFTensorInfo`: name, type, shape in GGUF order,
sizes, `data`, a view of the file's memory map shaped as gguf shapes it, and the file's
path and the data's offset for reads that bypass the map). Only
little-endian files are read (what llama.cpp writes on every host we run on).
"""
from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, \
    GGMLQuantizationType, GGUFValueType, quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)

# Fixed-size value types: struct format (little-endian) and numpy dtype.
_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
}
# Tensor types whose data gguf views as typed elements; every other type as raw bytes.
_TYPED_TENSORS = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class TruncatedGGUF(ValueError):
    """The file ends before its header or a tensor's data does."""


class GGUFTensorInfo(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]         # GGUF order: ne0 (the contiguous dimension) first
    n_elements: int
    n_bytes: int
    data_offset: int               # absolute, in the file
    data: np.ndarray               # a view of the file's map (row-major, gguf's shape)
    path: str                      # the file (for reads that bypass the map)


class _Array(NamedTuple):
    """Where an array value lies: element type, count, first element's offset."""
    item_type: GGUFValueType
    count: int
    offset: int


class GGUFFile:
    """One GGUF file's metadata and tensor index over a read-only memory map (`data`,
    np.memmap of uint8). Nothing is mutated after construction; `get` decodes arrays
    afresh on every call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        self._size = len(self._buf)
        self._values: dict[str, Any] = {}
        if self._unpack("<I", 0) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._unpack("<I", 4)
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError("big-endian GGUF files are not supported")
            raise ValueError(f"GGUF version {version} is not supported "
                             f"(supported: {SUPPORTED_VERSIONS})")
        self.version = version
        n_tensors, n_kv = self._unpack("<Q", 8), self._unpack("<Q", 16)
        offs = 24
        for _ in range(n_kv):
            key, offs = self._string(offs)
            vtype = self._value_type(self._unpack("<I", offs))
            if key in self._values:
                raise ValueError(f"duplicate metadata key {key!r}")
            self._values[key], offs = self._value(vtype, offs + 4)
        infos = []
        for _ in range(n_tensors):
            name, offs = self._string(offs)
            n_dims = self._unpack("<I", offs)
            dims = struct.unpack_from(f"<{n_dims}Q", self._need(offs + 4, 8 * n_dims),
                                      offs + 4)
            offs += 4 + 8 * n_dims
            raw_type, rel = self._unpack("<I", offs), self._unpack("<Q", offs + 4)
            offs += 12
            infos.append((name, dims, raw_type, rel))
        align = self._values.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise ValueError(f"bad general.alignment {align!r} (a power of two expected)")
        self.alignment = align
        self.data_offset = -(-offs // align) * align
        self.tensors: list[GGUFTensorInfo] = []
        names: set[str] = set()
        for name, dims, raw_type, rel in infos:
            if name in names:
                raise ValueError(f"duplicate tensor {name!r}")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, raw_type, rel))

    # -- metadata ----------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._values

    def keys(self) -> list[str]:
        return list(self._values)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (`default` when absent): a Python scalar or str;
        an array of strings as a new list of str; an array of numbers or bools as a new
        numpy array; an array of arrays as a list of those."""
        value = self._values.get(key, default)
        return self._decode_array(value) if isinstance(value, _Array) else value

    def array_len(self, key: str) -> int | None:
        """Number of elements of array `key` without decoding it (None: absent or not
        an array)."""
        value = self._values.get(key)
        return value.count if isinstance(value, _Array) else None

    # -- parsing -----------------------------------------------------------------------
    def _need(self, offset: int, nbytes: int) -> memoryview:
        if offset + nbytes > self._size:
            raise TruncatedGGUF(f"the header needs byte {offset + nbytes} but the file has "
                                f"{self._size} bytes")
        return self._buf

    def _unpack(self, fmt: str, offset: int) -> Any:
        return struct.unpack_from(fmt, self._need(offset, struct.calcsize(fmt)), offset)[0]

    def _string(self, offset: int) -> tuple[str, int]:
        n = self._unpack("<Q", offset)
        start = offset + 8
        self._need(start, n)
        return str(self._buf[start:start + n], "utf-8"), start + n

    @staticmethod
    def _value_type(raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"unknown GGUF value type {raw}") from None

    def _value(self, vtype: GGUFValueType, offset: int) -> tuple[Any, int]:
        """(value, offset after it): scalars and strings decoded, arrays as `_Array`
        (their strings walked over, not decoded)."""
        if vtype == GGUFValueType.STRING:
            return self._string(offset)
        if vtype in _SCALARS:
            fmt, dt = _SCALARS[vtype]
            return self._unpack(fmt, offset), offset + dt.itemsize
        item = self._value_type(self._unpack("<I", offset))
        count = self._unpack("<Q", offset + 4)
        start = offset + 12
        return _Array(item, count, start), self._skip(item, count, start)

    def _skip(self, item: GGUFValueType, count: int, offset: int) -> int:
        """Offset after `count` values of type `item` starting at `offset`."""
        if item in _SCALARS:
            end = offset + count * _SCALARS[item][1].itemsize
            self._need(offset, end - offset)
            return end
        for _ in range(count):
            if item == GGUFValueType.STRING:
                offset += 8 + self._unpack("<Q", offset)
            else:
                offset = self._value(item, offset)[1]
        self._need(offset, 0)
        return offset

    def _decode_array(self, arr: _Array) -> Any:
        if arr.item_type in _SCALARS:
            dt = _SCALARS[arr.item_type][1]
            return np.frombuffer(self._buf, dt, arr.count, arr.offset).copy()
        out, offs = [], arr.offset
        for _ in range(arr.count):
            if arr.item_type == GGUFValueType.STRING:
                s, offs = self._string(offs)
            else:
                s, offs = self._value(arr.item_type, offs)
                s = self._decode_array(s) if isinstance(s, _Array) else s
            out.append(s)
        return out

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, rel: int
                ) -> GGUFTensorInfo:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block
        start = self.data_offset + rel
        np_dims = tuple(reversed(dims))
        if qtype in _TYPED_TENSORS:
            dtype, count = np.dtype(_TYPED_TENSORS[qtype]), n_elements
        else:
            dtype, count = np.dtype(np.uint8), n_bytes
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        end = start + count * dtype.itemsize
        if end > self._size:
            raise TruncatedGGUF(f"tensor {name} ends at byte {end} but the file has "
                                f"{self._size} bytes")
        data = self.data[start:end].view(dtype).reshape(np_dims)
        return GGUFTensorInfo(name, qtype, tuple(int(d) for d in dims), n_elements, n_bytes,
                              start, data, self.path)
