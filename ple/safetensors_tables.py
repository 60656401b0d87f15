"""Choosing a table in safetensors files: which files, which tensor or shard
family, whether its shards fit together, and its scale.  Only headers (and a
scale tensor's few bytes) are read; ``Table.from_safetensors`` opens what
``select_table`` chose."""

from __future__ import annotations

import difflib
import errno
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from .files import nonempty_path, open_regular_binary, resolved_regular_file
from .formats import BY_SAFETENSORS_DTYPE, RowFormat, check_row_bytes
from .safetensors_header import TensorEntry, read_header

# A file, a directory of ``*.safetensors``, or several of either.
PathsLike = Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]]

# A shard of a family: ``<prefix>.shard_<i>.weight``.  ASCII digits only (\d
# would take other scripts' digits, which int() reads); an index with leading
# zeros matches, to be refused by shard_families.
SHARD_NAME = re.compile(r"^(?P<prefix>.+)\.shard_(?P<index>[0-9]+)\.weight$")
SCALE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# transformers' text models name their tensors ``model.<rest>``; the
# multimodal checkpoints they are published in (Gemma 3n, Qwen3.8-Flash-Next)
# ``model.language_model.<rest>``.  transformers maps one to the other on
# loading, and ple takes either name for either layout.
TEXT_PREFIX, PUBLISHED_PREFIX = "model.", "model.language_model."
# How many of the nearest names an error about a missing name shows.
CLOSEST_SHOWN = 5

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelectedTable:
    """What :func:`select_table` chose: the table's name (a tensor's, or a
    shard family's prefix), its shards in row order, its row format, the
    scale of its values (1.0 for formats that are not scaled) and the
    tensor that holds the scale (None: none does)."""

    name: str
    shards: list[TensorEntry]
    row_format: RowFormat
    scale: float
    scale_tensor: TensorEntry | None = None


def resolve_paths(paths: PathsLike) -> list[Path]:
    """The files of ``paths``: each file given, each directory's
    ``*.safetensors`` sorted by name; as absolute real paths
    (:func:`ple.files.resolved_regular_file`)."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[Path] = []
    for item in items:
        path = nonempty_path(item)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(errno.ENOENT, "no *.safetensors files in directory", str(path))
            files.extend(map(resolved_regular_file, found))
        elif path.exists():
            files.append(resolved_regular_file(path))
        else:
            raise FileNotFoundError(errno.ENOENT, "no such table file", str(path))
    if not files:
        raise ValueError("no table files given")
    return files


def describe_files(files: list[Path]) -> str:
    """``files`` for a message: the one file, else how many and where; never
    every path (a published checkpoint has a hundred files and more)."""
    if len(files) == 1:
        return str(files[0])
    parents = {path.parent for path in files}
    return (f"{len(files)} safetensors files in {parents.pop()}" if len(parents) == 1
            else f"{len(files)} safetensors files ({files[0]}, ...)")


def layout_names(name: str) -> list[str]:
    """``name`` as a text checkpoint and as a published multimodal one name
    it, ``name`` first (``model.x`` and ``model.language_model.x``)."""
    if name.startswith(PUBLISHED_PREFIX):
        return [name, TEXT_PREFIX + name.removeprefix(PUBLISHED_PREFIX)]
    if name.startswith(TEXT_PREFIX):
        return [name, PUBLISHED_PREFIX + name.removeprefix(TEXT_PREFIX)]
    return [name]


def find_table(entries: dict[str, TensorEntry], name: str) -> str | None:
    """The name under which ``entries`` hold the tensor or shard family
    ``name`` (see :func:`layout_names`), or None."""
    families = {match["prefix"] for key in entries if (match := SHARD_NAME.match(key))}
    return next((candidate for candidate in layout_names(name)
                 if candidate in entries or candidate in families), None)


def closest_names(entries: dict[str, TensorEntry], name: str) -> list[str]:
    """The tensor names and shard families (``<prefix>.shard_*``) of
    ``entries`` nearest to ``name`` by spelling, the nearest first."""
    candidates = {_candidate(key) for key in entries}
    return difflib.get_close_matches(name, candidates, n=CLOSEST_SHOWN, cutoff=0)


def missing_table(entries: dict[str, TensorEntry], files: list[Path], *names: str) -> ValueError:
    """The error for tables ``names`` (any of them would have done) that
    ``entries`` (of ``files``) lack: the names tried, the nearest names to
    the first, and how many tensors were searched."""
    tried = " or ".join(repr(n) for name in names for n in layout_names(name))
    return ValueError(f"{describe_files(files)}: no tensor or shard family named {tried}; the "
                      f"closest of their {len(entries)} tensors: {closest_names(entries, names[0])}")


def _candidate(key: str) -> str:
    """A tensor as the name of a table: its own, or its shard family's ``<prefix>.shard_*``."""
    shard = SHARD_NAME.match(key)
    return f"{shard['prefix']}.shard_*" if shard else key


