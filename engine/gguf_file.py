"""A GGUF file read as untrusted input: its metadata, its tensor table, and its tensors memory-mapped.

The layout is the GGUF specification's (ggml/docs/gguf.md, versions 2 and 3), little-endian:

    "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata      key: string | value type u32 | value                          (metadata count times)
    tensor infos  name: string | n_dims u32 | n_dims x u64 | ggml type u32 | offset u64   (tensor count times)
    padding to general.alignment (32 unless the metadata says otherwise)
    tensor data   each tensor at its offset from here, the offsets multiples of the alignment

A string is a u64 byte length and that many UTF-8 bytes; an array is an element type u32, a count u64 and the
elements. Users point ``--model`` at files from the internet, so every length, count, dimension and offset is
checked against the bytes the file has before anything is read or allocated by it: a truncated or hostile file
ends in one ``GGUFError`` naming what is wrong and at which byte, never in a crash, a hang or an allocation the
file's own size does not bound. Nothing is unpickled: values are read with ``struct``, tensors are numpy views
of the mapping.

The mapping is private (copy-on-write): tensors are writable arrays whose pages stay the page cache's until
someone writes, and a tensor copied elsewhere (packed into a kernel's order) can give its pages back
(``GGUFFile.release``), so resident memory holds each weight once.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits; llama.cpp writes 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with the terminating NUL
MAX_ALIGNMENT = 1 << 16
MAX_ELEMENTS = 1 << 50  # a tensor larger than any file could hold: refused before its size overflows anything

# GGUFValueType -> struct format of a fixed-size value
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, a type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # an empty name, one dimension, a type, an offset


class GGUFError(ValueError):
    """A file that is not a well-formed GGUF file; the message names the file, the fault and where."""


@dataclass(slots=True, frozen=True)
class GGUFArray:
    """A metadata array, located but not decoded (a vocabulary's strings are decoded only when asked for).

    Attributes:
        element_type: its GGUFValueType (a scalar type or string; arrays of arrays are refused).
        count: its elements.
    """

    element_type: int
    count: int
    _buffer: mmap.mmap
    _start: int  # byte of the first element
    _path: str

    def values(self) -> list:
        """The elements as Python values (``str`` for strings, decoded as strict UTF-8).

        Raises:
            GGUFError: a string that is not UTF-8.
        """
        if self.element_type != _STRING:
            fmt = _SCALARS[self.element_type]
            return np.frombuffer(self._buffer, dtype=np.dtype("<" + fmt), count=self.count,
                                 offset=self._start).tolist()
        out, pos, buffer = [], self._start, self._buffer
        for index in range(self.count):  # lengths were checked against the file when it was read
            (length,) = _U64.unpack_from(buffer, pos)
            try:
                out.append(str(buffer[pos + 8:pos + 8 + length], "utf-8"))
            except UnicodeDecodeError:
                raise GGUFError(f"{self._path}: element {index} of an array at byte {self._start} is not UTF-8") \
                    from None
            pos += 8 + length
        return out

    def __len__(self) -> int:
        return self.count


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """One tensor of the file.

    Attributes:
        name: e.g. ``blk.0.attn_q.weight``.
        ggml_type: its ``gguf.GGMLQuantizationType``.
        shape: ggml's order, fastest first: ``(in, out)`` for a matrix (as ``gguf.GGUFReader``'s ``shape``).
        offset: its first byte in the file.
        nbytes: its bytes.
    """

    name: str
    ggml_type: object
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    _array: np.ndarray  # uint8 view of the whole mapping

    @property
    def rows(self) -> int:
        """Rows of ``shape[0]`` values: the product of the other dimensions."""
        count = 1
        for n in self.shape[1:]:
            count *= n
        return count

    def data(self) -> np.ndarray:
        """The stored bytes, uint8 ``[rows, bytes_per_row]``: a view of the mapped file, no copy."""
        return self._array[self.offset:self.offset + self.nbytes].reshape(self.rows, self.nbytes // self.rows)


@dataclass(slots=True)
class GGUFFile:
    """A checked GGUF file (``read_gguf``).

    Attributes:
        path: the file.
        version: 2 or 3.
        metadata: key -> int | float | bool | str | GGUFArray.
        tensors: name -> GGUFTensor, in file order.
        identity: hex digest of the file's size and header bytes (metadata and tensor table): what a cache of
            anything derived from the metadata (a converted tokenizer) is keyed by.
    """

    path: Path
    version: int
    metadata: dict
    tensors: dict[str, GGUFTensor]
    identity: str
    _buffer: mmap.mmap
    _array: np.ndarray  # uint8 view of the whole mapping

    @property
    def architecture(self) -> str:
        """``general.architecture`` ("" when absent)."""
        value = self.metadata.get("general.architecture", "")
        return value if isinstance(value, str) else ""

    def get(self, key: str, kind: type | tuple[type, ...], default=None):
        """The value of ``key`` if it has the Python type ``kind`` (bool is not an int here), else ``default``
        when it is absent.

        Raises:
            GGUFError: the key holds a value of another type.
        """
        if key not in self.metadata:
            return default
        value = self.metadata[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise GGUFError(f"{self.path}: metadata {key} is a {type(value).__name__}, expected "
                            f"{' or '.join(k.__name__ for k in kinds)}")
        return value

    def maps(self, address: int) -> bool:
        """Whether memory at ``address`` (a tensor's ``data_ptr()``) lies in this file's mapping."""
        start = self._array.ctypes.data
        return start <= address < start + self._array.size

    def release(self, tensor: GGUFTensor) -> None:
        """Give back the pages of ``tensor`` that only it uses (after it was copied elsewhere): resident memory
        then holds the copy alone. Reading the tensor again reads the file again."""
        page = mmap.PAGESIZE
        start = -(-tensor.offset // page) * page
        end = (tensor.offset + tensor.nbytes) // page * page
        if end > start and hasattr(self._buffer, "madvise"):
            self._buffer.madvise(mmap.MADV_DONTNEED, start, end - start)


class _Cursor:
    """Checked little-endian reads from the mapping, advancing ``pos``."""

    def __init__(self, buffer: mmap.mmap, size: int, path: str) -> None:
        self.buffer, self.size, self.path, self.pos = buffer, size, path, 0

    def fail(self, what: str, at: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (byte {self.pos if at is None else at})")

    def need(self, count: int, what: str) -> None:
        if count > self.size - self.pos:
            raise self.fail(f"truncated: {what} needs {count} bytes, {self.size - self.pos} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.buffer, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.buffer, self.pos)
        self.pos += 8
        return value

    def string(self, what: str) -> str:
        start = self.pos
        length = self.u64(f"{what}'s length")
        self.need(length, what)
        try:
            text = str(self.buffer[self.pos:self.pos + length], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8", start) from None
        self.pos += length
        return text

    def skip_strings(self, count: int, what: str) -> None:
        """Walk ``count`` strings, checking each length against the file (the loop is bounded: each string
        takes at least 8 bytes, and ``count`` was checked against the bytes left)."""
        buffer, pos, size = self.buffer, self.pos, self.size
        for index in range(count):
            if size - pos < 8:
                self.pos = pos
                raise self.fail(f"truncated: element {index} of {what}")
            (length,) = _U64.unpack_from(buffer, pos)
            pos += 8
            if length > size - pos:
                raise self.fail(f"element {index} of {what} claims {length} bytes, {size - pos} remain", pos - 8)
            pos += length
        self.pos = pos

    def value(self, value_type: int, key: str):
        if value_type in _SCALARS:
            fmt = "<" + _SCALARS[value_type]
            self.need(struct.calcsize(fmt), f"the value of {key}")
            (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
            self.pos += struct.calcsize(fmt)
            return value
        if value_type == _STRING:
            return self.string(f"the value of {key}")
        if value_type != _ARRAY:
            raise self.fail(f"{key} has value type {value_type}, not one of GGUF's 0-12", self.pos - 4)
        element_type = self.u32(f"{key}'s element type")
        count = self.u64(f"{key}'s count")
        if element_type == _ARRAY:
            raise self.fail(f"{key} is an array of arrays (no model file uses one; refused)")
        if element_type not in _SCALARS and element_type != _STRING:
            raise self.fail(f"{key} has element type {element_type}, not one of GGUF's 0-12", self.pos - 12)
        width = 8 if element_type == _STRING else struct.calcsize("<" + _SCALARS[element_type])
        if count > (self.size - self.pos) // width:
            raise self.fail(f"{key} claims {count} elements, more than the {self.size - self.pos} bytes left hold")
        array = GGUFArray(element_type, count, self.buffer, self.pos, self.path)
        if element_type == _STRING:
            self.skip_strings(count, key)
        else:
            self.pos += width * count
        return array


def read_gguf(path: str | Path) -> GGUFFile:
    """Read and check the GGUF file at ``path`` (its header only: the tensors stay mapped, unread).

    Checks: the magic and version; every string, array and count within the file; value types GGUF defines
    (arrays of arrays refused); no duplicate keys or tensor names; ``general.alignment`` a power of two;
    tensors of 1-4 dimensions, each at least 1, of a type the ``gguf`` package knows, rows of whole blocks, at
    offsets that are multiples of the alignment, inside the file and not overlapping.

    Raises:
        GGUFError: any of those fails, or the file is empty or not a GGUF file.
        OSError: the file cannot be opened.
    """
    import gguf

    path = Path(path)
    name = str(path)
    with path.open("rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(f"{name}: {size} bytes, shorter than a GGUF header (24)")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    cursor = _Cursor(buffer, size, name)
    if buffer[:4] != MAGIC:
        raise GGUFError(f"{name} is not a GGUF file (it starts with {bytes(buffer[:4])!r}, not {MAGIC!r})")
    cursor.pos = 4
    version = cursor.u32("the version")
    if version not in VERSIONS:
        raise cursor.fail(f"GGUF version {version}; kvserve reads versions 2 and 3 (a big-endian file reads as a "
                          "huge version)", 4)
    num_tensors = cursor.u64("the tensor count")
    num_values = cursor.u64("the metadata count")
    if num_values > (size - cursor.pos) // _MIN_KV_BYTES:
        raise cursor.fail(f"{num_values} metadata entries claimed, more than the file's bytes can hold", 16)
    metadata: dict = {}
    for _ in range(num_values):
        at = cursor.pos
        key = cursor.string("a metadata key")
        value_type = cursor.u32(f"{key}'s value type")
        if key in metadata:
            raise cursor.fail(f"metadata key {key} appears twice", at)
        metadata[key] = cursor.value(value_type, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1
            or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT):
        raise GGUFError(f"{name}: general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")
    if num_tensors > (size - cursor.pos) // _MIN_TENSOR_INFO_BYTES:
        raise cursor.fail(f"{num_tensors} tensors claimed, more than the file's bytes can hold", 8)
    infos = []
    seen: set[str] = set()
    for _ in range(num_tensors):
        at = cursor.pos
        tensor_name = cursor.string("a tensor name")
        if len(tensor_name.encode()) > MAX_NAME_BYTES:
            raise cursor.fail(f"tensor name {tensor_name[:80]!r} is longer than {MAX_NAME_BYTES} bytes", at)
        if tensor_name in seen:
            raise cursor.fail(f"tensor {tensor_name} appears twice", at)
        seen.add(tensor_name)
        dims = cursor.u32(f"{tensor_name}'s dimension count")
        if not 1 <= dims <= MAX_DIMS:
            raise cursor.fail(f"{tensor_name} has {dims} dimensions (1 to {MAX_DIMS})", cursor.pos - 4)
        shape = tuple(cursor.u64(f"{tensor_name}'s dimensions") for _ in range(dims))
        elements = 1
        for n in shape:
            if not 1 <= n <= MAX_ELEMENTS:
                raise cursor.fail(f"{tensor_name} has a dimension of {n}", at)
            elements *= n
            if elements > MAX_ELEMENTS:
                raise cursor.fail(f"{tensor_name}'s dimensions {shape} overflow", at)
        type_id = cursor.u32(f"{tensor_name}'s type")
        offset = cursor.u64(f"{tensor_name}'s offset")
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
            block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise cursor.fail(f"{tensor_name} has tensor type {type_id}, which the gguf package does not know",
                              cursor.pos - 12) from None
        if shape[0] % block:
            raise cursor.fail(f"{tensor_name}: rows of {shape[0]} values are not whole {ggml_type.name} blocks of "
                              f"{block}", at)
        if offset % alignment:
            raise cursor.fail(f"{tensor_name}'s offset {offset} is not a multiple of the alignment {alignment}", at)
        infos.append((tensor_name, ggml_type, shape, offset, elements // block * type_bytes))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    array = np.frombuffer(buffer, dtype=np.uint8)
    end_of_previous, previous = data_start, None
    for tensor_name, ggml_type, shape, offset, nbytes in sorted(infos, key=lambda info: info[3]):
        start = data_start + offset
        if nbytes > size - start:
            raise GGUFError(f"{name}: tensor {tensor_name} ({nbytes} bytes at byte {start}) runs past the end of "
                            f"the file ({size} bytes): truncated?")
        if start < end_of_previous:
            raise GGUFError(f"{name}: tensor {tensor_name} at byte {start} overlaps {previous}")
        end_of_previous, previous = start + nbytes, tensor_name
        tensors[tensor_name] = GGUFTensor(tensor_name, ggml_type, shape, start, nbytes, array)
    tensors = {info[0]: tensors[info[0]] for info in infos}  # file order
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    digest.update(buffer[:cursor.pos])
    return GGUFFile(path, version, metadata, tensors, digest.hexdigest()[:16], buffer, array)
