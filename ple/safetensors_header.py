"""Reads the header of a safetensors file: where each tensor's bytes are.

The safetensors package reads tensors but does not tell where their bytes lie
in the file, which is what a memory-mapped gather needs; the header is eight
bytes of length and a JSON object, so it is read here, and checked against the
file so that no later read can fall outside it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .files import open_regular_binary

GGUF_MAGIC = b"GGUF"
# safetensors' own bound on the header; anything larger is a corrupt length.
MAX_HEADER_BYTES = 100 * 1024 * 1024

ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of the first byte, from the start of the file
    nbytes: int


def _entry(path: Path, name: str, info, data_start: int, file_size: int) -> TensorEntry:
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: tensor {name!r}: corrupt safetensors header: {why}")

    if not isinstance(info, dict):
        raise bad(f"entry is {type(info).__name__}, not an object")
    if getattr(info, "duplicates", ()):
        raise bad(f"key {info.duplicates[0]!r} appears twice")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype is {dtype!r}")
    if not (isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise bad(f"shape is {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets are {offsets!r}")
    begin, end = offsets
    if dtype in ITEMSIZE and math.prod(shape) * ITEMSIZE[dtype] != end - begin:
        raise bad(f"{dtype} {shape} needs {math.prod(shape) * ITEMSIZE[dtype]} bytes, "
                  f"data_offsets span {end - begin}")
    if data_start + end > file_size:
        raise ValueError(f"{path}: tensor {name!r}: data (bytes {data_start + begin} to "
                         f"{data_start + end}) runs past the end of the file ({file_size} bytes)")
    return TensorEntry(path, name, dtype, tuple(shape), data_start + begin, end - begin)


class _Object(dict):
    """A JSON object, with the keys that it holds more than once."""
    duplicates: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, object]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicates = tuple(dict.fromkeys(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def check_no_shared_bytes(path: Path, entries: dict[str, TensorEntry], kind: str) -> None:
    """Two tensors whose bytes overlap are a corrupt ``kind`` ("safetensors",
    "GGUF") file: rows of one would be read as another's values.  Tensors of
    no bytes share none, wherever they point."""
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    widest = None  # the span, so far, that reaches furthest
    for begin, end, name in spans:
        if widest is not None and begin < widest[1]:
            raise ValueError(f"{path}: corrupt {kind} header: tensors {widest[2]!r} (bytes "
                             f"{widest[0]} to {widest[1]}) and {name!r} (bytes {begin} to {end}) "
                             "share bytes")
        if widest is None or end > widest[1]:
            widest = (begin, end, name)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file by name.  Raises OSError when the
    file cannot be read and ValueError, naming the file, when it is corrupt,
    not a regular file, names a tensor (or a field of one) twice or has two
    tensors that share bytes."""
    with open_regular_binary(path) as f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: not a safetensors file ({file_size} bytes, "
                             "shorter than the 8-byte header length)")
        if prefix.startswith(GGUF_MAGIC):
            raise ValueError(f"{path}: a GGUF file, not a safetensors file: open it with "
                             "ple.Table.from_gguf(path, tensor)")
        length = int.from_bytes(prefix, "little")
        if length == 0 or length > MAX_HEADER_BYTES or 8 + length > file_size:
            raise ValueError(f"{path}: corrupt safetensors header: header length {length} "
                             f"in a file of {file_size} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_object)
    # ValueError covers bad UTF-8, bad JSON and integers of too many digits;
    # RecursionError, nesting deeper than the parser goes.
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{path}: corrupt safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header: a {type(header).__name__}, "
                         "not an object")
    if header.duplicates:
        name = header.duplicates[0]
        what = "" if name == "__metadata__" else "tensor "
        raise ValueError(f"{path}: corrupt safetensors header: {what}{name!r} appears twice")
    data_start = 8 + length
    entries = {name: _entry(path, name, info, data_start, file_size)
               for name, info in header.items() if name != "__metadata__"}
    # The safetensors package refuses these files too.
    check_no_shared_bytes(path, entries, "safetensors")
    return entries
