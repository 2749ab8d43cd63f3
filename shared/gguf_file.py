"""A GGUF file's metadata and tensor table, read fast: what the loader and the tokenizer need.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value: for SmolLM2's
98,000 vocabulary and merge strings that took 5.4 s of each model load and of each gateway's
start (its tokenizer), on a 2-vCPU Xeon, 2026-11-27. Here the header is parsed with `struct`
from one memory map (strings are sliced from bytes, numeric arrays read by `np.frombuffer`), in
a few tens of ms. The result answers the part of `GGUFReader`'s interface this project uses:
`fields[key].contents()` and `tensors` (name, tensor_type, shape innermost dimension first,
data as a read-only view of the file in the reader's dtype and shape). Files this does not
read (big-endian, a version before 2) are handed to `gguf.GGUFReader` itself.

Format: the GGUF specification in ggml's docs/gguf.md (magic, version, tensor and key-value
counts; each key-value as a length-prefixed key, a value type and the value; arrays as an item
type, a count and the items; then each tensor's name, dimensions, type and offset; the data
starts at the next multiple of `general.alignment`, default 32).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
_DEFAULT_ALIGNMENT = 32
_NEWEST_VERSION = 3

# Scalar value types: their struct format (little-endian) and numpy dtype.
_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
# Tensor types read as their own dtype; any other is bytes (`quant_shape_to_byte_shape`).
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class Undecodable:
    """A string value that is not UTF-8: an error only if someone reads it (as with gguf's
    reader, which decodes when asked), not for the whole file."""

    raw: bytes


@dataclass(frozen=True)
class MetadataField:
    name: str
    value: Any  # str, int, float, bool, or a list of them (arrays of arrays nested)

    def contents(self) -> Any:
        values = self.value if isinstance(self.value, list) else [self.value]
        if any(isinstance(value, Undecodable) for value in values):
            raise ValueError(f"GGUF metadata {self.name!r} holds a string that is not UTF-8")
        return self.value


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dimensions, innermost first (as GGUF stores them)
    n_elements: int
    n_bytes: int
    data: np.ndarray  # read-only view of the file


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, MetadataField]
    tensors: list[TensorInfo]


# What the loader and the tokenizer read: this module's file, or gguf's reader (the files this
# module hands over, and tests that build a reader themselves).
GGUFSource = GGUFFile | gguf.GGUFReader
GGUFTensor = TensorInfo | gguf.ReaderTensor


def read_gguf(path: str | os.PathLike) -> GGUFSource:
    """The file's metadata and tensor table; ValueError when it is not a GGUF file."""
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if len(mapped) < 24 or struct.unpack_from("<I", mapped, 0)[0] != _MAGIC:
        raise ValueError(f"{os.fspath(path)} is not a GGUF file (no GGUF magic)")
    version = struct.unpack_from("<I", mapped, 4)[0]
    if version < 2 or version > 0xFFFF:  # a big-endian file reads its version byte-swapped
        mapped.close()
        return gguf.GGUFReader(path)
    if version > _NEWEST_VERSION:
        raise ValueError(f"{os.fspath(path)} is GGUF version {version}; this reads 2 and 3")
    return _Parser(mapped).parse()


class _Parser:
    def __init__(self, mapped: mmap.mmap) -> None:
        self._buffer = mapped
        self._offset = 0

    def parse(self) -> GGUFFile:
        _magic, version, num_tensors, num_fields = self._unpack("<IIQQ")
        fields = {
            "GGUF.version": MetadataField("GGUF.version", version),
            "GGUF.tensor_count": MetadataField("GGUF.tensor_count", num_tensors),
            "GGUF.kv_count": MetadataField("GGUF.kv_count", num_fields),
        }
        for _ in range(num_fields):
            key = self._key()
            if key in fields:
                raise ValueError(f"GGUF file sets metadata {key!r} twice")
            fields[key] = MetadataField(key, self._value(GGUFValueType(self._unpack("<I")[0])))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        if len({info[0] for info in infos}) != len(infos):
            raise ValueError("GGUF file names a tensor twice")
        alignment_field = fields.get("general.alignment")
        alignment = alignment_field.value if alignment_field else _DEFAULT_ALIGNMENT
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"GGUF general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-self._offset // alignment) * alignment
        tensors = [self._tensor(info, data_start) for info in infos]
        return GGUFFile(fields, tensors)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _key(self) -> str:
        (length,) = self._unpack("<Q")
        start = self._offset
        self._offset += length
        return self._buffer[start : self._offset].decode("utf-8")

    def _string(self) -> str | Undecodable:
        (length,) = self._unpack("<Q")
        start = self._offset
        self._offset += length
        return _decoded(self._buffer[start : self._offset])

    def _value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type == GGUFValueType.ARRAY:
            item_type, count = self._unpack("<IQ")
            return self._array(GGUFValueType(item_type), count)
        fmt, _ = _SCALARS[value_type]
        return self._unpack(fmt)[0]

    def _array(self, item_type: GGUFValueType, count: int) -> list:
        if item_type in _SCALARS:
            dtype = _SCALARS[item_type][1]
            values = np.frombuffer(self._buffer, dtype, count, self._offset)
            self._offset += count * dtype.itemsize
            return values.tolist()
        if item_type == GGUFValueType.STRING:
            return self._strings(count)
        return [self._value(item_type) for _ in range(count)]  # arrays of arrays

    def _strings(self, count: int) -> list[str | Undecodable]:
        """`count` length-prefixed strings: one loop of slices, no numpy view per string."""
        buffer, offset, strings = self._buffer, self._offset, []
        unpack_length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = unpack_length(buffer, offset)
            offset += 8
            strings.append(_decoded(buffer[offset : offset + length]))
            offset += length
        self._offset = offset
        return strings

    def _tensor_info(self) -> tuple[str, np.ndarray, GGMLQuantizationType, int]:
        name = self._key()
        (num_dims,) = self._unpack("<I")
        dims = np.frombuffer(self._buffer, np.dtype("<u8"), num_dims, self._offset).copy()
        self._offset += 8 * num_dims
        raw_type, offset = self._unpack("<IQ")
        return name, dims, GGMLQuantizationType(raw_type), offset

    def _tensor(
        self, info: tuple[str, np.ndarray, GGMLQuantizationType, int], data_start: int
    ) -> TensorInfo:
        name, dims, tensor_type, offset = info
        num_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        num_bytes = num_elements * type_size // block_size
        np_shape = tuple(int(dim) for dim in reversed(dims.tolist()))
        dtype = _PLAIN_TENSOR_DTYPES.get(tensor_type)
        if dtype is None:
            dtype = np.uint8
            np_shape = quant_shape_to_byte_shape(np_shape, tensor_type)
        count = num_bytes // np.dtype(dtype).itemsize
        data = np.frombuffer(self._buffer, dtype, count, data_start + offset).reshape(np_shape)
        return TensorInfo(name, tensor_type, dims, num_elements, num_bytes, data)


def _decoded(raw: bytes) -> str | Undecodable:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return Undecodable(raw)
