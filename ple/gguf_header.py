"""Reads where the tensors of a GGUF file are.

The whole header (key-values and tensor infos) is walked here, with every
count, length, dimension, type and offset checked against the file and the
GGUF rules, in Python ints (no uint64 wrap-around), so that a corrupt file is
a ValueError that says what is wrong and where.  The gguf package's reader is
not used to open tables: it trusts the counts it reads, adds offsets in
uint64 (an offset near 2**64 wrapped onto the header), and parses every
key-value into numpy (seconds for a large vocabulary); the tests check that
it reads valid files as this walk does."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from .files import open_regular_binary
from .safetensors_header import TensorEntry, check_no_shared_bytes


# Sizes of GGUF's scalar value types (gguf.GGUFValueType), by type number.
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# The integer types among them (unsigned, then signed), which read_gguf_header returns.
UNSIGNED_INTEGERS, SIGNED_INTEGERS = (0, 2, 4, 10), (1, 3, 5, 11)
UINT32, STRING, ARRAY = 4, 8, 9
# The fewest bytes a tensor info takes: name length, dimension count (of no
# dimensions), type, offset.
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
MIN_KV_BYTES = 8 + 4 + 1
VERSIONS = (2, 3)  # those gguf.GGUFReader reads
MAX_DIMS = 4  # GGML_MAX_DIMS: GGUF tensors have at most four dimensions
INT64_MAX = 2**63 - 1  # ggml counts elements in int64
DEFAULT_ALIGNMENT = 32  # gguf.GGUF_DEFAULT_ALIGNMENT
# Names the gguf reader gives its own fields: a key of one of these names is a
# duplicate key to it.
RESERVED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: the row length (ne0) first
    ggml_type: int
    offset: int  # from the start of the data section
    at: int  # where the info starts in the file


class _Walk:
    """Walks a GGUF header, checking that every count and length fits in what
    is left of the file, so that a corrupt count is an error at once, not a
    walk of minutes."""

    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.at = path, data, 0

    def bad(self, why: str, at: int | None = None) -> ValueError:
        at = self.at if at is None else at
        return ValueError(f"{self.path}: not a readable GGUF file: {why} at byte {at}")

    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, size: int) -> bytes:
        if size > self.left():
            raise self.bad(f"{size} bytes needed, {self.left()} left")
        chunk = self.data[self.at:self.at + size]
        self.at += size
        return chunk

    def number(self, size: int) -> int:
        return int.from_bytes(self.take(size), "little")

    def text(self, what: str) -> str:
        """A length-prefixed UTF-8 string (a key or a tensor name)."""
        at = self.at
        raw = self.take(self.number(8))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"{what} {raw[:64]!r} is not UTF-8", at) from None

    def array_head(self) -> tuple[int, int]:
        """An array's item type and count, checked to fit in what is left
        (each item at least its scalar size, 8 bytes a string, else 12)."""
        item, count = self.number(4), self.number(8)
        least = SCALAR_BYTES.get(item, 8 if item == STRING else 12)
        if count * least > self.left():
            raise self.bad(f"an array of {count} items does not fit")
        return item, count

    def integers(self, kind: int, key: str, at: int) -> int | list[int]:
        """A value of an integer type ``kind``, or an array of one."""
        if kind == ARRAY:
            item, count = self.array_head()
            if item not in UNSIGNED_INTEGERS + SIGNED_INTEGERS:
                raise self.bad(f"{key} is an array of value type {item}, not of integers", at)
            return [self.integers(item, key, at) for _ in range(count)]
        if kind not in UNSIGNED_INTEGERS + SIGNED_INTEGERS:
            raise self.bad(f"{key} is of value type {kind}, not an integer", at)
        return int.from_bytes(self.take(SCALAR_BYTES[kind]), "little",
                              signed=kind in SIGNED_INTEGERS)

    def skip(self, kind: int) -> None:
        """Skips a value of type ``kind``."""
        if kind in SCALAR_BYTES:
            self.take(SCALAR_BYTES[kind])
        elif kind == STRING:
            self.take(self.number(8))
        elif kind == ARRAY:
            item, count = self.array_head()
            if item in SCALAR_BYTES:  # fixed-size items: skipped at once
                self.take(count * SCALAR_BYTES[item])
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            raise self.bad(f"unknown value type {kind}")


def _walk_header(path: Path, header: bytes, wanted: frozenset[str]
                 ) -> tuple[list[_TensorInfo], int, int, dict[str, int | list[int]]]:
    """The tensor infos, the alignment, where the data section starts, and
    the values of the integer keys in ``wanted`` that the file has."""
    if header[:4] != b"GGUF":  # the caller turned away files under 24 bytes
        raise ValueError(f"{path}: not a readable GGUF file: no GGUF magic and counts")
    walk = _Walk(path, header)
    walk.take(4)
    version = walk.number(4)
    if version not in VERSIONS:
        # A big-endian file's version reads as 2 or 3 shifted left by 24 bits
        # here (the reader would read it, byte-swapped); its rows are
        # big-endian too, which ple does not decode.
        endian = " (a big-endian file?)" if version in (2 << 24, 3 << 24) else ""
        raise walk.bad(f"version {version}{endian}; ple reads little-endian GGUF versions "
                       f"{' and '.join(map(str, VERSIONS))}", 4)
    tensors, pairs = walk.number(8), walk.number(8)
    if tensors * MIN_TENSOR_INFO_BYTES + pairs * MIN_KV_BYTES > len(header):
        raise ValueError(f"{path}: not a readable GGUF file: {tensors} tensors and {pairs} "
                         f"key-value pairs cannot fit in {len(header)} bytes")
    keys = set(RESERVED_KEYS)
    alignment = DEFAULT_ALIGNMENT
    values = {}
    for _ in range(pairs):
        at = walk.at
        key = walk.text("a key")
        if key in keys:
            raise walk.bad(f"key {key!r} appears twice" if key not in RESERVED_KEYS
                           else f"key {key!r} is a name the gguf reader keeps for itself",
                           at)
        keys.add(key)
        kind = walk.number(4)
        if key == "general.alignment":
            if kind != UINT32:
                raise walk.bad(f"general.alignment is of value type {kind}, not UINT32 "
                               f"({UINT32})", at)
        elif key not in wanted:
            walk.skip(kind)
            continue
        # Read once, for the alignment, for the caller, or for both: the
        # alignment is applied whether or not the caller also asks for it.
        value = walk.integers(kind, key, at)
        if key == "general.alignment":
            if value == 0 or value & (value - 1):
                raise walk.bad(f"general.alignment {value} is not a power of two", at)
            alignment = value
        if key in wanted:
            values[key] = value
    infos, names = [], set()
    for index in range(tensors):
        at = walk.at
        name = walk.text(f"the name of tensor {index}")
        if name in names:
            raise walk.bad(f"tensor {name!r} appears twice", at)
        names.add(name)
        n_dims = walk.number(4)
        if n_dims > MAX_DIMS:
            raise walk.bad(f"tensor {name!r} has {n_dims} dimensions, GGUF allows at most "
                           f"{MAX_DIMS}", walk.at - 4)
        dims = tuple(walk.number(8) for _ in range(n_dims))
        ggml_type, offset = walk.number(4), walk.number(8)
        infos.append(_TensorInfo(name, dims, ggml_type, offset, at))
    data_start = walk.at + -walk.at % alignment
    return infos, alignment, data_start, values


def _entry(path: Path, info: _TensorInfo, alignment: int, data_start: int,
           file_size: int) -> TensorEntry:
    """A tensor info checked against the GGML rules and the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: tensor {info.name!r} (info at byte {info.at}): {why}")

    try:
        ggml_type = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise bad(f"unknown GGML type {info.ggml_type}") from None
    if any(d > INT64_MAX for d in info.dims):
        raise bad(f"dimensions {list(info.dims)} are negative as int64")
    if ggml_type not in GGML_QUANT_SIZES:
        raise bad(f"GGML type {ggml_type.name} has no known block size")
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    row = info.dims[0] if info.dims else 1
    if row % block:
        raise bad(f"a row of {row} values is not a whole number of {ggml_type.name} blocks "
                  f"of {block}")
    # Zero dimensions counted as one: numpy (the reader) shapes even an empty
    # tensor only when its other dimensions' bytes fit in int64.
    elements = extent = 1
    for d in info.dims:
        elements, extent = elements * d, extent * max(d, 1)
    if extent // block * block_bytes > INT64_MAX:
        raise bad(f"{ggml_type.name} dimensions {list(info.dims)} span more bytes than int64 "
                  f"counts")
    nbytes = elements // block * block_bytes
    if info.offset % alignment:
        raise bad(f"data offset {info.offset} is not a multiple of the alignment {alignment}")
    begin = data_start + info.offset
    if begin + nbytes > file_size:
        raise bad(f"data (bytes {begin} to {begin + nbytes}) runs past the end of the file "
                  f"({file_size} bytes)")
    return TensorEntry(path, info.name, ggml_type.name, tuple(reversed(info.dims)), begin, nbytes)


