"""A GGUF file's tensors as views of its memory mapping, without its metadata's values: the
tensor table is found by stepping over the metadata (a vocabulary of 262k strings is skipped
by its lengths alone, where gguf-py's reader builds an object for every entry: ~18 s of
Gemma 3's load).

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

_WIDTH = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}  # fixed-size value types
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


def tensors(path: Path) -> list[FileTensor]:
    import gguf

    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    blob = mapped.data
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    _, count, kvs = struct.unpack_from("<IQQ", blob, 4)
    pos, alignment = 24, _ALIGNMENT
    for _ in range(kvs):
        key, pos = _string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", blob, pos + 4)
        pos = _skip(blob, pos + 4, value_type)
    table = []
    for _ in range(count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, pos + 4)))  # numpy's order
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        table.append((name, shape, gguf.GGMLQuantizationType(kind), offset))
    start = (pos + alignment - 1) // alignment * alignment
    values = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
              gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
              gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
              gguf.GGMLQuantizationType.I64: np.int64}
    out = []
    for name, shape, kind, offset in table:
        per, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = prod(shape) // per * size
        raw = mapped[start + offset:start + offset + nbytes]
        if kind in values:
            data = raw.view(values[kind]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // per * size)
        out.append(FileTensor(name, kind, data))
    return out
