"""A GGUF file's metadata as Python values and its tensors as views of the file, read once.

gguf's own `GGUFReader` makes a numpy memmap view for every element of every metadata
array: SmolLM2's 49,152 tokens and 48,900 merges took ~2.5 s a reader, and the tokenizer
and the weights each made one, the largest part of a warm restart. Here the metadata is
unpacked with `struct` straight from one memmap of the file, and each tensor's data is a
view of it, shaped as `GGUFReader` shapes it, so that `gguf.quants.dequantize` takes it.
"""

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types: struct format of each scalar type (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numbers; every other type is quantized blocks of bytes
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # numbers, or a quantized type's bytes, as GGUFReader gives them


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # metadata key -> int, float, bool, str or list of them
    tensors: list[GGUFTensor]


class _Cursor:
    """Little-endian values read in order from a bytes buffer."""

    def __init__(self, buffer: memoryview):
        self.buffer, self.offset = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.offset + n
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        text = str(self.buffer[self.offset : end], "utf-8")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _SCALARS:
                raise ValueError(f"unsupported GGUF array item type {item}")
            fmt = "<" + _SCALARS[item]
            size = struct.calcsize(fmt) * count
            if self.offset + size > len(self.buffer):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buffer, fmt, count, self.offset).tolist()
            self.offset += size
            return values
        if kind not in _SCALARS:
            raise ValueError(f"unsupported GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file (versions 2 and 3, little-endian); ValueError or struct.error if
    it is not one."""
    data = np.memmap(path, np.uint8, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(cursor.buffer[:4]) != MAGIC:
        raise ValueError("GGUF magic invalid")
    cursor.offset = 4
    version = cursor.scalar("I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
    fields = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
        infos.append((name, GGMLQuantizationType(cursor.scalar("I")), dims, cursor.scalar("Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid alignment {alignment!r}: must be a power of two")
    start = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, kind, dims, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        block, size = GGML_QUANT_SIZES[kind]
        num_bytes = int(np.prod(dims, dtype=np.int64)) * size // block
        begin = start + offset
        if begin + num_bytes > data.size:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(reversed(dims))
        raw = data[begin : begin + num_bytes]
        if kind in _PLAIN:
            array = raw.view(_PLAIN[kind]).reshape(shape)
        else:
            array = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, dims, array))
    return GGUFFile(fields, tensors)

