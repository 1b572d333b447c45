"""Read a GGUF file: its header's keys and values, and its tensors as views of one read-only memory map.

gguf.GGUFReader makes a numpy view per string and per part of every field: a 1.5B Qwen file's 151,936 tokens
and ~151k merges took it 7.4 s and ~500 MB. This reader decodes each value once, arrays of numbers in bulk
and arrays of strings in one loop, and checks every length against the file as it goes, so a bad file fails
with a ModelFileError naming the file and the key or tensor at fault.

The format (GGUF v2 and v3, little-endian; llama.cpp's docs/gguf.md, gguf-py's gguf_reader.py): magic "GGUF",
version u32, tensor count u64, key/value count u64; each key a string (u64 length, UTF-8 bytes), its value
type u32 and value (an array: item type u32, count u64, items); each tensor's name, n_dims u32, dims u64
(innermost first), type u32 and offset u64 into the data, which starts at the next multiple of
general.alignment (32 by default).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from specpool.engine.runtime.hf_config import ModelFileError

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS: llama.cpp refuses more
MAX_NESTING = 8  # arrays of arrays (llama.cpp reads none): a bound, so a crafted file cannot exhaust the stack
HEADER = "GGUF header"  # the field errors name where no key or tensor is at fault

# The fixed-size value types, as numpy reads them.
NUMBERS = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# ... and as struct reads one (numpy's one-letter codes differ: its uint64 is "L").
_SCALARS = {t: struct.Struct("<" + c) for t, c in zip(NUMBERS, "BbHhIif?Qqd", strict=True)}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# Tensor types whose data is given as elements (as GGUFReader gives them); the others, blocks of weights
# (and BF16), as bytes: [..., bytes per row].
ELEMENTS = {
    GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"), GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"), GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # outermost first ([out, in] for a matrix): the file's dims reversed
    offset: int  # of its first byte in the file
    n_bytes: int
    data: np.ndarray  # read-only view of the file: [*shape] elements (ELEMENTS), else uint8 [*shape[:-1], row bytes]


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    # key -> value: int, float, bool or str; an array of numbers as a read-only np.ndarray, of strings as a
    # list[str], of arrays as a list of those.
    fields: dict[str, Any]
    types: dict[str, tuple[GGUFValueType, ...]]  # key -> its value type, then the item types of an array's
    tensors: dict[str, GGUFTensor]  # in the file's order
    alignment: int
    data_offset: int  # where the tensor data starts

    @staticmethod
    def read(path: str | Path) -> GGUFFile:
        """The file's header, with its tensors mapped (their pages are read when touched). Raises
        ModelFileError naming the file and the key or tensor where the file is not a GGUF this reads."""
        path = Path(path)
        if path.stat().st_size == 0:  # np.memmap refuses to map an empty file
            raise ModelFileError(path, HEADER, "the file is empty: not a GGUF")
        return _Parser(path, np.memmap(path, dtype=np.uint8, mode="r")).file()


class _Parser:
    """Reads the header front to back; `at` is the next byte, `field` what an error here names."""

    def __init__(self, path: Path, data: np.memmap):
        self.path, self.data, self.buf, self.size = path, data, memoryview(data), len(data)
        self.at, self.field = 0, HEADER

    def fail(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, self.field, problem)

    def past_end(self, what: str, n: int, at: int) -> ModelFileError:
        return self.fail(f"{what} runs past the end of the file ({n} bytes at byte {at} of {self.size}): "
                         "truncated or corrupt")

    def take(self, n: int, what: str) -> int:
        """Steps over the next n bytes, which must lie in the file; returns where they start."""
        start = self.at
        if n > self.size - start:
            raise self.past_end(what, n, start)
        self.at = start + n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        start = self.take(self.u64(f"the length of {what}"), what)
        try:
            return str(self.buf[start : self.at], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e})") from e

    def file(self) -> GGUFFile:
        magic = bytes(self.buf[self.take(4, "the magic number") : self.at])
        if magic != b"GGUF":
            raise self.fail(f"magic {magic!r}, not b'GGUF': not a GGUF file")
        version = self.u32("the version")
        if version & 0xFFFF == 0 and version:  # as GGUFReader tells a big-endian file (which ggml rarely writes)
            raise self.fail(f"version {version:#010x}: a big-endian file, not supported (little-endian only)")
        if version not in VERSIONS:
            raise self.fail(f"version {version} is not supported (supported: {', '.join(map(str, VERSIONS))})")
        n_tensors, n_keys = self.u64("the tensor count"), self.u64("the key count")

        fields, types = {}, {}
        for i in range(n_keys):
            self.field = HEADER
            key = self.string(f"the name of key {i + 1} of {n_keys}")
            self.field = key
            if key in fields:
                raise self.fail("a second value for this key")
            types[key], fields[key] = self.value(self.u32("the value type"))

        self.field = HEADER
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in fields and (types["general.alignment"] != (GGUFValueType.UINT32,)
                                              or alignment == 0 or alignment & (alignment - 1)):
            self.field = "general.alignment"
            raise self.fail(f"{alignment!r} of type {types['general.alignment'][0].name}: must be a power of two, "
                            "of type UINT32")
        infos = [self.tensor_info(i, n_tensors) for i in range(n_tensors)]
        data_offset = -(-self.at // alignment) * alignment
        tensors = {}
        for name, kind, dims, offset in infos:
            self.field = name
            if name in tensors:
                raise self.fail("a second tensor of this name")
            tensors[name] = self.tensor(name, kind, dims, data_offset + offset)
        return GGUFFile(self.path, version, fields, types, tensors, alignment, data_offset)

    def value(self, kind: int, depth: int = 1) -> tuple[tuple[GGUFValueType, ...], Any]:
        """(the value's type and item types, the value) of the value of this type at `at`; an array is the
        `depth`th of arrays nested."""
        if kind in _SCALARS:
            scalar = _SCALARS[kind]
            return (GGUFValueType(kind),), scalar.unpack_from(self.buf, self.take(scalar.size, "the value"))[0]
        if kind == GGUFValueType.STRING:
            return (GGUFValueType.STRING,), self.string("the string")
        if kind != GGUFValueType.ARRAY:
            raise self.fail(f"unknown value type {kind}")
        item, count = self.u32("the array's item type"), self.u64("the array's length")
        if item in NUMBERS:
            dtype = NUMBERS[item]
            start = self.take(count * dtype.itemsize, f"the array of {count} {GGUFValueType(item).name}")
            return (GGUFValueType.ARRAY, GGUFValueType(item)), np.frombuffer(self.buf, dtype, count, start)
        if item == GGUFValueType.STRING:
            return (GGUFValueType.ARRAY, GGUFValueType.STRING), self.strings(count)
        if item == GGUFValueType.ARRAY:  # the items' own item types are not checked to agree
            if depth == MAX_NESTING:
                raise self.fail(f"arrays nested more than {MAX_NESTING} deep")
            if 12 * count > self.size - self.at:  # each at least an item type and a length
                raise self.past_end(f"the array of {count} arrays", 12 * count, self.at)
            items = [self.value(GGUFValueType.ARRAY, depth + 1) for _ in range(count)]
            inner = items[0][0] if items else (GGUFValueType.ARRAY,)
            return (GGUFValueType.ARRAY, *inner), [v for _, v in items]
        raise self.fail(f"unknown array item type {item}")

    def strings(self, count: int) -> list[str]:
        """An array's `count` strings, [i] at index i: one tight loop, the hot path of a 150k-token vocabulary."""
        if 8 * count > self.size - self.at:  # each at least its length
            raise self.past_end(f"the array of {count} strings", 8 * count, self.at)
        buf, size, at, unpack = self.buf, self.size, self.at, _U64.unpack_from
        out = []
        for i in range(count):
            if at > size - 8:
                raise self.past_end(f"the length of string [{i}] of {count}", 8, at)
            n = unpack(buf, at)[0]
            if n > size - at - 8:
                raise self.past_end(f"string [{i}] of {count}", n, at + 8)
            at += 8
            try:
                out.append(str(buf[at : at + n], "utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"string [{i}] of {count} is not UTF-8 ({e})") from e
            at += n
        self.at = at
        return out

    def tensor_info(self, i: int, count: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        """(name, type, dims innermost first, offset into the data) of the next tensor's info."""
        self.field = HEADER
        name = self.string(f"the name of tensor {i + 1} of {count}")
        self.field = name
        n_dims = self.u32("the dimension count")
        if n_dims > MAX_DIMS:
            raise self.fail(f"{n_dims} dimensions (at most {MAX_DIMS})")
        dims = tuple(np.frombuffer(self.buf, "<u8", n_dims, self.take(8 * n_dims, "the shape")).tolist())
        kind = self.u32("the tensor type")
        try:
            kind = GGMLQuantizationType(kind)
        except ValueError:
            raise self.fail(f"unknown tensor type {kind}") from None
        return name, kind, dims, self.u64("the data offset")

    def tensor(self, name: str, kind: GGMLQuantizationType, dims: tuple[int, ...], start: int) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        if dims and dims[0] % block:
            raise self.fail(f"rows of {dims[0]} weights are not whole {kind.name} blocks of {block}")
        n_bytes = math.prod(dims) // block * block_bytes
        if start + n_bytes > self.size:
            raise self.fail(f"{kind.name} {list(shape)} data (bytes {start} to {start + n_bytes}) runs past the "
                            f"end of the file ({self.size} bytes): truncated")
        data = self.data[start : start + n_bytes]
        if kind in ELEMENTS:
            data = data.view(ELEMENTS[kind]).reshape(shape)
        else:
            data = data.reshape(*shape[:-1], dims[0] // block * block_bytes if dims else n_bytes)
        return GGUFTensor(name, kind, shape, start, n_bytes, data)
