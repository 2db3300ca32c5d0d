"""The tensor table of a GGUF file, read without its metadata values: names, types, shapes, bytes (memory-mapped).

``gguf.GGUFReader`` builds a numpy view for every metadata element, which for a 49,152-token vocabulary and its
merges is about a million views: tens of seconds on a 2-core CPU, minutes under load, at every start. Serving
needs only the tensor table, so this walks the metadata with ``struct`` (skipping values, keeping
``general.architecture`` and ``general.alignment``) and then reads the tensor infos. The layout is the GGUF
specification's (ggml/docs/gguf.md, versions 2 and 3): header, key/value pairs, tensor infos, padding to the
alignment, tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """One tensor of the file.

    Attributes:
        name: e.g. ``blk.0.attn_q.weight``.
        tensor_type: ``gguf.GGMLQuantizationType``.
        shape: ggml's order, fastest first: ``(in, out)`` for a matrix (``gguf.GGUFReader``'s ``shape``).
        data: uint8 ``[rows, bytes_per_row]``, a read-only view of the mapped file.
    """

    name: str
    tensor_type: object
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(slots=True, frozen=True)
class GGUFIndex:
    """A GGUF file's architecture and tensors, by name."""

    architecture: str
    tensors: dict[str, GGUFTensor]


class _Cursor:
    """Little-endian reads from the mapped file, advancing an offset."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("Q")
        text = bytes(self.buffer[self.offset:self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return text

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            length = self.unpack("Q")  # read first: it advances the offset
            self.offset += length
        elif value_type == _ARRAY:
            element_type, count = self.unpack("IQ")
            if element_type in _SCALAR_SIZES:
                self.offset += _SCALAR_SIZES[element_type] * count
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        elif value_type in _SCALAR_SIZES:
            self.offset += _SCALAR_SIZES[value_type]
        else:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self.offset}")


def read_index(path: Path) -> GGUFIndex:
    """The tensor table of the GGUF file at ``path``.

    Raises:
        ValueError: not a GGUF file, a version before 2, or a tensor type the ``gguf`` package does not know.
    """
    import gguf

    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.offset = 4
    version, num_tensors, num_values = cursor.unpack("IQQ")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} (kvserve reads versions 2 and 3)")
    architecture, alignment = "", _DEFAULT_ALIGNMENT
    for _ in range(num_values):
        key = cursor.string()
        value_type = cursor.unpack("I")
        if key == "general.architecture" and value_type == _STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and value_type == _UINT32:
            alignment = cursor.unpack("I")
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = cursor.unpack("I")
        shape = tuple(int(n) for n in struct.unpack_from(f"<{dims}Q", buffer, cursor.offset))
        cursor.offset += 8 * dims
        type_id, offset = cursor.unpack("IQ")
        infos.append((name, gguf.GGMLQuantizationType(type_id), shape, offset))
    start = -(-cursor.offset // alignment) * alignment  # tensor data begins at the next multiple of the alignment
    tensors = {}
    for name, tensor_type, shape, offset in infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        row_bytes = shape[0] // block_size * type_size
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        data = buffer[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, tensor_type, shape, data)
    return GGUFIndex(architecture, tensors)