@dataclass(frozen=True)
class GGUFHeader:
    """What read_gguf_header found: the tensors by name, and the integer
    key-values asked for (an array as a list)."""
    tensors: dict[str, TensorEntry]
    values: dict[str, int | list[int]]


def read_gguf_header(path: Path, keys=()) -> GGUFHeader:
    """The tensors of one GGUF file by name, shapes in row-major order (rows
    first) and dtype the GGML type's name, and the values of those of
    ``keys`` that the file has (integers, or arrays of integers; a key of
    another type is a ValueError).  Raises OSError when the file cannot be
    read and ValueError, naming the file (and the tensor), when it is not a
    regular file or not a valid GGUF file (two tensors that share bytes
    included)."""
    # OSError for a missing or unreadable file, ValueError for one that is not
    # a regular file (a FIFO would block the open).
    with open_regular_binary(path) as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 24:
            raise ValueError(f"{path}: not a readable GGUF file: {file_size} bytes")
        # Mapped, not read: the walk touches the header's pages only.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
            try:
                infos, alignment, data_start, values = _walk_header(path, header, frozenset(keys))
            except RecursionError:  # arrays of arrays nested deeper than Python recurses
                raise ValueError(f"{path}: corrupt GGUF header: arrays nested too deep") from None
    tensors = {info.name: _entry(path, info, alignment, data_start, file_size) for info in infos}
    # The gguf reader reads two tensors on one span as two tensors; ggml's
    # loader refuses them, as it wants each tensor where the one before ends.
    check_no_shared_bytes(path, tensors, "GGUF")
    return GGUFHeader(tensors, values)