def _shown(values: list, limit: int = 20) -> list:
    """``values`` for a message: the first ``limit``, then "..."."""
    return values if len(values) <= limit else [*values[:limit], "..."]


def read_entries(files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor of ``files`` by name; a name in two files is a ValueError."""
    entries: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if name in entries:
                raise ValueError(f"tensor {name!r} is in both {entries[name].path} and {path}")
            entries[name] = entry
    return entries


def read_checkpoint_entries(paths: PathsLike) -> dict[str, TensorEntry]:
    """Every tensor of safetensors files (a file, a list of files or a
    directory of ``*.safetensors``) by name, from their headers alone."""
    return read_entries(resolve_paths(paths))


def shard_families(entries: dict[str, TensorEntry]) -> dict[str, dict[int, TensorEntry]]:
    """The shard families by prefix.  A shard index written with leading zeros
    (``x.shard_01.weight``) is a ValueError naming the file and the tensor."""
    families: dict[str, dict[int, TensorEntry]] = {}
    for name, entry in entries.items():
        match = SHARD_NAME.match(name)
        if match:
            family = families.setdefault(match["prefix"], {})
            index = int(match["index"])
            if match["index"] != str(index):
                raise ValueError(
                    f"{entry.path}: tensor {name!r}: shard index {match['index']!r} has leading "
                    f"zeros; shard {index} of {match['prefix']!r} must be named "
                    f"'{match['prefix']}.shard_{index}.weight'")
            if index in family:
                raise ValueError(f"{entry.path}: {name!r} and {family[index].name!r} "
                                 f"({family[index].path}) are both shard {index}")
            family[index] = entry
    return families


def _choose(entries, families, tensor, files) -> tuple[str, list[TensorEntry], str]:
    """The chosen table: its name, its shards in row order, its scale tensor's name."""
    where = describe_files(files)
    if tensor is None:
        in_family = {e.name for family in families.values() for e in family.values()}
        candidates = [f"{p}.shard_*" for p in sorted(families)] + sorted(
            name for name, e in entries.items() if len(e.shape) == 2 and name not in in_family)
        if len(candidates) != 1:
            raise ValueError(f"{where}: {len(candidates)} candidate tables {_shown(candidates)}; "
                             "pass tensor= to choose one")
        tensor = candidates[0].removesuffix(".shard_*")
    found = find_table(entries, tensor)
    if found is None:
        raise missing_table(entries, files, tensor)
    if found != tensor:
        logger.info("ple: %r is %r in %s", tensor, found, where)
        tensor = found
    if tensor in families and tensor in entries:
        raise ValueError(f"{where}: {tensor!r} names both a tensor and a shard family")
    if tensor in families:
        family = families[tensor]
        indices = sorted(family)
        missing = next((i for i, index in enumerate(indices) if index != i), None)
        if missing is not None:
            before = (f"; shard {missing - 1} is in {family[missing - 1].path}" if missing
                      else "")
            raise ValueError(f"{where}: shard gap in {tensor!r}: shard {missing} is missing "
                             f"(found shards {_shown(indices)}{before})")
        return tensor, [family[i] for i in range(len(family))], scale_name(tensor, family=True)
    return tensor, [entries[tensor]], scale_name(tensor)


def scale_name(table: str, family: bool = False) -> str:
    """The name of the scale tensor of table ``table``: ``<prefix>.weight_scale``
    for a shard family (``family``) and for one of its shards,
    ``<tensor>_scale`` for a tensor of its own."""
    if family:
        return f"{table}.weight_scale"
    shard = SHARD_NAME.match(table)
    return f"{shard['prefix']}.weight_scale" if shard else f"{table}_scale"


def _check_shards(name: str, shards: list[TensorEntry]) -> None:
    """That the shards make one table: 2-D, one dtype and width, every shard
    but the last of the same rows, a supported dtype, rows of some bytes."""
    first = shards[0]
    for shard in shards:
        if len(shard.shape) != 2:
            raise ValueError(f"{shard.path}: tensor {shard.name!r} of {name!r} is not 2-D "
                             f"(shape {list(shard.shape)})")
        if shard.dtype != first.dtype or shard.shape[1] != first.shape[1]:
            raise ValueError(
                f"{shard.path}: tensor {shard.name!r} is {shard.dtype} {list(shard.shape)}, but "
                f"{first.name!r} in {first.path} is {first.dtype} {list(first.shape)}: shards of "
                "one table need the same dtype and width")
    for shard in shards[1:-1]:
        if shard.shape[0] != first.shape[0]:
            raise ValueError(
                f"{shard.path}: tensor {shard.name!r} has {shard.shape[0]} rows, but "
                f"{first.name!r} has {first.shape[0]}: every shard but the last has the same rows")
    last = shards[-1]
    if len(shards) > 1 and last.shape[0] > first.shape[0]:
        raise ValueError(f"{last.path}: last shard {last.name!r} has {last.shape[0]} rows, more "
                         f"than {first.name!r} ({first.shape[0]})")
    if first.dtype not in BY_SAFETENSORS_DTYPE:
        raise ValueError(f"{first.path}: tensor {first.name!r}: dtype {first.dtype} is not a "
                         f"supported row format ({', '.join(BY_SAFETENSORS_DTYPE)})")
    if first.shape[1] == 0:
        raise ValueError(f"{first.path}: tensor {first.name!r} has rows of no values")
    check_row_bytes(f"{first.path}: tensor {first.name!r}",
                    BY_SAFETENSORS_DTYPE[first.dtype].row_bytes(first.shape[1]))


def read_scale_tensor(entry: TensorEntry) -> torch.Tensor:
    """A scale tensor as its file holds it (one F32, F16 or BF16 value, of its shape)."""
    if entry.dtype not in SCALE_DTYPES or entry.nbytes != SCALE_DTYPES[entry.dtype].itemsize:
        raise ValueError(f"{entry.path}: scale tensor {entry.name!r} must hold one F32, F16 or "
                         f"BF16 value, not {entry.dtype} {list(entry.shape)}")
    with open_regular_binary(entry.path) as f:
        f.seek(entry.offset)
        raw = bytearray(f.read(entry.nbytes))
    return torch.frombuffer(raw, dtype=SCALE_DTYPES[entry.dtype]).reshape(entry.shape)


def _read_scale(entry: TensorEntry, given: float | None) -> float:
    """The value of a scale tensor; `given`, a caller's scale, must agree with
    it once rounded to the tensor's dtype."""
    value = read_scale_tensor(entry).item()
    if given is not None and torch.tensor(given, dtype=SCALE_DTYPES[entry.dtype]).item() != value:
        raise ValueError(f"{entry.path}: {entry.name!r} is {value}, but scale={given} was given")
    return value


def select_table(paths: PathsLike, tensor: str | None = None, scale: float | None = None
                 ) -> SelectedTable:
    """The table ``Table.from_safetensors(paths, tensor, scale=scale)`` opens
    (see there), checked; a ValueError says what does not fit and where."""
    files = resolve_paths(paths)
    entries = read_entries(files)
    name, shards, scale_key = _choose(entries, shard_families(entries), tensor, files)
    _check_shards(name, shards)
    fmt = BY_SAFETENSORS_DTYPE[shards[0].dtype]
    if not fmt.scaled and (scale is not None or scale_key in entries):
        raise ValueError(f"{shards[0].path}: {name!r} holds {fmt.name} rows, which are not "
                         "scaled; scales apply to fp8_e4m3fn, u8 and i8 rows")
    scale_tensor = entries.get(scale_key)
    file_scale = _read_scale(scale_tensor, scale) if scale_tensor is not None else None
    resolved = file_scale if file_scale is not None else 1.0 if scale is None else float(scale)
    return SelectedTable(name, shards, fmt, resolved, scale_tensor)
