"""Reads where the tensors of a GGUF file are, with the gguf package's reader
(which maps the file but reads no tensor data)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from .safetensors_header import TensorEntry


def read_gguf_tensors(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one GGUF file by name, shapes in row-major order (rows
    first) and dtype the GGML type's name.  Raises OSError when the file cannot
    be read and ValueError, naming the file, when it is not a valid GGUF file."""
    from gguf import GGMLQuantizationType, GGUFReader

    file_size = os.stat(path).st_size  # OSError for a missing or unreadable file
    with open(path, "rb") as f:
        if file_size < 24:
            raise ValueError(f"{path}: not a readable GGUF file: {file_size} bytes")
        # Mapped, not read: the walk touches the header's pages only.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
            _check_counts(path, header, file_size)
    try:
        reader = GGUFReader(path)
        tensors = list(reader.tensors)
    except OSError:
        raise
    except Exception as error:  # the reader's errors on corrupt input are of many kinds
        raise ValueError(f"{path}: not a readable GGUF file: {error}") from None
    entries = {}
    for tensor in tensors:
        try:
            dtype = GGMLQuantizationType(int(tensor.tensor_type)).name
        except ValueError:
            dtype = f"type {int(tensor.tensor_type)}"
        entry = TensorEntry(path, tensor.name, dtype,
                            tuple(int(d) for d in reversed(tensor.shape.tolist())),
                            int(tensor.data_offset), int(tensor.n_bytes))
        if entry.offset + entry.nbytes > file_size:
            raise ValueError(f"{path}: tensor {entry.name!r}: data (bytes {entry.offset} to "
                             f"{entry.offset + entry.nbytes}) runs past the end of the file "
                             f"({file_size} bytes)")
        entries[tensor.name] = entry
    return entries


# Sizes of GGUF's scalar value types (gguf.GGUFValueType), by type number.
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
# The fewest bytes a tensor info takes: name length, dimension count, one
# dimension, type, offset.
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


class _Walk:
    """Walks the key-value section of a GGUF header checking only that every
    count and length fits in what is left of the file, so that the reader,
    which trusts them, never walks a corrupt count for minutes."""

    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.at = path, data, 0

    def bad(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: not a readable GGUF file: {why} at byte {self.at}")

    def take(self, size: int) -> bytes:
        if size > len(self.data) - self.at:
            raise self.bad(f"{size} bytes needed, {len(self.data) - self.at} left")
        chunk = self.data[self.at:self.at + size]
        self.at += size
        return chunk

    def number(self, size: int) -> int:
        return int.from_bytes(self.take(size), "little")

    def value(self, kind: int) -> None:
        if kind in SCALAR_BYTES:
            self.take(SCALAR_BYTES[kind])
        elif kind == STRING:
            self.take(self.number(8))
        elif kind == ARRAY:
            item, count = self.number(4), self.number(8)
            least = SCALAR_BYTES.get(item, 8 if item == STRING else 12)
            if count * least > len(self.data) - self.at:
                raise self.bad(f"an array of {count} items does not fit")
            for _ in range(count):
                self.value(item)
        else:
            raise self.bad(f"unknown value type {kind}")


def _check_counts(path: Path, header: bytes, file_size: int) -> None:
    if len(header) < 24 or header[:4] != b"GGUF":
        raise ValueError(f"{path}: not a readable GGUF file: no GGUF magic and counts")
    walk = _Walk(path, header)
    walk.take(8)
    tensors, pairs = walk.number(8), walk.number(8)
    if tensors * MIN_TENSOR_INFO_BYTES + pairs * (8 + 4 + 1) > file_size:
        raise ValueError(f"{path}: not a readable GGUF file: {tensors} tensors and {pairs} "
                         f"key-value pairs cannot fit in {file_size} bytes")
    for _ in range(pairs):
        walk.take(walk.number(8))  # the key
        walk.value(walk.number(4))
