"""Reads where the tensors of a GGUF file are, with the gguf package's reader
(which maps the file but reads no tensor data)."""

from __future__ import annotations

import os
from pathlib import Path

from .safetensors_header import TensorEntry


def read_gguf_tensors(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one GGUF file by name, shapes in row-major order (rows
    first) and dtype the GGML type's name.  Raises OSError when the file cannot
    be read and ValueError, naming the file, when it is not a valid GGUF file."""
    from gguf import GGMLQuantizationType, GGUFReader

    file_size = os.stat(path).st_size  # OSError for a missing or unreadable file
    with open(path, "rb"):
        pass
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
