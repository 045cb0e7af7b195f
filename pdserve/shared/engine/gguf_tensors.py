"""A GGUF file's metadata and its tensors as views of its memory mapping: the tensor table is
found by stepping over the metadata (a vocabulary of 262k strings is skipped by its lengths
alone, where gguf-py's reader builds an object for every entry: ~18 s of Gemma 3's load).

`metadata(path)` gives every key's value but its arrays of strings, which it gives as their
lengths unless asked for (the tokenizer's vocabulary and merges), and the tensors' names.

`tensors(path)` gives each tensor as gguf-py's reader does — `name`, `tensor_type`, and
`data`: F32/F16 (and the integer types) as their values, every block format as its bytes,
(rows, bytes a row) — so gguf.quants.dequantize and weights.pack take it as they are.
"""

from __future__ import annotations

import struct
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

_FORMAT = {0: "B", 1: "b", 7: "?", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 10: "Q", 11: "q", 12: "d"}  # fixed-size
_WIDTH = {kind: struct.calcsize(f"<{code}") for kind, code in _FORMAT.items()}
_STRING, _ARRAY = 8, 9
_ALIGNMENT = 32  # llama.cpp's, unless general.alignment says otherwise


class FileTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray


def _skip(blob: memoryview, pos: int, value_type: int) -> int:
    """The offset just past one metadata value."""
    if value_type in _WIDTH:
        return pos + _WIDTH[value_type]
    if value_type == _STRING:
        return pos + 8 + struct.unpack_from("<Q", blob, pos)[0]
    if value_type == _ARRAY:
        element, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if element in _WIDTH:
            return pos + count * _WIDTH[element]
        for _ in range(count):
            pos = _skip(blob, pos, element)
        return pos
    raise ValueError(f"GGUF metadata value of unknown type {value_type}")


def _string(blob: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(blob: memoryview, pos: int, value_type: int, strings: bool) -> tuple[object, int]:
    """One metadata value and the offset just past it; an array of strings as its length unless `strings`."""
    if value_type in _FORMAT:
        return struct.unpack_from(f"<{_FORMAT[value_type]}", blob, pos)[0], pos + _WIDTH[value_type]
    if value_type == _STRING:
        return _string(blob, pos)
    if value_type != _ARRAY:
        raise ValueError(f"GGUF metadata value of unknown type {value_type}")
    element, count = struct.unpack_from("<IQ", blob, pos)
    if element in _FORMAT:
        return list(struct.unpack_from(f"<{count}{_FORMAT[element]}", blob, pos + 12)), \
            pos + 12 + count * _WIDTH[element]
    if element == _STRING and not strings:
        return count, _skip(blob, pos, value_type)
    values, pos = [], pos + 12
    for _ in range(count):
        value, pos = _value(blob, pos, element, strings)
        values.append(value)
    return values, pos


def _header(path: Path, blob: memoryview, string_arrays: tuple[str, ...] | None) -> tuple[dict, int, int]:
    """(metadata, tensor count, offset of the tensor table); values read only where `string_arrays`
    is not None (those keys' strings too)."""
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    _, count, kvs = struct.unpack_from("<IQQ", blob, 4)
    pos, meta = 24, {}
    for _ in range(kvs):
        key, pos = _string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        if string_arrays is not None:
            meta[key], pos = _value(blob, pos + 4, value_type, key in string_arrays)
            continue
        if key == "general.alignment":
            meta[key] = struct.unpack_from("<I", blob, pos + 4)[0]
        pos = _skip(blob, pos + 4, value_type)
    return meta, count, pos


def metadata(path: Path, string_arrays: tuple[str, ...] = ()) -> tuple[dict, tuple[str, ...]]:
    """The file's metadata (its arrays of strings as their lengths, but `string_arrays`'s) and tensor names."""
    blob = np.memmap(path, mode="r", dtype=np.uint8).data
    meta, count, pos = _header(path, blob, string_arrays)
    table, _ = _table(blob, count, pos)
    return meta, tuple(name for name, *_ in table)


def _table(blob: memoryview, count: int, pos: int) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    """The tensor table: (name, shape in numpy's order, ggml type, offset in the data) each, and the
    offset just past the table."""
    table = []
    for _ in range(count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, pos + 4)))
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        table.append((name, shape, kind, offset))
    return table, pos


def tensors(path: Path) -> list[FileTensor]:
    import gguf

    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    blob = mapped.data
    meta, count, pos = _header(path, blob, None)
    alignment = meta.get("general.alignment", _ALIGNMENT)
    table, pos = _table(blob, count, pos)
    start = (pos + alignment - 1) // alignment * alignment
    values = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
              gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
              gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
              gguf.GGMLQuantizationType.I64: np.int64}
    out = []
    for name, shape, ggml_type, offset in table:
        kind = gguf.GGMLQuantizationType(ggml_type)
        per, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = prod(shape) // per * size
        raw = mapped[start + offset:start + offset + nbytes]
        if kind in values:
            data = raw.view(values[kind]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // per * size)
        out.append(FileTensor(name, kind, data))
    return out
